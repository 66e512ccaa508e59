// Two-phase steps at the shard, continued (two_phase_push_test.cc): a
// loss-scaled step with an overflow is taken and skipped whole, so Adam goes
// on as if it never happened, also across a checkpoint; a worker that dies
// between the phases, or with its decision in flight, does not stall the
// step.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "server/two_phase_testing.h"
#include "tests/testing/daemon.h"

namespace shardps::server {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kLossScale = 1024;

// GradientOf, times the loss scale (as a worker computes it on the scaled
// loss).
std::vector<float> Scaled(uint32_t rank, int64_t step) {
  std::vector<float> g = GradientOf(rank, 0, step);
  for (float& x : g) x *= kLossScale;
  return g;
}

// Rank 0's scaled gradient of `step` with `bad` at element 3 (an overflow).
std::vector<float> Overflowed(int64_t step, float bad) {
  std::vector<float> g = Scaled(0, step);
  g[3] = bad;
  return g;
}

bool AllFinite(const std::vector<float>& w) {
  for (float x : w) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

TEST(TwoPhaseSkipTest, AnOverflowedLossScaledStepIsSkippedWhole) {
  for (const float bad : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE(bad);
    // `skipping` sees steps 0, a skipped 1 and 2; `plain` sees the same
    // steps 0 and 2 as its 0 and 1.
    TwoPhaseShard skipping, plain;
    ASSERT_NO_FATAL_FAILURE(skipping.Start(AdamModel(1)));
    ASSERT_NO_FATAL_FAILURE(plain.Start(AdamModel(1)));
    std::vector<float> w0, p0;
    ASSERT_NO_FATAL_FAILURE(skipping.Step(0, 0, Scaled(0, 0), Scaled(1, 0),
                                          kLossScale, Decided(1), &w0));
    ASSERT_NO_FATAL_FAILURE(plain.Step(0, 0, Scaled(0, 0), Scaled(1, 0),
                                       kLossScale, Decided(1), &p0));
    ASSERT_EQ(w0, p0);

    // The overflow is taken, and makes the chunk's sum of squares so.
    v1::PushPullResponse r0, r1;
    ASSERT_NO_FATAL_FAILURE(
        skipping.PushBoth(Push(0, 1, 0, Overflowed(1, bad), kLossScale),
                          Push(1, 1, 0, Scaled(1, 1), kLossScale), &r0, &r1));
    for (const v1::PushPullResponse* r : {&r0, &r1}) {
      ASSERT_TRUE(r->has_sum_of_squares());
      EXPECT_EQ(std::isnan(r->sum_of_squares()), std::isnan(bad));
      EXPECT_EQ(std::isinf(r->sum_of_squares()), std::isinf(bad));
      EXPECT_TRUE(r->payload().empty());
    }
    // The skip: the version moves on, the weights stay.
    v1::PushPullResponse skipped;
    ASSERT_TRUE(
        skipping.Once(Decision(1, 1, 0, 1, /*skip=*/true), &skipped).ok());
    EXPECT_EQ(skipped.version(), 2);
    EXPECT_EQ(Values(skipped.payload()), w0);
    EXPECT_TRUE(skipped.decision().skip());
    const v1::GetStatusResponse st = skipping.Status();
    EXPECT_EQ(st.updates_total(), 2u);
    EXPECT_EQ(st.max_version(), 2);
    EXPECT_EQ(skipping.Weights(0), w0);

    // The next step is the plain shard's next, bitwise: Adam's moments and
    // its step count (bias correction) are as before the skip.
    std::vector<float> w2, p1;
    ASSERT_NO_FATAL_FAILURE(skipping.Step(2, 0, Scaled(0, 2), Scaled(1, 2),
                                          kLossScale, Decided(0.75f), &w2));
    ASSERT_NO_FATAL_FAILURE(plain.Step(1, 0, Scaled(0, 2), Scaled(1, 2),
                                       kLossScale, Decided(0.75f), &p1));
    EXPECT_EQ(w2, p1);
    EXPECT_NE(w2, w0);
    EXPECT_TRUE(AllFinite(w2));
  }
}

TEST(TwoPhaseSkipTest, AnOverflowedStepIsOnlySkipped) {
  // The norm of a step with a non-finite chunk is not finite: a decision to
  // apply it (the ranks decide wrongly) would put the overflow into the
  // weights and the optimizer state for good.
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(AdamModel(1)));
  v1::PushPullResponse r0, r1;
  ASSERT_NO_FATAL_FAILURE(
      shard.PushBoth(Push(0, 0, 0, Overflowed(0, kInf), kLossScale),
                     Push(1, 0, 0, Scaled(1, 0), kLossScale), &r0, &r1));
  shard.ExpectRefused(Decision(0, 0, 0, 1), grpc::StatusCode::INVALID_ARGUMENT,
                      "sum of squares is not finite");
  shard.ExpectRefused(Decision(0, 0, 0, 0.5f),
                      grpc::StatusCode::INVALID_ARGUMENT,
                      "sum of squares is not finite");
  v1::PushPullResponse skipped;
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, 1, /*skip=*/true), &skipped).ok());
  EXPECT_EQ(skipped.version(), 1);
  EXPECT_EQ(Values(skipped.payload()),
            std::vector<float>(kChunkElements, 1.0f));
}

