// Two-phase steps (PushPullRequest.second_phase) at the shard, over raw
// PushPull streams of two workers: a complete step is sealed with its sum of
// squares, the first decision applies it and later ones must agree, retries
// get what they lost, and every malformed or out-of-turn request is refused
// with its code and changes nothing. The skips, dying workers and
// checkpoints: two_phase_skip_test.cc.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/two_phase_testing.h"

namespace shardps::server {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const std::vector<float> kOnes(kChunkElements, 1.0f);

// 1 - (mean * clip_coefficient): SGD at lr 1 from weights of 1, as the
// shard computes it (the multiplication skipped for a coefficient of 1).
std::vector<float> SgdFromOnes(const std::vector<float>& mean,
                               float clip_coefficient) {
  std::vector<float> w(mean.size());
  for (size_t j = 0; j < w.size(); ++j) {
    const float g =
        clip_coefficient == 1 ? mean[j] : mean[j] * clip_coefficient;
    w[j] = 1.0f - 1.0f * g;
  }
  return w;
}

TEST(TwoPhasePushTest, SealsWithTheSumOfSquaresThenTheFirstDecisionApplies) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(2)));
  const std::vector<float> g0 = GradientOf(0, 0, 0), g1 = GradientOf(1, 0, 0);
  const std::vector<float> mean = MeanOf(g0, g1);
  v1::PushPullResponse r0, r1;
  ASSERT_NO_FATAL_FAILURE(
      shard.PushBoth(Push(0, 0, 0, g0), Push(1, 0, 0, g1), &r0, &r1));
  // Bitwise the protocol's order of additions; near a plain sum in double.
  double plain = 0;
  for (float m : mean) plain += static_cast<double>(m) * m;
  for (const v1::PushPullResponse* r : {&r0, &r1}) {
    EXPECT_EQ(r->chunk_id(), 0u);
    ASSERT_TRUE(r->has_sum_of_squares());
    EXPECT_EQ(r->sum_of_squares(), SumOfSquares(mean));
    EXPECT_NEAR(r->sum_of_squares(), plain, 1e-12 * plain);
    EXPECT_TRUE(r->payload().empty());
    EXPECT_EQ(r->shm_bytes(), 0u);
    EXPECT_EQ(r->version(), 0);  // still the step's
    EXPECT_FALSE(r->has_decision());
  }
  v1::GetStatusResponse st = shard.Status();
  EXPECT_EQ(st.pushes_total(), 2u);
  EXPECT_EQ(st.updates_total(), 0u);
  EXPECT_EQ(st.max_version(), 0);
  EXPECT_EQ(shard.Weights(0), kOnes);

  // Rank 0's decision applies the update: w - lr * (mean * coefficient).
  const float coefficient = 0.61803f;
  const std::vector<float> want = SgdFromOnes(mean, coefficient);
  v1::PushPullResponse decided;
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, coefficient), &decided).ok());
  EXPECT_EQ(decided.version(), 1);
  EXPECT_EQ(Values(decided.payload()), want);
  ASSERT_TRUE(decided.has_decision());
  EXPECT_EQ(decided.decision().clip_coefficient(), coefficient);
  EXPECT_FALSE(decided.decision().skip());
  EXPECT_EQ(shard.Weights(0), want);
  EXPECT_EQ(shard.Weights(1), kOnes);
  st = shard.Status();
  EXPECT_EQ(st.pushes_total(), 2u);  // a decision is no push
  EXPECT_EQ(st.updates_total(), 1u);
  EXPECT_EQ(st.rejected_total(), 0u);
  EXPECT_EQ(st.min_version(), 0);  // chunk 1
  EXPECT_EQ(st.max_version(), 1);

  // Rank 1's equal decision comes after the update: the current weights,
  // no second update.
  v1::PushPullResponse again;
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, coefficient), &again).ok());
  EXPECT_EQ(again.version(), 1);
  EXPECT_EQ(Values(again.payload()), want);
  EXPECT_EQ(again.decision().clip_coefficient(), coefficient);
  st = shard.Status();
  EXPECT_EQ(st.updates_total(), 1u);
  EXPECT_EQ(st.pushes_total(), 2u);
  EXPECT_EQ(shard.Weights(0), want);
}

