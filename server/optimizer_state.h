// A chunk's optimizer state as the wire carries it (v1::ChunkOptimizerState,
// torch's optimizer state_dict in chunks): read out to be saved, written in
// to resume from it. Pure functions of a locked chunk.
#ifndef SHARDPS_SERVER_OPTIMIZER_STATE_H_
#define SHARDPS_SERVER_OPTIMIZER_STATE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "server/chunk.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// The optimizer state of `chunk` at its current version.
v1::ChunkOptimizerState ReadOptimizerState(const Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// The slots `state` holds for `chunk`, checked: InvalidArgument naming the
// chunk for a step that is not the chunk's version (FailedPrecondition), a
// negative optimizer_steps, a slot count that is not the optimizer's, a
// slot of the wrong length, a non-finite value, or a negative second
// moment (Adam's exp_avg_sq, Adagrad's sum). The chunk is only read.
absl::StatusOr<std::vector<std::vector<float>>> SlotsToWrite(
    const v1::ChunkOptimizerState& state, const Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Installs checked `slots` and `optimizer_steps` in `chunk` (its next
// update continues from them).
void WriteOptimizerState(std::vector<std::vector<float>> slots,
                         int64_t optimizer_steps, Chunk* chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_OPTIMIZER_STATE_H_
