// A Chunk is one chunk a shard owns: its weights, optimizer slots and version,
// behind the chunk's own mutex, and its tensor's optimizer. ChunkUpdater
// applies one optimizer update to a chunk (copy on write, metrics,
// checkpoint copies), or skips one, and hands replies to the pushers'
// ReplySinks. Both are shared by every consistency policy.
#ifndef SHARDPS_SERVER_CHUNK_H_
#define SHARDPS_SERVER_CHUNK_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "server/optimizer.h"

namespace shardps::server {

class ServerMetrics;

// The weights of one chunk at one version. Shared with the transport, which
// sends straight from this buffer; the store never writes to a buffer while
// anyone else holds it (copy on write).
using WeightsBuffer = std::shared_ptr<const std::vector<float>>;

// A reply's weights rounded to bfloat16, once for all the replies of one
// update that send them so (the first to encode rounds them; call_once).
// Holds no reference to the weights: the store may update them in place
// once the replies are sent.
struct SharedBf16 {
  absl::once_flag once;
  std::vector<uint16_t> values;
};

// A two-phase step's decision (v1::StepDecision).
struct StepDecision {
  float clip_coefficient = 1;
  bool skip = false;
  bool operator==(const StepDecision& o) const {
    // Bitwise: two ranks computing "the same" coefficient differently must
    // be told.
    return skip == o.skip &&
           std::memcmp(&clip_coefficient, &o.clip_coefficient, 4) == 0;
  }
  bool operator!=(const StepDecision& o) const { return !(*this == o); }
};

// The updated weights of one chunk, for one accepted push.
struct ChunkReply {
  uint32_t chunk_id = 0;
  int64_t version = 0;
  // Null for push-only. With sparse weights: the workers' copy.
  WeightsBuffer weights;
  // Sparse weights: the TOPK payload of the update to `version` (the
  // elements of the copy it changed), or null when the chunk got to
  // `version` otherwise (then only `weights` can be sent).
  std::shared_ptr<const std::string> changes;
  // A sealed two-phase step: the chunk's sum of squares, and no weights.
  std::optional<double> sum_of_squares;
  // The reply of a two-phase step's update: the decision it applied.
  std::optional<StepDecision> decision;
  // Set by ChunkUpdater::DeliverAll for the replies of one update: where
  // a BF16 reply rounds `weights` (null: each reply rounds its own).
  std::shared_ptr<SharedBf16> bf16;
  // A sealed step: `weights` are those of its update at clip coefficient
  // 1 (PushPullResponse.speculative). A decision's: the pusher's copy of
  // those is the chunk's now, and `weights` is null.
  bool speculative = false;
};

// Receives the reply of each accepted push exactly once, from any thread,
// possibly before Push() returns. Implementations must not block.
class ReplySink {
 public:
  virtual ~ReplySink() = default;
  virtual void Deliver(ChunkReply reply) = 0;
  // The push will never be answered (the shard was reset to a checkpoint):
  // the sink ends its call with `status`. Same threading rules as Deliver.
  virtual void Fail(const absl::Status& status) = 0;

  // Flow control of the pusher's stream. Hold: the store keeps the push's
  // gradient (`bytes` of it, as held) until other pushes arrive (sync: the
  // ranks below it), so the stream should read nothing more; called during
  // Push, possibly under a chunk's lock (so it must only take locks of its
  // own). Release: the gradient was used (or dropped); reading may go on once
  // every Hold is released. Called once per Hold, from any thread, never under
  // a chunk's lock. Sinks without a stream to pause ignore both.
  virtual void Hold(int64_t bytes) {}
  virtual void Release() {}
};

struct Chunk {
  ChunkSpec spec;
  std::string tensor_name;  // for messages
  // The tensor's optimizer (TensorOptimizers::of): constant after the model
  // is built, read without the lock; owned by the ShardModel.
  const Optimizer* optimizer = nullptr;
  mutable absl::Mutex mu;
  // Written in place when no reply holds it, else replaced by a copy.
  std::shared_ptr<std::vector<float>> weights ABSL_GUARDED_BY(mu);
  std::vector<std::vector<float>> slots ABSL_GUARDED_BY(mu);
  // Updates applied: the step the chunk is at.
  int64_t version ABSL_GUARDED_BY(mu) = 0;
  // Of those, the ones that did not step the optimizer (no rank had a
  // gradient, or a two-phase step skipped whole): the optimizer's own step
  // count (Adam's bias correction, torch's state["step"]) is
  // version - skipped_updates. Negative when an optimizer state written
  // in (optimizer_state.h) has taken more steps than the chunk's version.
  int64_t skipped_updates ABSL_GUARDED_BY(mu) = 0;
  // Sparse weights (Layout.sparse_weights_ratio; constant after the model
  // is built, 0: off): `copy` is what every worker holds, moved towards
  // `weights` at each update by the elements that differ most, which
  // `changes` lists (the TOPK payload of the update to `version`; null
  // when the chunk got there otherwise). Copy on write, as `weights`.
  float sparse_ratio = 0;
  std::shared_ptr<std::vector<float>> copy ABSL_GUARDED_BY(mu);
  std::shared_ptr<const std::string> changes ABSL_GUARDED_BY(mu);
  // The tensor's InitSpec is KIND_PROVIDED and no worker has sent the
  // values yet: the weights are zeros that nobody may read or update. Only
  // ever goes from true to false.
  bool awaiting_values ABSL_GUARDED_BY(mu) = false;
};

// Told right after a chunk's version changed, under the chunk's lock: the
// shard's checkpoint copies (SnapshotScheduler) follow updates through it.
class UpdateObserver {
 public:
  virtual ~UpdateObserver() = default;
  virtual void AfterUpdate(const Chunk& chunk)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) = 0;
};

