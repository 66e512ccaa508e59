// StepHyperparameters are what one push may set for its chunk's update
// (PushPullRequest.learning_rate, momentum, beta1, beta2), replacing the
// declared values: the workers' schedulers send them, a sync shard makes
// every rank of a step agree on them, the optimizer applies them. Plain
// values and pure functions, shared by the worker and the shard.
#ifndef SHARDPS_COMMON_STEP_HYPERPARAMETERS_H_
#define SHARDPS_COMMON_STEP_HYPERPARAMETERS_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

// Each field unset keeps the declared value (learning_rate: the declared
// rate and its schedule). The initializers let `{lr}` or `{lr, momentum}`
// leave the rest unset without -Wmissing-field-initializers.
struct StepHyperparameters {
  std::optional<float> learning_rate = std::nullopt;  // finite, >= 0
  std::optional<float> momentum = std::nullopt;  // SGD with momentum; [0, 1)
  std::optional<float> beta1 = std::nullopt;     // Adam, AdamW; [0, 1)
  std::optional<float> beta2 = std::nullopt;     // Adam, AdamW; [0, 1)
};

// InvalidArgument naming the first field out of its range ("momentum must
// be in [0, 1), got 1.5"; NaN and infinities are out of every range), else
// OK. Which fields an optimizer takes is the optimizer's to check.
absl::Status CheckStepHyperparameters(const StepHyperparameters& h);

// The first field in which `a` and `b` differ, bitwise (two workers
// computing "the same" value differently must be told; set and unset
// differ): its name ("learning rate", "momentum", "beta1", "beta2") and
// each side's value ("0.5", or "the declared one" when unset).
struct HyperparameterDifference {
  std::string field;
  std::string a;
  std::string b;
};
std::optional<HyperparameterDifference> FirstDifference(
    const StepHyperparameters& a, const StepHyperparameters& b);

// The fields of a push, and the fields set in one (the others cleared).
StepHyperparameters StepHyperparametersOf(const v1::PushPullRequest& request);
void SetStepHyperparameters(const StepHyperparameters& h,
                            v1::PushPullRequest* request);

}  // namespace shardps

#endif  // SHARDPS_COMMON_STEP_HYPERPARAMETERS_H_
