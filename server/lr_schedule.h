// Learning-rate schedules: the factor by which OptimizerSpec.learning_rate is
// multiplied at each update, as configured by a v1::LrSchedule. Pure
// functions, safe to call from any thread.
#ifndef SHARDPS_SERVER_LR_SCHEDULE_H_
#define SHARDPS_SERVER_LR_SCHEDULE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// OK, or InvalidArgument naming the offending field: negative warmup_steps;
// KIND_STEP with step_size <= 0 or gamma <= 0; KIND_COSINE with
// total_steps <= 0; min_factor outside [0, 1]; a non-finite gamma or
// min_factor; an unknown kind. Fields the kind does not use are ignored
// except for the finiteness and range checks above.
absl::Status ValidateLrSchedule(const v1::LrSchedule& schedule);

// The learning-rate factor for the 0-based `update`:
//   KIND_CONSTANT  1
//   KIND_STEP      gamma^floor(update / step_size)
//   KIND_COSINE    with u = min(update, total_steps):
//                  min_factor + (1 - min_factor) * 0.5 * (1 + cos(pi * u /
//                  total_steps)), so 1 at update 0, min_factor from update
//                  total_steps on.
// Warmup multiplies any kind by (update + 1) / warmup_steps while
// update < warmup_steps. It composes with the kind rather than delaying it:
// the step and cosine curves are counted from update 0, not from the end of
// warmup.
// REQUIRES: ValidateLrSchedule(schedule).ok() and update >= 0.
double LrFactor(const v1::LrSchedule& schedule, int64_t update);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_LR_SCHEDULE_H_
