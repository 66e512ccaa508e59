// End to end: real shardps-server and shardps-worker processes training on
// Fashion-MNIST. Sync data parallelism must give the weights of a single
// worker training on the whole global batch, on any number of servers.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::MustRun;
using ::shardps::testing::TestCluster;

// Flags of a short run on a subset of the data.
std::vector<std::string> TrainingFlags() {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-64-32-10",
          "--batch_size=64",
          "--max_steps=50",
          "--train_limit=6400",
          "--test_limit=500",
          "--optimizer=sgd",
          "--lr=0.1",
          "--momentum=0.9",
          "--lr_schedule=cosine",
          "--chunk_kib=16",
          "--backend=cpu",
          "--seed=5"};
}

// Trains with `servers` shard processes and `workers` worker processes;
// returns the model rank 0 wrote.
absl::StatusOr<std::vector<LoadedTensor>> TrainCluster(
    int servers, int workers, std::vector<std::string> extra_flags = {},
    std::vector<std::string> server_flags = {}) {
  ClusterOptions o;
  o.server_flags = std::move(server_flags);
  o.num_servers = servers;
  o.num_workers = workers;
  o.worker_flags = TrainingFlags();
  o.worker_flags.insert(o.worker_flags.end(), extra_flags.begin(),
                        extra_flags.end());
  TestCluster cluster(std::move(o));
  if (!cluster.StartServers() ||
      !cluster.StartWorkers({{cluster.model_out_flag()}})) {
    return absl::InternalError("the cluster did not start");
  }
  if (absl::Status s = cluster.WorkersSucceed(absl::Seconds(240)); !s.ok()) {
    return s;
  }
  return cluster.ReadModel();
}

TEST(WorkerE2ETest, SyncWorkersMatchASingleWorkerOnAnyNumberOfServers) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  absl::StatusOr<std::vector<LoadedTensor>> reference = TrainCluster(1, 1);
  SHARDPS_ASSERT_OK(reference);
  ASSERT_EQ(reference->size(), 6u);
  struct Config {
    int servers, workers;
  };
  for (Config c : {Config{1, 2}, Config{2, 2}, Config{3, 2}, Config{1, 4},
                   Config{2, 4}, Config{3, 4}}) {
    SCOPED_TRACE(absl::StrCat(c.servers, " servers, ", c.workers, " workers"));
    absl::StatusOr<std::vector<LoadedTensor>> got =
        TrainCluster(c.servers, c.workers);
    SHARDPS_ASSERT_OK(got);
    ASSERT_EQ(got->size(), reference->size());
    double max_diff = 0.0;
    for (size_t t = 0; t < got->size(); ++t) {
      ASSERT_EQ((*got)[t].name, (*reference)[t].name);
      ASSERT_EQ((*got)[t].data.size(), (*reference)[t].data.size());
      for (size_t i = 0; i < (*got)[t].data.size(); ++i) {
        max_diff = std::max<double>(
            max_diff, std::abs((*got)[t].data[i] - (*reference)[t].data[i]));
      }
    }
    // Only the float summation order differs (slices summed per worker,
    // then averaged on the servers).
    EXPECT_LE(max_diff, 1e-5);
    std::printf("%d servers, %d workers: max |w - w_1worker| = %.3g\n",
                c.servers, c.workers, max_diff);
  }
}

// A receive budget of about one 16 KiB chunk: 4 workers' streams are parked
// most of the time, the least rank a sum needs next reads past it, and the
// job ends with the same model bitwise as without a budget (it would hang
// if the budget could deadlock).
TEST(WorkerE2ETest, ATinyReceiveBudgetChangesNoResult) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  absl::StatusOr<std::vector<LoadedTensor>> free =
      TrainCluster(2, 4, {}, {"--max_inflight_mib=0"});
  ASSERT_TRUE(free.ok()) << free.status();
  // Through shared memory (message rings: only early gradients count),
  // then over gRPC (each read takes a 16 KiB chunk's bytes: one at a time).
  for (bool shared_memory : {true, false}) {
    SCOPED_TRACE(shared_memory ? "shared memory" : "gRPC");
    absl::StatusOr<std::vector<LoadedTensor>> tight =
        TrainCluster(2, 4, {},
                     {"--max_inflight_mib=0.02",
                      absl::StrCat("--shared_memory=", shared_memory)});
    ASSERT_TRUE(tight.ok()) << tight.status();
    ASSERT_EQ(free->size(), tight->size());
    for (size_t i = 0; i < free->size(); ++i) {
      EXPECT_EQ((*free)[i].data, (*tight)[i].data) << (*free)[i].name;
    }
  }
}