TEST(TwoPhasePushTest, RetriedPushesGetTheSumAgainThenTheWeightsAndDecision) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  const std::vector<float> g0 = GradientOf(0, 0, 0), g1 = GradientOf(1, 0, 0);
  const std::vector<float> mean = MeanOf(g0, g1);
  v1::PushPullResponse r0, r1;
  ASSERT_NO_FATAL_FAILURE(
      shard.PushBoth(Push(0, 0, 0, g0), Push(1, 0, 0, g1), &r0, &r1));

  // Both ranks lost their replies: the same pushes get the sum again and
  // add nothing.
  for (const v1::PushPullRequest& retry :
       {Push(0, 0, 0, g0), Push(1, 0, 0, g1)}) {
    v1::PushPullResponse r;
    ASSERT_TRUE(shard.Once(retry, &r).ok());
    EXPECT_EQ(r.sum_of_squares(), SumOfSquares(mean));
    EXPECT_TRUE(r.payload().empty());
    EXPECT_EQ(r.version(), 0);
    EXPECT_FALSE(r.has_decision());
  }
  EXPECT_EQ(shard.Status().updates_total(), 0u);
  EXPECT_EQ(shard.Weights(0), kOnes);

  // The update is of the two ranks' mean, once.
  v1::PushPullResponse decided;
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 1), &decided).ok());
  const std::vector<float> want = SgdFromOnes(mean, 1);
  EXPECT_EQ(Values(decided.payload()), want);

  // A push retried after the decision: the weights, the decision and the
  // sum (the worker lost the sealed reply too).
  v1::PushPullResponse late;
  ASSERT_TRUE(shard.Once(Push(1, 0, 0, g1), &late).ok());
  EXPECT_EQ(late.version(), 1);
  EXPECT_EQ(Values(late.payload()), want);
  ASSERT_TRUE(late.has_decision());
  EXPECT_EQ(late.decision().clip_coefficient(), 1.0f);
  EXPECT_FALSE(late.decision().skip());
  ASSERT_TRUE(late.has_sum_of_squares());
  EXPECT_EQ(late.sum_of_squares(), SumOfSquares(mean));
  const v1::GetStatusResponse st = shard.Status();
  EXPECT_EQ(st.updates_total(), 1u);
  EXPECT_EQ(st.max_version(), 1);
  EXPECT_EQ(shard.Weights(0), want);
}

TEST(TwoPhasePushTest, ADifferentDecisionAfterTheAppliedOneIsRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  v1::PushPullResponse r0, r1, decided;
  ASSERT_NO_FATAL_FAILURE(shard.PushBoth(Push(0, 0, 0, GradientOf(0, 0, 0)),
                                         Push(1, 0, 0, GradientOf(1, 0, 0)),
                                         &r0, &r1));
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 0.5f), &decided).ok());
  shard.ExpectRefused(Decision(1, 0, 0, 0.25f),
                      grpc::StatusCode::INVALID_ARGUMENT, "max_grad_norm");
  shard.ExpectRefused(Decision(1, 0, 0, 0.5f, /*skip=*/true),
                      grpc::StatusCode::INVALID_ARGUMENT, "max_grad_norm");
  // Bitwise: one ulp off is another decision.
  shard.ExpectRefused(Decision(1, 0, 0, std::nextafter(0.5f, 1.0f)),
                      grpc::StatusCode::INVALID_ARGUMENT, "max_grad_norm");
  v1::PushPullResponse equal;
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, 0.5f), &equal).ok());
  EXPECT_EQ(equal.payload(), decided.payload());
}

