#include "server/snapshot_scheduler.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::server {
namespace {

// Two one-element chunks and a scheduler whose hand-overs are recorded.
class SnapshotFixture : public ::testing::Test {
 protected:
  void Make(int64_t every) {
    for (uint32_t id = 0; id < 2; ++id) {
      auto chunk = std::make_unique<Chunk>();
      chunk->spec.id = id;
      chunk->spec.num_elements = 1;
      absl::MutexLock lock(&chunk->mu);
      chunk->weights = std::make_shared<std::vector<float>>(1, 0.0f);
      chunks_.push_back(std::move(chunk));
    }
    SnapshotOptions o;
    o.every = every;
    o.on_checkpoint = [this](int64_t step, std::vector<ChunkState> states) {
      absl::MutexLock lock(&mu_);
      handed_.push_back({step, states.size()});
    };
    scheduler_ = std::make_unique<SnapshotScheduler>(o, &pool_);
    scheduler_->SetNumChunks(chunks_.size());
  }
  // Moves chunk `id` to `version`, its weight equal to the version.
  void Advance(uint32_t id, int64_t version) {
    Chunk* chunk = chunks_[id].get();
    absl::MutexLock lock(&chunk->mu);
    chunk->version = version;
    (*chunk->weights)[0] = static_cast<float>(version);
    scheduler_->AfterUpdate(*chunk);
  }
  std::vector<Chunk*> Owned() { return {chunks_[0].get(), chunks_[1].get()}; }
  // The (step, chunks) hand-overs so far, once `n` of them happened.
  std::vector<std::pair<int64_t, size_t>> Handed(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return handed_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return handed_;
  }

  ThreadPool pool_{1};
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::unique_ptr<SnapshotScheduler> scheduler_;
  absl::Mutex mu_;
  std::vector<std::pair<int64_t, size_t>> handed_ ABSL_GUARDED_BY(mu_);
};

using HandOvers = std::vector<std::pair<int64_t, size_t>>;

TEST_F(SnapshotFixture, HandsOverOnceEveryChunkCopiedAPeriodicStep) {
  Make(2);
  Advance(0, 1);
  Advance(0, 2);
  Advance(1, 1);
  Advance(1, 2);  // the last copy of step 2
  EXPECT_EQ(Handed(1), (HandOvers{{2, 2}}));
}

TEST_F(SnapshotFixture, RequestedStepIsCopiedAndATooLateOneIsRefused) {
  Make(0);
  Advance(0, 1);
  SHARDPS_ASSERT_OK(scheduler_->Request(3, Owned()));
  const absl::Status late = scheduler_->Request(1, Owned());
  EXPECT_EQ(late.code(), absl::StatusCode::kOutOfRange) << late;
  EXPECT_EQ(scheduler_->Request(-1, Owned()).code(),
            absl::StatusCode::kInvalidArgument);
  for (int64_t v = 2; v <= 4; ++v) {
    Advance(0, v);
    Advance(1, v - 1);
  }
  Advance(1, 4);
  EXPECT_EQ(Handed(1), (HandOvers{{3, 2}}));
}

TEST_F(SnapshotFixture, ResetRequestsAgainTheStepsNotHandedOver) {
  Make(0);
  SHARDPS_ASSERT_OK(scheduler_->Request(2, Owned()));
  Advance(0, 1);
  Advance(0, 2);  // chunk 0 copied step 2; chunk 1 has not reached it
  {
    Chunk* first = chunks_[0].get();
    Chunk* second = chunks_[1].get();
    absl::MutexLock lock0(&first->mu);
    absl::MutexLock lock1(&second->mu);
    scheduler_->Reset(1);
    first->version = 1;
  }
  // Both pass step 2 again (after the rollback): one hand-over, complete.
  Advance(0, 2);
  Advance(1, 1);
  Advance(1, 2);
  EXPECT_EQ(Handed(1), (HandOvers{{2, 2}}));
}

TEST(SnapshotSchedulerTest, WithoutAWriterNothingCanBeRequested) {
  ThreadPool pool(1);
  SnapshotScheduler scheduler(SnapshotOptions{}, &pool);
  EXPECT_EQ(scheduler.CheckRequest(4).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shardps::server
