// Speculative weights of two-phase steps (PushPullRequest.speculative_weights)
// at the shard, over raw PushPull streams of two workers: the sealed reply
// brings the weights of the update at clip coefficient 1, which a decision
// of 1 keeps (its reply then carries none) and any other decision replaces
// by the update recomputed from the state before the speculation. Each is
// checked bitwise against a shard that was not asked to speculate, with
// Adam, whose slots the speculation must leave alone until it is kept.
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/two_phase_testing.h"

namespace shardps::server {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

v1::PushPullRequest Speculating(v1::PushPullRequest r) {
  r.set_speculative_weights(true);
  return r;
}

// Two shards of the same Adam model: one whose pushes ask for speculative
// weights, one whose pushes do not.
class SpeculationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(speculating_.Start(AdamModel(1)));
    ASSERT_NO_FATAL_FAILURE(plain_.Start(AdamModel(1)));
  }

  // Step `step` of chunk 0 on both shards, decided `decision` (rank 0's);
  // the speculating shard's decision says it holds its speculative weights
  // when its sealed replies brought them. Expects the same sums of squares
  // and the same weights after it on both, bitwise; `*sealed` is the
  // speculating shard's sealed reply to rank 0, `*decided` its reply to
  // the decision. Call with ASSERT_NO_FATAL_FAILURE.
  void Step(int64_t step, const v1::StepDecision& decision,
            std::optional<float> loss_scale, std::vector<float> g0,
            v1::PushPullResponse* sealed, v1::PushPullResponse* decided) {
    const std::vector<float> g1 = GradientOf(1, 0, step);
    v1::PushPullResponse p0, p1, s1;
    ASSERT_NO_FATAL_FAILURE(plain_.PushBoth(Push(0, step, 0, g0, loss_scale),
                                            Push(1, step, 0, g1, loss_scale),
                                            &p0, &p1));
    EXPECT_TRUE(p0.payload().empty());
    EXPECT_FALSE(p0.speculative());
    ASSERT_NO_FATAL_FAILURE(speculating_.PushBoth(
        Speculating(Push(0, step, 0, g0, loss_scale)),
        Speculating(Push(1, step, 0, g1, loss_scale)), sealed, &s1));
    EXPECT_EQ(sealed->sum_of_squares(), p0.sum_of_squares());
    EXPECT_EQ(sealed->version(), step);
    EXPECT_FALSE(sealed->has_decision());
    EXPECT_EQ(s1.payload(), sealed->payload());
    EXPECT_EQ(s1.speculative(), sealed->speculative());

    v1::PushPullResponse want;
    ASSERT_TRUE(plain_
                    .Once(Decision(0, step, 0, decision.clip_coefficient(),
                                   decision.skip()),
                          &want)
                    .ok());
    v1::PushPullRequest d =
        Decision(0, step, 0, decision.clip_coefficient(), decision.skip());
    d.set_speculative_weights(sealed->speculative());
    const grpc::Status s = speculating_.Once(d, decided);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(decided->version(), step + 1);
    EXPECT_EQ(decided->decision().clip_coefficient(),
              decision.clip_coefficient());
    EXPECT_EQ(speculating_.Weights(0), plain_.Weights(0));
    if (!decided->speculative()) {
      EXPECT_EQ(decided->payload(), want.payload());
    }
  }

  // The speculating shard kept `kept` speculative updates and recomputed
  // `recomputed`.
  void ExpectSpeculations(uint64_t kept, uint64_t recomputed) const {
    const v1::GetStatusResponse st = speculating_.Status();
    EXPECT_EQ(st.speculative_updates_kept_total(), kept);
    EXPECT_EQ(st.speculative_updates_recomputed_total(), recomputed);
  }

  TwoPhaseShard speculating_, plain_;
};

