#include "server/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {
namespace {

constexpr double kPi = 3.14159265358979323846;

// InvalidArgument("LrSchedule.<field> must be <want>, got <value>") unless
// `ok`.
template <typename T>
absl::Status Require(bool ok, absl::string_view field, absl::string_view want,
                     T value) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("LrSchedule.", field, " must be ", want, ", got ", value));
}

absl::Status ValidateStep(const v1::LrSchedule& s) {
  absl::Status status = Require(s.step_size() > 0, "step_size",
                                "> 0 for KIND_STEP", s.step_size());
  if (!status.ok()) return status;
  return Require(s.gamma() > 0, "gamma", "> 0 for KIND_STEP", s.gamma());
}

}  // namespace

absl::Status ValidateLrSchedule(const v1::LrSchedule& s) {
  if (!v1::LrSchedule::Kind_IsValid(s.kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat("LrSchedule.kind ", s.kind(), " is not a known kind"));
  }
  const absl::Status checks[] = {
      Require(s.warmup_steps() >= 0, "warmup_steps", ">= 0", s.warmup_steps()),
      Require(std::isfinite(s.gamma()), "gamma", "finite", s.gamma()),
      // Written so that NaN fails too.
      Require(s.min_factor() >= 0 && s.min_factor() <= 1, "min_factor",
              "in [0, 1]", s.min_factor()),
      s.kind() == v1::LrSchedule::KIND_STEP ? ValidateStep(s)
                                            : absl::OkStatus(),
      Require(s.kind() != v1::LrSchedule::KIND_COSINE || s.total_steps() > 0,
              "total_steps", "> 0 for KIND_COSINE", s.total_steps()),
  };
  for (const absl::Status& status : checks) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

double LrFactor(const v1::LrSchedule& s, int64_t update) {
  double factor = 1.0;
  switch (s.kind()) {
    case v1::LrSchedule::KIND_STEP:
      factor = std::pow(static_cast<double>(s.gamma()),
                        static_cast<double>(update / s.step_size()));
      break;
    case v1::LrSchedule::KIND_COSINE: {
      const double u = static_cast<double>(std::min(update, s.total_steps()));
      const double floor = s.min_factor();
      // cos(pi) is exactly -1 in double, so the factor lands exactly on
      // min_factor at total_steps.
      factor = floor + (1.0 - floor) * 0.5 *
                           (1.0 + std::cos(kPi * u / s.total_steps()));
      break;
    }
    default:  // KIND_CONSTANT
      break;
  }
  if (s.warmup_steps() > 0 && update < s.warmup_steps()) {
    factor *=
        static_cast<double>(update + 1) / static_cast<double>(s.warmup_steps());
  }
  return factor;
}

}  // namespace shardps::server