// UNAVAILABLE naming the chunk and its tensor when `chunk` awaits its
// initial values, else OK.
absl::Status CheckNotAwaiting(const Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// The reply to a push of `chunk` at its current version.
ChunkReply CurrentReply(const Chunk& chunk, bool push_only)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Sparse weights: the workers' copy becomes the weights whole (a new model,
// initial values, a checkpoint restored), with no changes to send. No-op
// without sparse weights.
void ResetWorkerCopy(Chunk* chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

// A shard's running totals, reported by GetStatus.
struct ShardCounters {
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> updates{0};
  std::atomic<uint64_t> rejected{0};
  // Payload bytes on the wire, and the same gradients and weights as fp32.
  std::atomic<uint64_t> bytes_in{0};
  std::atomic<uint64_t> bytes_out{0};
  std::atomic<uint64_t> bytes_in_fp32{0};
  std::atomic<uint64_t> bytes_out_fp32{0};
  // Updates that had to copy the weights because a reply still held them.
  std::atomic<uint64_t> weight_copies{0};
  // Two-phase steps' speculative updates kept, and recomputed.
  std::atomic<uint64_t> speculations_kept{0};
  std::atomic<uint64_t> speculations_recomputed{0};
};

// Replies built under a chunk's lock, delivered after it is released.
using PendingReplies =
    std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>>;

// Applies optimizer updates to chunks, each with its chunk's optimizer.
// Thread-safe (the chunk's mutex serialises updates of one chunk);
// everything it points to must outlive it.
class ChunkUpdater {
 public:
  // `metrics` and `snapshots` may be null (none kept, no checkpoints).
  ChunkUpdater(ShardCounters* counters, ServerMetrics* metrics,
               UpdateObserver* snapshots)
      : counters_(counters), metrics_(metrics), snapshots_(snapshots) {}

  // Applies update number chunk->version with chunk->optimizer to the
  // gradients of `count` workers summed in rank order into `sum` (see
  // Optimizer::ApplySum; async passes one gradient with count 1; the
  // fields set in `step` replace the declared hyperparameters), bumps the
  // version and copies the chunk for a checkpoint when one is due at the
  // new version.
  // REQUIRES: count >= 1; chunk->optimizer->CheckStepHyperparameters(step)
  // is OK. `scaling` unscales and clips (its skipped_updates is the chunk's
  // own).
  void Apply(Chunk* chunk, const float* sum, int32_t count,
             const StepHyperparameters& step,
             GradientScaling scaling = {}) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

  // A step that does not step the chunk's optimizer (no worker had a
  // gradient for it, or a two-phase step every shard skips whole): bumps
  // the version (counted as an update, with the checkpoint copy Apply
  // would make), leaves the weights and optimizer slots as they are, and
  // the optimizer's own step count (chunk->skipped_updates) stays behind.
  void Skip(Chunk* chunk) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

  // A two-phase step's speculative update (PushArgs::speculative_weights):
  // what Apply(chunk, sum, count, step, scaling) would compute, into
  // copies of the chunk's weights and slots in `*weights` and `*slots`
  // (buffers kept from step to step: `*weights` is replaced when a reply
  // still holds it); the chunk is left as it is.
  void Speculate(const Chunk& chunk, const float* sum, int32_t count,
                 const StepHyperparameters& step, GradientScaling scaling,
                 std::shared_ptr<std::vector<float>>* weights,
                 std::vector<std::vector<float>>* slots) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // Makes the speculative update in `*weights` and `*slots` the chunk's
  // (they get the chunk's old buffers) and advances as Apply does.
  void Commit(Chunk* chunk, std::shared_ptr<std::vector<float>>* weights,
              std::vector<std::vector<float>>* slots) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  // A speculative update the decision made useless.
  void CountRecomputed() const;

  // Counts the bytes and hands `reply` to `sink`. Call without locks: sinks
  // start gRPC writes.
  void Deliver(ReplySink* sink, ChunkReply reply) const;
  // Deliver of each of `replies` (emptied), those with the same weights
  // sharing one bfloat16 rounding of them.
  void DeliverAll(PendingReplies* replies) const;

 private:
  // The version bump, counters and checkpoint copy after an update.
  void Advance(Chunk* chunk) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

  ShardCounters* const counters_;
  ServerMetrics* const metrics_;
  UpdateObserver* const snapshots_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CHUNK_H_
