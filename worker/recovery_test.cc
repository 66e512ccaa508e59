#include "worker/recovery.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/shard_server.h"

namespace shardps::worker {
namespace {

v1::DeclareResponse Shard(int64_t version, int64_t max_version,
                          uint64_t rollback_id) {
  v1::DeclareResponse r;
  r.set_version(version);
  r.set_max_version(max_version);
  r.set_rollback_id(rollback_id);
  r.set_consistency(v1::CONSISTENCY_SYNC);
  return r;
}

TEST(RecoveryTest, JoinsAtTheNextEpochStartButNotPastTheEnd) {
  EXPECT_EQ(EpochStartAtOrAfter(0, 32, 96), 0);
  EXPECT_EQ(EpochStartAtOrAfter(1, 32, 96), 32);
  EXPECT_EQ(EpochStartAtOrAfter(32, 32, 96), 32);
  EXPECT_EQ(EpochStartAtOrAfter(65, 32, 96), 96);
  EXPECT_EQ(EpochStartAtOrAfter(70, 32, 80), 80);  // --max_steps=80
}

TEST(RecoveryTest, TheJobIsAtItsSlowestChunk) {
  EXPECT_EQ(MinVersion({}), 0);
  EXPECT_EQ(MinVersion({Shard(7, 8, 0), Shard(6, 7, 0)}), 6);
}

TEST(RecoveryTest, TheConsistencyModeComesFromTheDeclaration) {
  EXPECT_TRUE(IsSync({}));
  std::vector<v1::DeclareResponse> shards = {Shard(0, 0, 0)};
  EXPECT_TRUE(IsSync(shards));
  shards[0].set_consistency(v1::CONSISTENCY_ASYNC);
  EXPECT_FALSE(IsSync(shards));
  shards[0].set_consistency(v1::CONSISTENCY_SSP);
  shards[0].set_staleness(2);
  EXPECT_FALSE(IsSync(shards));
}

TEST(RecoveryTest, ARollbackIsDoneWhenEveryShardAppliedItAndIsBackAtItsStep) {
  // Shard 1 has not applied rollback 3 yet.
  RollbackProgress p =
      RollbackProgressOf({Shard(40, 40, 3), Shard(57, 58, 2)}, 3, 40, true);
  EXPECT_FALSE(p.applied);
  EXPECT_FALSE(p.there);
  // Both reset to step 40 (one may be a step ahead: a push in flight).
  p = RollbackProgressOf({Shard(40, 40, 3), Shard(40, 41, 3)}, 3, 40, true);
  EXPECT_TRUE(p.applied);
  EXPECT_TRUE(p.there);
  // Applied long ago: the job has moved on since, nothing to go back to.
  p = RollbackProgressOf({Shard(45, 45, 3), Shard(45, 46, 4)}, 3, 40, true);
  EXPECT_TRUE(p.applied);
  EXPECT_FALSE(p.there);
  // Async versions count updates: only having applied it tells.
  p = RollbackProgressOf({Shard(45, 45, 3)}, 3, 40, false);
  EXPECT_TRUE(p.applied);
  EXPECT_TRUE(p.there);
}

// One in-process static shard (one worker, sync, a checkpoint every second
// step)
// and a declared client of a two-parameter model.
class RecoveryShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* test =
        ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = absl::StrCat(::testing::TempDir(), "recovery_test.", getpid(), ".",
                        test->name());
    std::filesystem::create_directories(dir_);
    server::ShardServerOptions so;
    so.checkpoint_dir = dir_;
    so.checkpoint_every = 2;
    absl::StatusOr<std::unique_ptr<server::ShardServer>> shard =
        server::ShardServer::Start(so);
    SHARDPS_ASSERT_OK(shard);
    shard_ = *std::move(shard);
    ClientOptions co;
    co.servers = {absl::StrCat("127.0.0.1:", shard_->port())};
    co.connect_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
    SHARDPS_ASSERT_OK(client);
    client_ = *std::move(client);
    v1::Layout layout;
    layout.set_chunk_bytes(1024);
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name("w");
    t->add_shape(4);
    v1::OptimizerSpec sgd;
    sgd.set_kind(v1::OptimizerSpec::KIND_SGD);
    sgd.set_learning_rate(0.5f);
    SHARDPS_ASSERT_OK(client_->Declare(layout, sgd));
  }
  void TearDown() override {
    if (shard_ != nullptr) shard_->Shutdown(absl::Seconds(1));
    shard_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // One step with gradient 1 everywhere; the weights go to weights_.
  absl::Status Step(int64_t step) {
    const std::vector<float> grad(4, 1.0f);
    return client_->PushPull(step, {absl::MakeConstSpan(grad)},
                             {absl::MakeSpan(weights_)});
  }
  Tensors Weights() { return {absl::MakeSpan(weights_)}; }

  std::string dir_;  // the shard's checkpoints
  std::unique_ptr<server::ShardServer> shard_;
  std::unique_ptr<Client> client_;
  std::vector<float> weights_ = std::vector<float>(4, 0.0f);
};

TEST_F(RecoveryShardTest, RedeclaringTellsWhereTheShardsAre) {
  ASSERT_EQ(client_->declared().size(), 1u);
  EXPECT_EQ(client_->declared()[0].consistency(), v1::CONSISTENCY_SYNC);
  EXPECT_EQ(client_->declared()[0].version(), 0);
  SHARDPS_ASSERT_OK(Step(0));
  absl::StatusOr<std::vector<v1::DeclareResponse>> shards =
      client_->Redeclare();
  SHARDPS_ASSERT_OK(shards);
  ASSERT_EQ(shards->size(), 1u);
  EXPECT_EQ((*shards)[0].version(), 1);
  EXPECT_EQ((*shards)[0].next_step(), 1);
  EXPECT_EQ((*shards)[0].rollback_id(), 0u);
  EXPECT_EQ(std::vector<uint32_t>((*shards)[0].active_ranks().begin(),
                                  (*shards)[0].active_ranks().end()),
            std::vector<uint32_t>{0});
  EXPECT_EQ(client_->start_step(), 0);  // the client's own state is kept
}

TEST_F(RecoveryShardTest, WithoutACoordinatorAFailedPushIsTheError) {
  Recovery recovery(RecoveryOptions(), client_.get(), Weights(), 4, 8, {},
                    /*rejoin_when_dropped=*/false);
  recovery.Start();
  const absl::Status why = absl::AbortedError("refused");
  EXPECT_EQ(recovery.Recover(why, 3).status(), why);
}

TEST_F(RecoveryShardTest, GoesBackToTheRollbacksStepWithItsWeights) {
  for (int64_t step = 0; step < 3; ++step) SHARDPS_ASSERT_OK(Step(step));
  const std::vector<float> at_two(4, -1.0f);  // 0 - 2 * 0.5 * 1
  uint64_t rollback_id = 0;
  RecoveryOptions ro;
  ro.rollback_timeout = absl::Seconds(30);
  Recovery recovery(
      ro, client_.get(), Weights(), 4, 8,
      [&] { return std::make_pair(rollback_id, int64_t{2}); },
      /*rejoin_when_dropped=*/false);
  recovery.Start();
  // The checkpoint of step 2 is committed once written: retry the rollback
  // until it is (the writer runs on its own thread).
  absl::Status rolled = shard_->RollBack(1, 2);
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       !rolled.ok() && absl::Now() < deadline;
       rolled = shard_->RollBack(1, 2)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  SHARDPS_ASSERT_OK(rolled);
  rollback_id = 1;
  // The push of step 3 was refused for predating the rollback.
  absl::StatusOr<int64_t> step =
      recovery.Recover(absl::AbortedError("predates rollback 1"), 3);
  SHARDPS_ASSERT_OK(step);
  EXPECT_EQ(*step, 2);
  EXPECT_EQ(weights_, at_two);
  // Later pushes say they know of the rollback.
  SHARDPS_EXPECT_OK(Step(2));
}

TEST_F(RecoveryShardTest, ARollbackThatNeverComesIsADeadline) {
  RecoveryOptions ro;
  ro.rollback_timeout = absl::Milliseconds(100);
  Recovery recovery(
      ro, client_.get(), Weights(), 4, 8,
      [] { return std::make_pair(uint64_t{7}, int64_t{0}); },
      /*rejoin_when_dropped=*/false);
  // Not started: the job's rollback 7 is news to this worker, but the
  // shard never applies it.
  const absl::Status why = absl::AbortedError("refused");
  EXPECT_EQ(recovery.Recover(why, 2).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(RecoveryShardTest, ARefusedRequestIsTheErrorWithoutWaiting) {
  // INVALID_ARGUMENT (ranks that disagree on a step's learning rate) is
  // about the request, not the job: even with a rollback in the news
  // (which would be waited for, as above) it is the answer at once.
  RecoveryOptions ro;
  ro.rollback_timeout = absl::Milliseconds(100);
  Recovery recovery(
      ro, client_.get(), Weights(), 4, 8,
      [] { return std::make_pair(uint64_t{7}, int64_t{0}); },
      /*rejoin_when_dropped=*/true);
  const absl::Status why =
      absl::InvalidArgumentError("the step's first push used 0.9");
  EXPECT_EQ(recovery.Recover(why, 2).status(), why);
}

}  // namespace
}  // namespace shardps::worker
