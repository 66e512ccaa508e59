#include "common/step_hyperparameters.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(StepHyperparametersTest, ChecksEachFieldsRange) {
  SHARDPS_EXPECT_OK(CheckStepHyperparameters({}));
  // The ends that are in: a learning rate of 0 (a warmup's first step),
  // momentum and betas of 0.
  SHARDPS_EXPECT_OK(CheckStepHyperparameters({0.0f, 0.0f, 0.0f, 0.0f}));
  SHARDPS_EXPECT_OK(CheckStepHyperparameters(
      {1e9f, std::nextafter(1.0f, 0.0f), 0.95f, 0.999f}));
  struct Case {
    StepHyperparameters h;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{-0.5f}, "learning rate must be finite and >= 0, got -0.5"},
      {{kNaN}, "learning rate must be finite"},
      {{kInf}, "learning rate must be finite"},
      {{std::nullopt, 1.0f}, "momentum must be in [0, 1), got 1"},
      {{std::nullopt, -0.1f}, "momentum must be in [0, 1)"},
      {{std::nullopt, kNaN}, "momentum must be in [0, 1)"},
      {{0.1f, 0.9f, 1.5f}, "beta1 must be in [0, 1), got 1.5"},
      {{0.1f, std::nullopt, 0.9f, kInf}, "beta2 must be in [0, 1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    const absl::Status s = CheckStepHyperparameters(c.h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.want)) << s;
  }
}

TEST(StepHyperparametersTest, FirstDifferenceIsBitwise) {
  const StepHyperparameters a = {0.5f, 0.9f, std::nullopt, std::nullopt};
  EXPECT_FALSE(FirstDifference(a, a).has_value());
  EXPECT_FALSE(FirstDifference({}, {}).has_value());
  StepHyperparameters b = a;
  b.momentum = std::nextafter(0.9f, 1.0f);
  std::optional<HyperparameterDifference> d = FirstDifference(a, b);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->field, "momentum");
  EXPECT_EQ(d->a, "0.899999976");
  EXPECT_EQ(d->b, "0.900000036");
  // Set and unset differ; the first field that differs is named.
  b = a;
  b.learning_rate.reset();
  b.beta2 = 0.99f;
  d = FirstDifference(a, b);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->field, "learning rate");
  EXPECT_EQ(d->b, "the declared one");
  // 0 and -0 are different bits.
  EXPECT_TRUE(FirstDifference({0.0f}, {-0.0f}).has_value());
}

TEST(StepHyperparametersTest, RoundTripsThroughAPush) {
  v1::PushPullRequest request;
  request.set_momentum(0.5f);  // cleared: unset in what is set below
  const StepHyperparameters h = {0.25f, std::nullopt, 0.0f, 0.99f};
  SetStepHyperparameters(h, &request);
  EXPECT_TRUE(request.has_learning_rate());
  EXPECT_FALSE(request.has_momentum());
  EXPECT_TRUE(request.has_beta1());  // 0 is a value, not "unset"
  const StepHyperparameters back = StepHyperparametersOf(request);
  EXPECT_FALSE(FirstDifference(h, back).has_value());
}

}  // namespace
}  // namespace shardps