TEST(TwoPhaseSkipTest, NonFiniteGradientsWithoutLossScalingAreRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(AdamModel(1)));
  for (const float bad : {kInf, -kInf, kNaN}) {
    SCOPED_TRACE(bad);
    std::vector<float> g = GradientOf(0, 0, 0);
    g[3] = bad;
    shard.ExpectRefused(Push(0, 0, 0, g), grpc::StatusCode::INVALID_ARGUMENT,
                        "has a non-finite value at element 3");
    shard.ExpectRefused(OnePhase(0, 0, 0, g),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        "has a non-finite value at element 3");
  }
  // Loss-scaled, the same gradient is taken.
  PushStream rank0(shard.stub());
  ASSERT_TRUE(rank0.Write(Push(0, 0, 0, Overflowed(0, kInf), kLossScale)));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(1));
}

TEST(TwoPhaseSkipTest, AWorkerThatDiesAfterPhaseOneDoesNotStallTheStep) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  const std::vector<float> g0 = GradientOf(0, 0, 0), g1 = GradientOf(1, 0, 0);
  PushStream rank0(shard.stub()), rank1(shard.stub());
  ASSERT_TRUE(rank0.Write(Push(0, 0, 0, g0)));
  ASSERT_TRUE(rank1.Write(Push(1, 0, 0, g1)));
  v1::PushPullResponse r;
  ASSERT_TRUE(rank0.Read(&r));
  ASSERT_TRUE(rank1.Read(&r));
  // Rank 1 dies with its sum in hand; rank 0's decision is enough.
  EXPECT_EQ(rank1.Cancel().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(rank0.Write(Decision(0, 0, 0, 0.5f)));
  ASSERT_TRUE(rank0.Read(&r));
  EXPECT_EQ(r.version(), 1);
  EXPECT_EQ(r.decision().clip_coefficient(), 0.5f);
  EXPECT_TRUE(rank0.Finish().ok());
  // Rank 1, back, finds the step done and goes on with the next.
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, 0.5f), &r).ok());
  EXPECT_EQ(r.version(), 1);
  std::vector<float> w;
  ASSERT_NO_FATAL_FAILURE(shard.Step(1, 0, GradientOf(0, 0, 1),
                                     GradientOf(1, 0, 1), {}, Decided(1), &w));
  EXPECT_EQ(shard.Status().updates_total(), 2u);
}

TEST(TwoPhaseSkipTest, AStreamCutWithItsGradientKeptStillCountsIt) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  const std::vector<float> g0 = GradientOf(0, 0, 0), g1 = GradientOf(1, 0, 0);
  // Rank 1's gradient comes first and waits for rank 0's; its stream dies.
  PushStream rank1(shard.stub());
  ASSERT_TRUE(rank1.Write(Push(1, 0, 0, g1)));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(1));
  EXPECT_EQ(rank1.Cancel().error_code(), grpc::StatusCode::CANCELLED);
  v1::PushPullResponse r;
  ASSERT_TRUE(shard.Once(Push(0, 0, 0, g0), &r).ok());
  EXPECT_EQ(r.sum_of_squares(), SumOfSquares(MeanOf(g0, g1)));
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 1), &r).ok());
  EXPECT_EQ(r.version(), 1);
}

