// Where checkpoints sit in their directory: one step-<12 digits> directory
// per step, committed once it holds a COMMITTED manifest. Shards write this
// layout (server/checkpoint.h) and tools that only need to know how far a job
// got read it (shardps-local). Stateless functions.
#ifndef SHARDPS_COMMON_CHECKPOINT_STEPS_H_
#define SHARDPS_COMMON_CHECKPOINT_STEPS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardps {

// The file whose presence commits a step directory.
inline constexpr char kCommittedManifest[] = "COMMITTED";
// What NewestCommittedStep returns when no step is committed (step 0 can be).
inline constexpr int64_t kNoCommittedStep = -1;

// "dir/step-000000000042" for step 42.
std::string StepDirectory(const std::string& dir, int64_t step);

// The step directories under `dir` as (step, name), newest first: only
// directories named exactly as StepDirectory names them. Empty when `dir`
// does not exist; FileError's codes when it cannot be listed.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>>
ListStepDirectories(const std::string& dir);

// The newest step under `dir` whose directory holds a COMMITTED manifest;
// kNoCommittedStep when there is none (or no `dir`). Cheap: it reads no file,
// so it does not verify the checkpoint (server/checkpoint.h's
// LatestCommitted does); for reports, not for restoring.
absl::StatusOr<int64_t> NewestCommittedStep(const std::string& dir);

}  // namespace shardps

#endif  // SHARDPS_COMMON_CHECKPOINT_STEPS_H_
