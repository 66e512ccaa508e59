#include "server/chunk.h"

#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "server/server_metrics.h"

namespace shardps::server {

ChunkReply CurrentReply(const Chunk& chunk, bool push_only) {
  ChunkReply reply;
  reply.chunk_id = chunk.spec.id;
  reply.version = chunk.version;
  if (push_only) return reply;
  if (chunk.copy != nullptr) {
    reply.weights = chunk.copy;
    reply.changes = chunk.changes;
  } else {
    reply.weights = chunk.weights;
  }
  return reply;
}

void ResetWorkerCopy(Chunk* chunk) {
  if (chunk->sparse_ratio <= 0) return;
  // A new buffer: replies being sent may still hold the old one.
  chunk->copy = std::make_shared<std::vector<float>>(*chunk->weights);
  chunk->changes.reset();
}

namespace {

// Moves the workers' copy of `chunk` to its weights at the elements that
// differ most, and records them as the chunk's changes.
void MoveWorkerCopy(Chunk* chunk, ShardCounters* counters)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu) {
  const int64_t n = chunk->spec.num_elements;
  const bool shared = chunk->copy.use_count() > 1;
  // As for the weights (Apply): order the senders' reads of the copy
  // (before they dropped it) before the writes below.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (shared) {
    chunk->copy = std::make_shared<std::vector<float>>(*chunk->copy);
    counters->weight_copies.fetch_add(1, std::memory_order_relaxed);
  }
  const float* w = chunk->weights->data();
  float* copy = chunk->copy->data();
  thread_local std::vector<float> difference;
  difference.resize(n);
  for (int64_t i = 0; i < n; ++i) difference[i] = w[i] - copy[i];
  auto changes = std::make_shared<std::string>();
  // The TOPK encoder picks the elements (the lower index first among equal
  // differences); their values are then replaced by the new weights.
  if (!EncodePayload(v1::ENCODING_TOPK, difference.data(), n,
                     chunk->sparse_ratio, nullptr, changes.get())
           .ok()) {
    // Non-finite weights (--allow_nonfinite): the copy is sent whole.
    ResetWorkerCopy(chunk);
    return;
  }
  uint32_t k;
  std::memcpy(&k, changes->data(), 4);
  const char* indices = changes->data() + 4;
  char* values = changes->data() + 4 + 4 * static_cast<size_t>(k);
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t i;
    std::memcpy(&i, indices + 4 * j, 4);
    copy[i] = w[i];
    std::memcpy(values + 4 * j, &w[i], 4);
  }
  chunk->changes = std::move(changes);
}

}  // namespace

absl::Status CheckNotAwaiting(const Chunk& chunk) {
  if (!chunk.awaiting_values) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("chunk ", chunk.spec.id, " (", chunk.tensor_name,
                   ") waits for its initial values: the declaring worker "
                   "sends them"));
}

void ChunkUpdater::Apply(Chunk* chunk, const float* sum, int32_t count,
                         const StepHyperparameters& step,
                         GradientScaling scaling) const {
  // At most two slots (Adam): no allocation on the update path.
  float* slot_ptrs[2] = {};
  for (size_t i = 0; i < chunk->slots.size(); ++i) {
    slot_ptrs[i] = chunk->slots[i].data();
  }
  const absl::Span<float* const> slots(slot_ptrs, chunk->slots.size());
  const bool shared = chunk->weights.use_count() > 1;
  // use_count() is a relaxed load: order the senders' reads of the buffer
  // (before they dropped it) before the writes below.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (shared) {
    // A reply still being sent holds the buffer: update a copy. (use_count
    // only drops concurrently, and only the store adds holders, so reading
    // 1 means no one else holds it.)
    chunk->weights = std::make_shared<std::vector<float>>(*chunk->weights);
    counters_->weight_copies.fetch_add(1, std::memory_order_relaxed);
  }
  const absl::Time start = absl::Now();
  scaling.skipped_updates = chunk->skipped_updates;
  chunk->optimizer->ApplySum(chunk->version, sum, count, chunk->weights->data(),
                             slots, chunk->spec.num_elements, step, scaling);
  if (chunk->copy != nullptr) MoveWorkerCopy(chunk, counters_);
  if (metrics_ != nullptr) metrics_->Aggregated(absl::Now() - start);
  Advance(chunk);
}

