#include "server/lr_schedule.h"

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {
namespace {

v1::LrSchedule ParseSchedule(const std::string& text) {
  v1::LrSchedule schedule;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &schedule))
      << text;
  return schedule;
}

struct Point {
  int64_t update;
  double factor;
};

void ExpectFactors(const std::string& text,
                   std::initializer_list<Point> points) {
  SCOPED_TRACE(text);
  const v1::LrSchedule schedule = ParseSchedule(text);
  SHARDPS_ASSERT_OK(ValidateLrSchedule(schedule));
  for (const Point& p : points) {
    // Hand values below carry 9 significant digits.
    EXPECT_NEAR(LrFactor(schedule, p.update), p.factor, 1e-9)
        << "update " << p.update;
  }
}

TEST(LrScheduleTest, ConstantIsOne) {
  ExpectFactors("", {{0, 1}, {1, 1}, {1000000, 1}});
}

TEST(LrScheduleTest, WarmupRampsLinearly) {
  // (update + 1) / 4 for updates 0..3, then 1.
  ExpectFactors("warmup_steps: 4",
                {{0, 0.25}, {1, 0.5}, {2, 0.75}, {3, 1}, {4, 1}, {100, 1}});
}

TEST(LrScheduleTest, StepDecaysEveryStepSize) {
  // 0.5^floor(u / 3).
  ExpectFactors("kind: KIND_STEP step_size: 3 gamma: 0.5",
                {{0, 1}, {2, 1}, {3, 0.5}, {5, 0.5}, {6, 0.25}, {9, 0.125}});
}

TEST(LrScheduleTest, CosineFallsToMinFactor) {
  // 0.25 + 0.75 * 0.5 * (1 + cos(pi * u / 4)) = 0.25 + 0.375 * (1 + cos):
  // u=1: 0.25 + 0.375 * 1.707106781 = 0.890165043; u=2: 0.25 + 0.375 =
  // 0.625; u=3: 0.25 + 0.375 * 0.292893219 = 0.359834957; u=4: 0.25.
  ExpectFactors(
      "kind: KIND_COSINE total_steps: 4 min_factor: 0.25",
      {{0, 1}, {1, 0.890165043}, {2, 0.625}, {3, 0.359834957}, {4, 0.25}});
}

TEST(LrScheduleTest, CosineStaysAtMinFactorPastTotalSteps) {
  const v1::LrSchedule schedule =
      ParseSchedule("kind: KIND_COSINE total_steps: 4 min_factor: 0.25");
  for (int64_t u : {4, 5, 100, 1000000}) {
    // 0.25 + 0.75 * 0.5 * (1 + cos(pi)), and cos(pi) == -1 exactly.
    EXPECT_EQ(LrFactor(schedule, u), 0.25) << "update " << u;
  }
  ExpectFactors("kind: KIND_COSINE total_steps: 10", {{10, 0}, {11, 0}});
}

TEST(LrScheduleTest, WarmupComposesWithCosine) {
  // The cosine counts from update 0: 0.5 * (1 + cos(pi * u / 4)) =
  // 1, 0.853553391, 0.5, 0.146446609, 0, times warmup (u + 1) / 3 for u < 3:
  // 1/3 = 0.333333333, 2/3 * 0.853553391 = 0.569035594, 1 * 0.5 = 0.5.
  ExpectFactors("kind: KIND_COSINE total_steps: 4 warmup_steps: 3",
                {{0, 0.333333333},
                 {1, 0.569035594},
                 {2, 0.5},
                 {3, 0.146446609},
                 {4, 0},
                 {5, 0}});
}

TEST(LrScheduleTest, WarmupComposesWithStep) {
  // 0.5^floor(u / 2) times (u + 1) / 4 for u < 4:
  // 0.25, 0.5, 0.5 * 0.75 = 0.375, 0.5 * 1 = 0.5, then 0.25.
  ExpectFactors("kind: KIND_STEP step_size: 2 gamma: 0.5 warmup_steps: 4",
                {{0, 0.25}, {1, 0.5}, {2, 0.375}, {3, 0.5}, {4, 0.25}});
}

TEST(LrScheduleTest, AcceptsUnusedZeroFields) {
  // CONSTANT ignores step_size, gamma and total_steps; 0 and 1 bound
  // min_factor.
  SHARDPS_EXPECT_OK(ValidateLrSchedule(ParseSchedule("")));
  SHARDPS_EXPECT_OK(ValidateLrSchedule(ParseSchedule("min_factor: 1")));
  SHARDPS_EXPECT_OK(ValidateLrSchedule(
      ParseSchedule("kind: KIND_STEP step_size: 1 gamma: 2")));
}

TEST(LrScheduleTest, RejectsInvalidSchedules) {
  struct Case {
    const char* schedule;
    const char* field;  // named in the message
  };
  const Case kCases[] = {
      {"warmup_steps: -1", "warmup_steps"},
      {"kind: KIND_STEP gamma: 0.5", "step_size"},
      {"kind: KIND_STEP step_size: -2 gamma: 0.5", "step_size"},
      {"kind: KIND_STEP step_size: 2", "gamma"},
      {"kind: KIND_STEP step_size: 2 gamma: -0.5", "gamma"},
      {"kind: KIND_STEP step_size: 2 gamma: nan", "gamma"},
      {"kind: KIND_STEP step_size: 2 gamma: inf", "gamma"},
      {"kind: KIND_COSINE", "total_steps"},
      {"kind: KIND_COSINE total_steps: -5", "total_steps"},
      {"kind: KIND_COSINE total_steps: 5 min_factor: -0.1", "min_factor"},
      {"kind: KIND_COSINE total_steps: 5 min_factor: 1.5", "min_factor"},
      {"kind: KIND_COSINE total_steps: 5 min_factor: nan", "min_factor"},
      {"min_factor: inf", "min_factor"},
  };
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.schedule);
    const absl::Status status = ValidateLrSchedule(ParseSchedule(c.schedule));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.field)) << status;
  }
  v1::LrSchedule unknown;
  unknown.set_kind(static_cast<v1::LrSchedule::Kind>(7));
  const absl::Status status = ValidateLrSchedule(unknown);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "kind")) << status;
}

}  // namespace
}  // namespace shardps::server
