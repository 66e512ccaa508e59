#include "server/chunk.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/server_metrics.h"
#include "server/snapshot_scheduler.h"

namespace shardps::server {

ChunkReply CurrentReply(const Chunk& chunk, bool push_only) {
  ChunkReply reply;
  reply.chunk_id = chunk.spec.id;
  reply.version = chunk.version;
  if (!push_only) reply.weights = chunk.weights;
  return reply;
}

absl::Status CheckNotAwaiting(const Chunk& chunk) {
  if (!chunk.awaiting_values) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("chunk ", chunk.spec.id, " (", chunk.tensor_name,
                   ") waits for its initial values: the declaring worker "
                   "sends them"));
}

void ChunkUpdater::Apply(Chunk* chunk, const float* sum, int32_t count,
                         std::optional<float> learning_rate) const {
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
  chunk->optimizer->ApplySum(chunk->version, sum, count, chunk->weights->data(),
                             slots, chunk->spec.num_elements, learning_rate);
  if (metrics_ != nullptr) metrics_->Aggregated(absl::Now() - start);
  Advance(chunk);
}

void ChunkUpdater::Skip(Chunk* chunk) const {
  // The weights stay as they are, so replies still holding them are fine.
  Advance(chunk);
}

void ChunkUpdater::Advance(Chunk* chunk) const {
  ++chunk->version;
  counters_->updates.fetch_add(1, std::memory_order_relaxed);
  if (snapshots_ != nullptr) snapshots_->AfterUpdate(*chunk);
}

void ChunkUpdater::Deliver(ReplySink* sink, ChunkReply reply) const {
  if (reply.weights != nullptr) {
    counters_->bytes_out.fetch_add(reply.weights->size() * 4,
                                   std::memory_order_relaxed);
  }
  sink->Deliver(std::move(reply));
}

}  // namespace shardps::server