TEST(TwoPhasePushTest, ADifferentDecisionRightBehindTheFirstIsRefused) {
  // A chunk over the inline limit (256 KiB): its update runs on the pool,
  // so the second decision most likely finds the first still pending (or
  // else applied: refused either way).
  TwoPhaseShard shard;
  std::vector<float> g0, g1;
  ASSERT_NO_FATAL_FAILURE(
      shard.StartSealedBig(0.001f, 97, -0.003f, 89, &g0, &g1));
  // One stream, so the shard takes them in this order.
  PushStream stream(shard.stub());
  ASSERT_TRUE(stream.Write(Decision(0, 0, 0, 0.5f)));
  ASSERT_TRUE(stream.Write(Decision(1, 0, 0, 0.25f)));
  const grpc::Status refused = stream.Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("max_grad_norm"));
  // The first decision's update, once.
  v1::PushPullResponse retry;
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, 0.5f), &retry).ok());
  EXPECT_EQ(retry.version(), 1);
  const std::vector<float> want = SgdFromOnes(MeanOf(g0, g1), 0.5f);
  EXPECT_EQ(Values(retry.payload()), want);
  EXPECT_EQ(shard.Weights(0), want);
  const v1::GetStatusResponse st = shard.Status();
  EXPECT_EQ(st.updates_total(), 1u);
  EXPECT_EQ(st.rejected_total(), 1u);
}

TEST(TwoPhasePushTest, DecisionsForStepsNotSealedOrNotCurrentAreRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(2)));
  // Chunk 0: only rank 0 pushed its two-phase gradient.
  PushStream rank0(shard.stub());
  ASSERT_TRUE(rank0.Write(Push(0, 0, 0, GradientOf(0, 0, 0))));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(1));
  shard.ExpectRefused(Decision(0, 0, 0, 1),
                      grpc::StatusCode::FAILED_PRECONDITION,
                      "not every rank's gradient is in yet");
  // Chunk 1: a one-phase step, untouched, then with rank 0's gradient.
  shard.ExpectRefused(Decision(1, 0, 1, 1),
                      grpc::StatusCode::FAILED_PRECONDITION,
                      "it is not a two-phase step");
  PushStream one_phase(shard.stub());
  ASSERT_TRUE(one_phase.Write(OnePhase(0, 0, 1, GradientOf(0, 1, 0))));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(2));
  shard.ExpectRefused(Decision(1, 0, 1, 1),
                      grpc::StatusCode::FAILED_PRECONDITION,
                      "it is not a two-phase step");

  // Rank 1 completes both: chunk 0 is sealed, chunk 1 updated.
  PushStream rank1(shard.stub());
  ASSERT_TRUE(rank1.Write(Push(1, 0, 0, GradientOf(1, 0, 0))));
  ASSERT_TRUE(rank1.Write(OnePhase(1, 0, 1, GradientOf(1, 1, 0))));
  v1::PushPullResponse r;
  ASSERT_TRUE(rank0.Read(&r));
  EXPECT_TRUE(r.has_sum_of_squares());
  ASSERT_TRUE(one_phase.Read(&r));
  EXPECT_EQ(r.version(), 1);
  EXPECT_FALSE(r.has_sum_of_squares());
  EXPECT_FALSE(r.has_decision());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(rank1.Read(&r));
  for (PushStream* s : {&rank0, &one_phase, &rank1}) {
    EXPECT_TRUE(s->Finish().ok());
  }
  // Chunk 1's last update was a one-phase step's: no decision to retry.
  shard.ExpectRefused(Decision(0, 0, 1, 1),
                      grpc::StatusCode::FAILED_PRECONDITION,
                      "whose update was not a two-phase step's");
  // Chunk 0 waits for step 0's decision.
  shard.ExpectRefused(Decision(0, 1, 0, 1), grpc::StatusCode::OUT_OF_RANGE,
                      "is in the future");
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 1), &r).ok());
  std::vector<float> w;
  for (int64_t step = 1; step < 3; ++step) {
    ASSERT_NO_FATAL_FAILURE(shard.Step(step, 0, GradientOf(0, 0, step),
                                       GradientOf(1, 0, step), {}, Decided(1),
                                       &w));
  }
  // At step 3: step 1 is two behind, step 4 ahead.
  shard.ExpectRefused(Decision(1, 1, 0, 1), grpc::StatusCode::OUT_OF_RANGE,
                      "is in the past");
  shard.ExpectRefused(Decision(1, 4, 0, 1), grpc::StatusCode::OUT_OF_RANGE,
                      "is in the future");
  EXPECT_EQ(shard.Weights(0), w);
}

