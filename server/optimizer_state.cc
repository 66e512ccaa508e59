#include "server/optimizer_state.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardps::server {
namespace {

// Slot `k` of this optimizer holds second moments, which are never negative
// (Adam's exp_avg_sq, Adagrad's sum).
bool IsSecondMoment(const Optimizer& optimizer, int k) {
  switch (optimizer.spec().kind()) {
    case v1::OptimizerSpec::KIND_ADAM:
    case v1::OptimizerSpec::KIND_ADAMW:
      return k == 1;
    case v1::OptimizerSpec::KIND_ADAGRAD:
      return k == 0;
    default:
      return false;
  }
}

}  // namespace

v1::ChunkOptimizerState ReadOptimizerState(const Chunk& chunk) {
  v1::ChunkOptimizerState state;
  state.set_chunk_id(chunk.spec.id);
  state.set_step(chunk.version);
  state.set_optimizer_steps(chunk.version - chunk.skipped_updates);
  for (const std::vector<float>& slot : chunk.slots) {
    state.add_slots(reinterpret_cast<const char*>(slot.data()),
                    slot.size() * sizeof(float));
  }
  return state;
}

absl::StatusOr<std::vector<std::vector<float>>> SlotsToWrite(
    const v1::ChunkOptimizerState& state, const Chunk& chunk) {
  const std::string what = absl::StrCat(
      "optimizer state of chunk ", chunk.spec.id, " (", chunk.tensor_name, ")");
  if (state.step() != chunk.version) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " is for step ", state.step(),
                     "; the chunk is at step ", chunk.version));
  }
  if (state.optimizer_steps() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": optimizer_steps ", state.optimizer_steps(), " is negative"));
  }
  const int num_slots = chunk.optimizer->num_slots();
  if (state.slots_size() != num_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", state.slots_size(), " slots; its ",
        v1::OptimizerSpec::Kind_Name(chunk.optimizer->spec().kind()),
        " optimizer keeps ", num_slots));
  }
  const int64_t n = chunk.spec.num_elements;
  std::vector<std::vector<float>> slots(num_slots);
  for (int k = 0; k < num_slots; ++k) {
    const std::string& bytes = state.slots(k);
    if (bytes.size() != static_cast<size_t>(n) * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": slot ", k, " has ", bytes.size(), " bytes; the chunk's ", n,
          " fp32 values take ", n * sizeof(float)));
    }
    slots[k].resize(n);
    std::memcpy(slots[k].data(), bytes.data(), bytes.size());
    const bool second_moment = IsSecondMoment(*chunk.optimizer, k);
    for (int64_t i = 0; i < n; ++i) {
      const float v = slots[k][i];
      if (!std::isfinite(v) || (second_moment && v < 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": slot ", k, " element ", i, " is ", v,
            second_moment ? " (must be finite and >= 0)" : " (not finite)"));
      }
    }
  }
  return slots;
}

void WriteOptimizerState(std::vector<std::vector<float>> slots,
                         int64_t optimizer_steps, Chunk* chunk) {
  chunk->slots = std::move(slots);
  chunk->skipped_updates = chunk->version - optimizer_steps;
}

}  // namespace shardps::server