TEST_F(SpeculationTest, ACoefficientOfOneKeepsTheSealedRepliesWeights) {
  for (int64_t step = 0; step < 3; ++step) {
    v1::PushPullResponse sealed, decided;
    ASSERT_NO_FATAL_FAILURE(Step(step, Decided(1), std::nullopt,
                                 GradientOf(0, 0, step), &sealed, &decided));
    // The weights came with the sum of squares, and are the update's.
    EXPECT_TRUE(sealed.speculative());
    EXPECT_EQ(Values(sealed.payload()), plain_.Weights(0));
    EXPECT_TRUE(decided.speculative());
    EXPECT_TRUE(decided.payload().empty());
    EXPECT_FALSE(decided.decision().skip());
  }
  ExpectSpeculations(3, 0);
  EXPECT_EQ(speculating_.Status().updates_total(), 3u);
  EXPECT_EQ(plain_.Status().speculative_updates_kept_total(), 0u);

  // Rank 1's decision, after the update: it holds the kept weights, so
  // none come again; without the flag, the weights.
  v1::PushPullRequest behind = Decision(1, 2, 0, 1);
  behind.set_speculative_weights(true);
  v1::PushPullResponse late;
  ASSERT_TRUE(speculating_.Once(behind, &late).ok());
  EXPECT_TRUE(late.speculative());
  EXPECT_TRUE(late.payload().empty());
  EXPECT_EQ(late.version(), 3);
  ASSERT_TRUE(speculating_.Once(Decision(1, 2, 0, 1), &late).ok());
  EXPECT_FALSE(late.speculative());
  EXPECT_EQ(Values(late.payload()), plain_.Weights(0));
  EXPECT_EQ(speculating_.Status().updates_total(), 3u);
}

TEST_F(SpeculationTest, AnyOtherDecisionRecomputesFromTheStateBeforeIt) {
  // Clipped, then kept, then clipped: a speculation that was not kept left
  // the weights and Adam's moments as they were.
  const float coefficients[] = {0.5f, 1.0f, 0.25f};
  for (int64_t step = 0; step < 3; ++step) {
    v1::PushPullResponse sealed, decided;
    ASSERT_NO_FATAL_FAILURE(Step(step, Decided(coefficients[step]),
                                 std::nullopt, GradientOf(0, 0, step), &sealed,
                                 &decided));
    EXPECT_TRUE(sealed.speculative());
    EXPECT_EQ(decided.speculative(), coefficients[step] == 1.0f);
    EXPECT_EQ(decided.payload().empty(), coefficients[step] == 1.0f);
  }
  ExpectSpeculations(1, 2);
}

TEST_F(SpeculationTest, AStepToSkipIsNotSpeculatedOn) {
  // An overflow under loss scaling: the step's norm is not finite, so its
  // only decision is a skip, and nothing is computed ahead.
  std::vector<float> g0 = GradientOf(0, 0, 0);
  g0[3] = kInf;
  v1::PushPullResponse sealed, decided;
  ASSERT_NO_FATAL_FAILURE(
      Step(0, Decided(1, /*skip=*/true), 1024.0f, g0, &sealed, &decided));
  EXPECT_FALSE(sealed.speculative());
  EXPECT_TRUE(sealed.payload().empty());
  EXPECT_FALSE(decided.speculative());
  EXPECT_TRUE(decided.decision().skip());
  // The next step speculates again, from the skipped step's state.
  ASSERT_NO_FATAL_FAILURE(
      Step(1, Decided(1), 1024.0f, GradientOf(0, 0, 1), &sealed, &decided));
  EXPECT_TRUE(sealed.speculative());
  EXPECT_TRUE(decided.speculative());
  ExpectSpeculations(1, 0);
}

TEST(SpeculationRefusalTest, WithoutASecondPhaseOrWithPushOnlyItIsRefused) {
  TwoPhaseShard shard;
  ASSERT_NO_FATAL_FAILURE(shard.Start(SgdModel(1)));
  shard.ExpectRefused(Speculating(OnePhase(0, 0, 0, GradientOf(0, 0, 0))),
                      grpc::StatusCode::INVALID_ARGUMENT,
                      "asks for speculative weights without second_phase");
  v1::PushPullRequest push_only =
      Speculating(Push(0, 0, 0, GradientOf(0, 0, 0)));
  push_only.set_push_only(true);
  shard.ExpectRefused(push_only, grpc::StatusCode::INVALID_ARGUMENT,
                      "asks for speculative weights with push_only");
}

TEST(SpeculationRefusalTest, SparseWeightsAreRefused) {
  TwoPhaseShard shard;
  v1::DeclareRequest sparse = SgdModel(1);
  sparse.mutable_layout()->set_sparse_weights_ratio(0.5f);
  ASSERT_NO_FATAL_FAILURE(shard.Start(sparse));
  shard.ExpectRefused(Speculating(Push(0, 0, 0, GradientOf(0, 0, 0))),
                      grpc::StatusCode::INVALID_ARGUMENT,
                      "the chunk's weights are sparse");
}

}  // namespace
}  // namespace shardps::server