TEST(TwoPhasePushTest, MalformedDecisionsAreRefusedAndNeverCountedAsPushes) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  v1::PushPullResponse r0, r1;
  ASSERT_NO_FATAL_FAILURE(shard.PushBoth(Push(0, 0, 0, GradientOf(0, 0, 0)),
                                         Push(1, 0, 0, GradientOf(1, 0, 0)),
                                         &r0, &r1));
  for (const float c : {0.0f, -0.0f, -1.0f, 1.5f, std::nextafter(1.0f, 2.0f),
                        kNaN, kInf, -kInf}) {
    SCOPED_TRACE(c);
    shard.ExpectRefused(Decision(0, 0, 0, c),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        "it must be finite and in (0, 1]");
  }
  // A skip still names a valid coefficient.
  shard.ExpectRefused(Decision(0, 0, 0, 0, /*skip=*/true),
                      grpc::StatusCode::INVALID_ARGUMENT,
                      "it must be finite and in (0, 1]");
  v1::PushPullRequest with_payload = Decision(0, 0, 0, 1);
  with_payload.set_payload(Bytes(GradientOf(0, 0, 0)));
  shard.ExpectRefused(with_payload, grpc::StatusCode::INVALID_ARGUMENT,
                      "carries a step decision and a payload");
  v1::PushPullRequest without_gradient = Decision(0, 0, 0, 1);
  without_gradient.set_no_gradient(true);
  shard.ExpectRefused(without_gradient, grpc::StatusCode::INVALID_ARGUMENT,
                      "carries a step decision and a no_gradient flag");
  v1::PushPullRequest values = Decision(0, 0, 0, 1);
  values.set_initial_values(true);
  values.set_payload(Bytes(kOnes));
  shard.ExpectRefused(values, grpc::StatusCode::INVALID_ARGUMENT,
                      "sets initial_values with a two-phase step's fields");

  // The step still takes its decision.
  v1::PushPullResponse decided;
  ASSERT_TRUE(shard.Once(Decision(0, 0, 0, 1), &decided).ok());
  EXPECT_EQ(decided.version(), 1);
  const v1::GetStatusResponse st = shard.Status();
  EXPECT_EQ(st.pushes_total(), 2u);
  EXPECT_EQ(st.rejected_total(), 12u);
}

TEST(TwoPhasePushTest, BadLossScalesAndTwoPhaseInitialValuesAreRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  const std::vector<float> g0 = GradientOf(0, 0, 0);
  v1::PushPullRequest one_phase = OnePhase(0, 0, 0, g0);
  one_phase.set_loss_scale(1024);
  shard.ExpectRefused(one_phase, grpc::StatusCode::INVALID_ARGUMENT,
                      "without second_phase");
  for (const float scale : {0.0f, -0.0f, -1.0f, kNaN, kInf, -kInf}) {
    SCOPED_TRACE(scale);
    shard.ExpectRefused(Push(0, 0, 0, g0, scale),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        "it must be finite and > 0");
  }
  v1::PushPullRequest values = Push(0, 0, 0, kOnes);
  values.set_initial_values(true);
  shard.ExpectRefused(values, grpc::StatusCode::INVALID_ARGUMENT,
                      "sets initial_values with a two-phase step's fields");
  values.set_second_phase(false);
  values.set_loss_scale(1024);
  shard.ExpectRefused(values, grpc::StatusCode::INVALID_ARGUMENT,
                      "sets initial_values with a two-phase step's fields");
  EXPECT_EQ(shard.Status().pushes_total(), 0u);
}