TEST(TwoPhaseSkipTest, AStreamCutWithItsDecisionInFlightDoesNotStallTheStep) {
  // A chunk over the inline limit (256 KiB): its update runs on the pool,
  // so the cut most likely comes while the decision is pending.
  TwoPhaseShard shard;
  std::vector<float> g0, g1;
  ASSERT_NO_FATAL_FAILURE(
      shard.StartSealedBig(0.002f, 101, -0.001f, 83, &g0, &g1));
  PushStream rank1(shard.stub());
  ASSERT_TRUE(rank1.Write(Decision(1, 0, 0, 0.5f)));
  rank1.Cancel();  // CANCELLED, or OK if its reply came first
  v1::PushPullResponse r;
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 0.5f), &r).ok());
  EXPECT_EQ(r.version(), 1);
  const std::vector<float> mean = MeanOf(g0, g1);
  std::vector<float> want(g0.size());
  for (size_t j = 0; j < want.size(); ++j)
    want[j] = 1.0f - 1.0f * (mean[j] * 0.5f);
  EXPECT_EQ(Values(r.payload()), want);
  EXPECT_EQ(shard.Status().updates_total(), 1u);
}

// Checkpoints the shards of the test write, committed ones by step.
class Commits {
 public:
  void Take(const absl::StatusOr<CheckpointWrite>& w) {
    absl::MutexLock lock(&mu_);
    if (w.ok() && w->committed) steps_.push_back(w->step);
  }
  // Whether `step` is committed, within 30 s.
  bool Await(int64_t step) {
    absl::MutexLock lock(&mu_);
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(steps_.begin(), steps_.end(), step) != steps_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&there), absl::Seconds(30));
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> steps_ ABSL_GUARDED_BY(mu_);
};

TEST(TwoPhaseSkipTest, ASkipIsCheckpointedAndRestored) {
  Commits commits;
  ShardServerOptions o;
  o.checkpoint_dir = testing::MakeTempDir("two_phase_skip_test");
  o.checkpoint_every = 2;
  o.on_checkpoint = [&commits](const absl::StatusOr<CheckpointWrite>& w) {
    commits.Take(w);
  };
  std::vector<float> w;
  std::vector<float> uninterrupted;
  {
    TwoPhaseShard shard;
    ASSERT_NO_FATAL_FAILURE(shard.Start(AdamModel(1), o));
    ASSERT_NO_FATAL_FAILURE(shard.Step(0, 0, Scaled(0, 0), Scaled(1, 0),
                                       kLossScale, Decided(1), &w));
    ASSERT_NO_FATAL_FAILURE(shard.Step(1, 0, Overflowed(1, kInf), Scaled(1, 1),
                                       kLossScale, Decided(1, /*skip=*/true),
                                       &w));
    ASSERT_TRUE(commits.Await(2));
    ASSERT_NO_FATAL_FAILURE(shard.Step(2, 0, Scaled(0, 2), Scaled(1, 2),
                                       kLossScale, Decided(0.75f),
                                       &uninterrupted));
  }
  SHARDPS_ASSERT_OK_AND_ASSIGN(const CheckpointInfo info,
                               LatestCommitted(o.checkpoint_dir));
  ASSERT_EQ(info.step, 2);
  ASSERT_EQ(info.files.size(), 1u);
  std::map<std::string, std::string> metadata;
  SHARDPS_ASSERT_OK(
      ReadSafetensors(info.step_dir + "/" + info.files[0].name, &metadata));
  EXPECT_EQ(metadata["versions"], "0:2");
  EXPECT_EQ(metadata["skipped"], "0:1");

  // Restored, the shard's next step is the uninterrupted one, bitwise (a
  // lost skip count would change Adam's bias correction).
  TwoPhaseShard restored;
  ASSERT_NO_FATAL_FAILURE(restored.Start(AdamModel(1), o));
  EXPECT_EQ(restored.Status().min_version(), 2);
  ASSERT_NO_FATAL_FAILURE(restored.Step(2, 0, Scaled(0, 2), Scaled(1, 2),
                                        kLossScale, Decided(0.75f), &w));
  EXPECT_EQ(w, uninterrupted);
}

}  // namespace
}  // namespace shardps::server
