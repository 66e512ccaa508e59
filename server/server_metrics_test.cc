#include "server/server_metrics.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/chunking.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/shard_checkpointer.h"
#include "server/store_testing.h"
#include "tests/testing/exposition.h"

namespace shardps::server {
namespace {

using ::shardps::testing::ParseExposition;
using ::shardps::testing::SampleOr;
using ::shardps::testing::Samples;

// A store of one 4-element chunk, SGD, reporting to a fresh registry.
class ServerMetricsTest : public ::testing::Test {
 protected:
  void Make(uint32_t workers, v1::Consistency mode) {
    StoreOptions o;
    o.num_workers = workers;
    o.mode = mode;
    o.metrics = &metrics_;
    store_ = std::make_unique<ParameterStore>(o);
    v1::DeclareRequest req;
    v1::TensorSpec* t = req.mutable_layout()->add_tensors();
    t->set_name("w");
    t->add_shape(4);
    req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
    req.mutable_optimizer()->set_learning_rate(1.0f);
    req.set_num_shards(1);
    SHARDPS_ASSERT_OK(store_->Declare(req).status());
  }
  absl::Status Push(uint32_t rank, int64_t step) {
    const std::vector<float> grad = {1, 2, 3, 4};
    const std::string bytes(reinterpret_cast<const char*>(grad.data()), 16);
    StringByteSource payload(bytes);
    PushArgs args;
    args.rank = rank;
    args.step = step;
    args.payload = &payload;
    return store_->Push(args, sink_);
  }
  Samples Scrape() {
    absl::StatusOr<Samples> s = ParseExposition(exporter_.Scrape());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : Samples();
  }

  MetricsExporter exporter_;
  ServerMetrics metrics_{exporter_.registry()};
  std::shared_ptr<CollectingSink> sink_ = std::make_shared<CollectingSink>();
  std::unique_ptr<ParameterStore> store_;
};

TEST_F(ServerMetricsTest, SyncStepObservesStepAndAggregationOnce) {
  Make(2, v1::CONSISTENCY_SYNC);
  SHARDPS_ASSERT_OK(Push(0, 0));
  EXPECT_EQ(SampleOr(Scrape(), "shardps_server_step_seconds_count"), 0);
  SHARDPS_ASSERT_OK(Push(1, 0));
  ASSERT_EQ(sink_->Wait(2).size(), 2u);
  const Samples s = Scrape();
  EXPECT_EQ(SampleOr(s, "shardps_server_step_seconds_count"), 1);
  EXPECT_EQ(SampleOr(s, "shardps_server_aggregation_seconds_count"), 1);
  EXPECT_EQ(SampleOr(s, "shardps_server_staleness_steps_count"), 0);
}

TEST_F(ServerMetricsTest, AsyncPushesObserveHowFarBehindTheyAre) {
  Make(2, v1::CONSISTENCY_ASYNC);
  for (int64_t step = 0; step < 3; ++step) SHARDPS_ASSERT_OK(Push(0, step));
  SHARDPS_ASSERT_OK(Push(1, 0));  // two steps behind rank 0's last push
  ASSERT_EQ(sink_->Wait(4).size(), 4u);
  const Samples s = Scrape();
  EXPECT_EQ(SampleOr(s, "shardps_server_staleness_steps_count"), 4);
  EXPECT_EQ(SampleOr(s, "shardps_server_staleness_steps_sum"), 2);
  EXPECT_EQ(SampleOr(s, "shardps_server_staleness_steps_bucket{le=\"1\"}"), 3);
  EXPECT_EQ(SampleOr(s, "shardps_server_aggregation_seconds_count"), 4);
  EXPECT_EQ(SampleOr(s, "shardps_server_step_seconds_count"), 0);
}

TEST_F(ServerMetricsTest, CountsRejectionsByCode) {
  metrics_.Rejected(absl::OutOfRangeError("step 3 is in the future"));
  metrics_.Rejected(absl::OutOfRangeError("step 4 is in the future"));
  metrics_.Rejected(absl::NotFoundError("chunk 9"));
  const Samples s = Scrape();
  EXPECT_EQ(SampleOr(s,
                     "shardps_server_rejected_requests_total{code=\"OUT_OF_"
                     "RANGE\"}"),
            2);
  EXPECT_EQ(
      SampleOr(s, "shardps_server_rejected_requests_total{code=\"NOT_FOUND\"}"),
      1);
}

TEST_F(ServerMetricsTest, CheckpointsSetTheirStepsAndCountFailures) {
  CheckpointWrite written;
  written.step = 500;
  written.bytes = 1000;
  written.seconds = 0.02;
  metrics_.CheckpointDone(written);
  written.step = 1000;
  written.committed = true;
  metrics_.CheckpointDone(written);
  metrics_.CheckpointDone(absl::ResourceExhaustedError("skipped"));
  metrics_.CheckpointDone(absl::FailedPreconditionError("disk full"));
  const Samples s = Scrape();
  EXPECT_EQ(SampleOr(s, "shardps_checkpoint_last_written_step"), 1000);
  EXPECT_EQ(SampleOr(s, "shardps_checkpoint_last_committed_step"), 1000);
  EXPECT_EQ(SampleOr(s, "shardps_checkpoint_bytes_total"), 2000);
  EXPECT_EQ(SampleOr(s, "shardps_checkpoint_duration_seconds_count"), 2);
  EXPECT_EQ(
      SampleOr(s, "shardps_checkpoint_failures_total{reason=\"skipped\"}"), 1);
  EXPECT_EQ(SampleOr(s, "shardps_checkpoint_failures_total{reason=\"error\"}"),
            1);
}

}  // namespace
}  // namespace shardps::server