TEST(TwoPhasePushTest, RanksThatDisagreeOnTheStepsPhasesAreRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  const std::string alike = "every worker of a step must clip and scale";
  auto g = [](uint32_t rank, int64_t step) {
    return GradientOf(rank, 0, step);
  };
  v1::PushPullResponse r;

  // Step 0: rank 0 two-phase; rank 1 one-phase, or loss-scaled.
  PushStream first(shard.stub());
  ASSERT_TRUE(first.Write(Push(0, 0, 0, g(0, 0))));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(1));
  shard.ExpectRefused(OnePhase(1, 0, 0, g(1, 0)),
                      grpc::StatusCode::INVALID_ARGUMENT, alike);
  shard.ExpectRefused(Push(1, 0, 0, g(1, 0), 1024.0f),
                      grpc::StatusCode::INVALID_ARGUMENT, alike);
  ASSERT_TRUE(shard.Once(Push(1, 0, 0, g(1, 0)), &r).ok());
  EXPECT_EQ(r.sum_of_squares(), SumOfSquares(MeanOf(g(0, 0), g(1, 0))));
  ASSERT_TRUE(first.Read(&r));
  EXPECT_TRUE(r.has_sum_of_squares());
  EXPECT_TRUE(first.Finish().ok());
  ASSERT_TRUE(shard.Once(Decision(1, 0, 0, 1), &r).ok());

  // Step 1: rank 0 one-phase; rank 1 two-phase.
  PushStream second(shard.stub());
  ASSERT_TRUE(second.Write(OnePhase(0, 1, 0, g(0, 1))));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(3));
  shard.ExpectRefused(Push(1, 1, 0, g(1, 1)),
                      grpc::StatusCode::INVALID_ARGUMENT, alike);
  ASSERT_TRUE(shard.Once(OnePhase(1, 1, 0, g(1, 1)), &r).ok());
  EXPECT_EQ(r.version(), 2);
  EXPECT_FALSE(r.has_sum_of_squares());
  ASSERT_TRUE(second.Read(&r));
  EXPECT_EQ(r.version(), 2);
  EXPECT_TRUE(second.Finish().ok());

  // Step 2: rank 1 first (kept until rank 0's comes) at loss scale 3; rank
  // 0 at 4, or without.
  PushStream third(shard.stub());
  ASSERT_TRUE(third.Write(Push(1, 2, 0, g(1, 2), 3.0f)));
  ASSERT_NO_FATAL_FAILURE(shard.AwaitPushes(5));
  shard.ExpectRefused(Push(0, 2, 0, g(0, 2), 4.0f),
                      grpc::StatusCode::INVALID_ARGUMENT, alike);
  shard.ExpectRefused(Push(0, 2, 0, g(0, 2)),
                      grpc::StatusCode::INVALID_ARGUMENT, alike);
  ASSERT_TRUE(shard.Once(Push(0, 2, 0, g(0, 2), 3.0f), &r).ok());
  const float inv = static_cast<float>(1.0 / 3.0);
  EXPECT_EQ(r.sum_of_squares(), SumOfSquares(MeanOf(g(0, 2), g(1, 2), inv)));
  ASSERT_TRUE(third.Read(&r));
  EXPECT_EQ(r.sum_of_squares(), SumOfSquares(MeanOf(g(0, 2), g(1, 2), inv)));
  EXPECT_TRUE(third.Finish().ok());
  ASSERT_TRUE(shard.Once(Decision(0, 2, 0, 1), &r).ok());
  EXPECT_EQ(r.version(), 3);
  EXPECT_EQ(shard.Status().rejected_total(), 5u);
}

TEST(TwoPhasePushTest, AsyncAndSspShardsRefuseTwoPhaseSteps) {
  for (const v1::Consistency mode :
       {v1::CONSISTENCY_ASYNC, v1::CONSISTENCY_SSP}) {
    SCOPED_TRACE(v1::Consistency_Name(mode));
    ShardServerOptions o;
    o.store.mode = mode;
    o.store.staleness = mode == v1::CONSISTENCY_SSP ? 2 : 0;
    TwoPhaseShard shard;
    ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1), o));
    const std::vector<float> g0 = GradientOf(0, 0, 0);
    shard.ExpectRefused(Push(0, 0, 0, g0), grpc::StatusCode::INVALID_ARGUMENT,
                        "needs a sync shard");
    shard.ExpectRefused(Push(0, 0, 0, g0, 1024.0f),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        "needs a sync shard");
    shard.ExpectRefused(Decision(0, 0, 0, 1),
                        grpc::StatusCode::INVALID_ARGUMENT,
                        "needs a sync shard");
    // One-phase pushes go on as ever.
    v1::PushPullResponse r;
    ASSERT_TRUE(shard.Once(OnePhase(0, 0, 0, g0), &r).ok());
    EXPECT_EQ(r.version(), 1);
    EXPECT_FALSE(r.has_sum_of_squares());
  }
}

}  // namespace
}  // namespace shardps::server