void ChunkUpdater::Speculate(const Chunk& chunk, const float* sum,
                             int32_t count, const StepHyperparameters& step,
                             GradientScaling scaling,
                             std::shared_ptr<std::vector<float>>* weights,
                             std::vector<std::vector<float>>* slots) const {
  // As in Apply: order the senders' reads of the buffer before the writes.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (*weights == nullptr || weights->use_count() > 1) {
    *weights = std::make_shared<std::vector<float>>(*chunk.weights);
  } else {
    // Kept from an earlier step: no allocation, no page faults.
    (*weights)->assign(chunk.weights->begin(), chunk.weights->end());
  }
  slots->resize(chunk.slots.size());
  float* slot_ptrs[2] = {};
  for (size_t i = 0; i < chunk.slots.size(); ++i) {
    (*slots)[i].assign(chunk.slots[i].begin(), chunk.slots[i].end());
    slot_ptrs[i] = (*slots)[i].data();
  }
  const absl::Time start = absl::Now();
  scaling.skipped_updates = chunk.skipped_updates;
  chunk.optimizer->ApplySum(chunk.version, sum, count, (*weights)->data(),
                            absl::Span<float* const>(slot_ptrs, slots->size()),
                            chunk.spec.num_elements, step, scaling);
  if (metrics_ != nullptr) metrics_->Aggregated(absl::Now() - start);
}

void ChunkUpdater::Commit(Chunk* chunk,
                          std::shared_ptr<std::vector<float>>* weights,
                          std::vector<std::vector<float>>* slots) const {
  // Swapped, not written: replies still holding the old weights keep them.
  std::swap(chunk->weights, *weights);
  std::swap(chunk->slots, *slots);
  if (chunk->copy != nullptr) MoveWorkerCopy(chunk, counters_);
  counters_->speculations_kept.fetch_add(1, std::memory_order_relaxed);
  if (metrics_ != nullptr) metrics_->Speculated(true);
  Advance(chunk);
}

void ChunkUpdater::CountRecomputed() const {
  counters_->speculations_recomputed.fetch_add(1, std::memory_order_relaxed);
  if (metrics_ != nullptr) metrics_->Speculated(false);
}

void ChunkUpdater::Skip(Chunk* chunk) const {
  // The weights stay as they are, so replies still holding them are fine;
  // the workers' copy stays too, and is sent whole. The optimizer's own
  // step count stays behind, as torch's state["step"] of a parameter
  // whose step it skipped.
  ++chunk->skipped_updates;
  chunk->changes.reset();
  Advance(chunk);
}

void ChunkUpdater::Advance(Chunk* chunk) const {
  ++chunk->version;
  counters_->updates.fetch_add(1, std::memory_order_relaxed);
  if (snapshots_ != nullptr) snapshots_->AfterUpdate(*chunk);
}

void ChunkUpdater::Deliver(ReplySink* sink, ChunkReply reply) const {
  sink->Deliver(std::move(reply));
}

void ChunkUpdater::DeliverAll(PendingReplies* replies) const {
  std::shared_ptr<SharedBf16> bf16;
  const std::vector<float>* rounded = nullptr;
  for (auto& [sink, reply] : *replies) {
    if (reply.weights == nullptr) continue;
    if (reply.weights.get() != rounded) {
      bf16 = std::make_shared<SharedBf16>();
      rounded = reply.weights.get();
    }
    reply.bf16 = bf16;
  }
  for (auto& [sink, reply] : *replies) Deliver(sink.get(), std::move(reply));
  replies->clear();
}

}  // namespace shardps::server