TEST(WorkerE2ETest, CompressedRunsDoNotDependOnTheNumberOfServers) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // Top-k gradients with error feedback, sparse weights: chunks are the
  // same on any number of shards, so every codec's choices are too.
  const std::vector<std::string> flags = {"--compression=topk:0.05",
                                          "--weight_encoding=topk:0.2"};
  absl::StatusOr<std::vector<LoadedTensor>> one = TrainCluster(1, 2, flags);
  SHARDPS_ASSERT_OK(one);
  absl::StatusOr<std::vector<LoadedTensor>> three = TrainCluster(3, 2, flags);
  SHARDPS_ASSERT_OK(three);
  absl::StatusOr<std::vector<LoadedTensor>> fp32 = TrainCluster(3, 2);
  SHARDPS_ASSERT_OK(fp32);
  ASSERT_EQ(one->size(), three->size());
  bool differs_from_fp32 = false;
  for (size_t t = 0; t < one->size(); ++t) {
    EXPECT_EQ((*one)[t].data, (*three)[t].data) << (*one)[t].name;
    differs_from_fp32 |= (*one)[t].data != (*fp32)[t].data;
  }
  EXPECT_TRUE(differs_from_fp32);
}

TEST(WorkerE2ETest, ClippedRunsDoNotDependOnTheNumberOfServers) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // Global-norm clipping on the servers (two-phase steps): the norm is the
  // chunks' sums of squares added in chunk order, the same on any number of
  // shards, so the weights are bitwise the same; and clipping changes them.
  const std::vector<std::string> flags = {"--clip_grad_norm=0.05"};
  absl::StatusOr<std::vector<LoadedTensor>> one = TrainCluster(1, 2, flags);
  SHARDPS_ASSERT_OK(one);
  absl::StatusOr<std::vector<LoadedTensor>> three = TrainCluster(3, 2, flags);
  SHARDPS_ASSERT_OK(three);
  absl::StatusOr<std::vector<LoadedTensor>> unclipped = TrainCluster(3, 2);
  SHARDPS_ASSERT_OK(unclipped);
  ASSERT_EQ(one->size(), three->size());
  bool differs = false;
  for (size_t t = 0; t < one->size(); ++t) {
    EXPECT_EQ((*one)[t].data, (*three)[t].data) << (*one)[t].name;
    differs |= (*one)[t].data != (*unclipped)[t].data;
  }
  EXPECT_TRUE(differs);
}

// Runs a worker that must fail before training; returns its exit code and
// log.
std::pair<int, std::string> RunFailingWorker(std::vector<std::string> args) {
  args.push_back("--servers=127.0.0.1:1");
  args.push_back("--connect_timeout_s=2");
  CommandResult r = MustRun(SHARDPS_WORKER_BIN, args, absl::Seconds(60));
  return {r.code, std::move(r.output)};
}

TEST(WorkerE2ETest, BadInputIsAClearErrorNotACrash) {
  const std::string dir = testing::MakeTempDir("shardps-bad-data");
  // A truncated IDX image file beside a good-looking label file.
  {
    std::ofstream images(dir + "/train-images-idx3-ubyte", std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 3,  0, 0, 0, 10,
                                    0, 0, 0, 28, 0, 0, 0, 28};
    images.write(reinterpret_cast<const char*>(header), sizeof(header));
    images << "too short";
    std::ofstream labels(dir + "/train-labels-idx1-ubyte", std::ios::binary);
    const unsigned char lheader[] = {0, 0, 8, 1, 0, 0, 0, 10};
    labels.write(reinterpret_cast<const char*>(lheader), sizeof(lheader));
    labels << std::string(10, '\1');
  }
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  std::vector<Case> cases = {
      {{"--dataset=idx:/nonexistent/dir"}, "/nonexistent/dir"},
      {{"--dataset=idx:" + dir}, "train-images-idx3-ubyte"},
      {{"--dataset=csv:/nonexistent.csv"}, "/nonexistent.csv"},
      {{"--dataset=mnist-ish"}, "mnist-ish"},
      {{"--rank=2", "--num_workers=2"}, "--rank=2"},
      {{"--optimizer=rmsprop"}, "--optimizer=rmsprop"},
      {{"--backend=tpu"}, "--backend=tpu"},
      {{"--compression=zstd"}, "unknown compression \"zstd\""},
      {{"--compression=topk:0"}, "topk:0 needs a ratio in (0, 1]"},
      {{"--weight_encoding=int8"}, "--weight_encoding"},
      {{"--clip_grad_norm=-1"}, "--clip_grad_norm=-1"},
      {{"--clip_grad_norm=nan"}, "--clip_grad_norm=nan"},
      {{"--link_rate=fast"}, "--link_rate=fast"},
      {{"--link_rate=1gbps"}, "tc reads bps"},
  };
  if (testing::HaveFashionMnist()) {
    cases.push_back({{"--model=mlp:100-10"}, "100"});
    cases.push_back({{"--model=mlp:784-10-7"}, "7"});
    cases.push_back(
        {{"--batch_size=3", "--num_workers=2"}, "not divisible by the 2"});
    cases.push_back({{"--batch_size=1", "--num_workers=2", "--rank=1"},
                     "smaller than the 2 workers"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    auto [code, log] = RunFailingWorker(c.args);
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find(c.message), std::string::npos) << log;
    EXPECT_NE(log.find("ERROR"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace shardps
