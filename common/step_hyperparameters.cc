#include "common/step_hyperparameters.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace shardps {
namespace {

struct Field {
  absl::string_view name;
  std::optional<float> StepHyperparameters::*member;
  // The range, written so that NaN fails it.
  bool (*ok)(float);
  absl::string_view want;
};

bool FiniteNonNegative(float x) { return std::isfinite(x) && x >= 0; }
bool InUnitInterval(float x) { return x >= 0 && x < 1; }  // [0, 1)

constexpr Field kFields[] = {
    {"learning rate", &StepHyperparameters::learning_rate, FiniteNonNegative,
     "finite and >= 0"},
    {"momentum", &StepHyperparameters::momentum, InUnitInterval, "in [0, 1)"},
    {"beta1", &StepHyperparameters::beta1, InUnitInterval, "in [0, 1)"},
    {"beta2", &StepHyperparameters::beta2, InUnitInterval, "in [0, 1)"},
};

std::string Describe(const std::optional<float>& value) {
  return value.has_value() ? absl::StrFormat("%.9g", *value)
                           : std::string("the declared one");
}

}  // namespace

absl::Status CheckStepHyperparameters(const StepHyperparameters& h) {
  for (const Field& f : kFields) {
    const std::optional<float>& value = h.*f.member;
    if (value.has_value() && !f.ok(*value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.name, " must be ", f.want, ", got ", *value));
    }
  }
  return absl::OkStatus();
}

std::optional<HyperparameterDifference> FirstDifference(
    const StepHyperparameters& a, const StepHyperparameters& b) {
  for (const Field& f : kFields) {
    const std::optional<float>& x = a.*f.member;
    const std::optional<float>& y = b.*f.member;
    const bool same =
        x.has_value() == y.has_value() &&
        (!x.has_value() || std::memcmp(&*x, &*y, sizeof(float)) == 0);
    if (!same) {
      return HyperparameterDifference{std::string(f.name), Describe(x),
                                      Describe(y)};
    }
  }
  return std::nullopt;
}

StepHyperparameters StepHyperparametersOf(const v1::PushPullRequest& request) {
  StepHyperparameters h;
  if (request.has_learning_rate()) h.learning_rate = request.learning_rate();
  if (request.has_momentum()) h.momentum = request.momentum();
  if (request.has_beta1()) h.beta1 = request.beta1();
  if (request.has_beta2()) h.beta2 = request.beta2();
  return h;
}

void SetStepHyperparameters(const StepHyperparameters& h,
                            v1::PushPullRequest* request) {
  if (h.learning_rate.has_value()) {
    request->set_learning_rate(*h.learning_rate);
  } else {
    request->clear_learning_rate();
  }
  if (h.momentum.has_value()) {
    request->set_momentum(*h.momentum);
  } else {
    request->clear_momentum();
  }
  if (h.beta1.has_value()) {
    request->set_beta1(*h.beta1);
  } else {
    request->clear_beta1();
  }
  if (h.beta2.has_value()) {
    request->set_beta2(*h.beta2);
  } else {
    request->clear_beta2();
  }
}

}  // namespace shardps
