// A SnapshotScheduler decides when a shard copies its chunks for a checkpoint
// -- every `every` steps and at the steps Request asks for -- and hands the
// copies of one step to on_checkpoint once every owned chunk has made its
// copy. Thread-safe; its lock is taken after a chunk's, never before.
#ifndef SHARDPS_SERVER_SNAPSHOT_SCHEDULER_H_
#define SHARDPS_SERVER_SNAPSHOT_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "server/checkpoint.h"
#include "server/chunk.h"

namespace shardps::server {

struct SnapshotOptions {
  uint32_t shard_index = 0;  // for messages
  // Periodic checkpoints every this many steps; 0: only requested ones.
  int64_t every = 0;
  // Receives the copies of step V of every owned chunk, on a pool thread (it
  // may block to write them; updates go on). Unset: no checkpoints.
  std::function<void(int64_t step, std::vector<ChunkState> chunks)>
      on_checkpoint;
};

class SnapshotScheduler : public UpdateObserver {
 public:
  // `pool` runs the hand-overs and must outlive the scheduler.
  SnapshotScheduler(SnapshotOptions options, ThreadPool* pool);

  // The number of chunks a checkpoint holds. REQUIRES: before the first
  // AfterUpdate (set when the shard's model is declared or restored).
  void SetNumChunks(size_t n) ABSL_LOCKS_EXCLUDED(mu_);

  // Called right after `chunk`'s version changed: copies its state when a
  // checkpoint is due at the new version.
  void AfterUpdate(const Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu)
      ABSL_LOCKS_EXCLUDED(mu_) override;

  // `chunk`'s optimizer state is being replaced at its current version by
  // `slots` and `skipped_updates` (WriteOptimizerState): a copy of that
  // version not yet handed over takes them too. FailedPrecondition when the
  // copies of that version are already handed over (its checkpoint would
  // miss them); then the caller must not write.
  absl::Status Rewrite(const Chunk& chunk,
                       const std::vector<std::vector<float>>& slots,
                       int64_t skipped_updates)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) ABSL_LOCKS_EXCLUDED(mu_);

  // InvalidArgument for a negative step; FailedPrecondition without
  // on_checkpoint.
  absl::Status CheckRequest(int64_t step) const;

  // A checkpoint at `step` besides the periodic ones; `owned` are every
  // chunk of the shard. CheckRequest's codes; OutOfRange when a chunk has
  // already passed `step` without copying it (then nothing stays
  // requested).
  absl::Status Request(int64_t step, absl::Span<Chunk* const> owned)
      ABSL_LOCKS_EXCLUDED(mu_, request_mu_);

  // The shard was reset to `step` (every chunk locked by the caller): the
  // copies not handed over yet are dropped, hand-overs already scheduled
  // become no-ops, and every step they or pending requests were for beyond
  // `step` is requested again (the chunks will pass it again).
  void Reset(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool Periodic(int64_t step) const {
    return options_.every > 0 && step % options_.every == 0;
  }
  // Whether `step` is a checkpoint (periodic or requested).
  bool Due(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether chunk `chunk_id` has copied, or handed over, step `step`.
  bool Copied(uint32_t chunk_id, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SnapshotOptions options_;
  ThreadPool* const pool_;
  // Serialises Request: one request's mark is never taken back by another.
  absl::Mutex request_mu_;
  mutable absl::Mutex mu_;
  size_t num_chunks_ ABSL_GUARDED_BY(mu_) = 0;
  // Requested steps not handed over yet.
  std::set<int64_t> requested_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> num_requested_{0};  // requested_.size(), read unlocked
  // Copies by step, until every chunk has one.
  std::map<int64_t, std::vector<ChunkState>> copies_ ABSL_GUARDED_BY(mu_);
  // Steps whose copies went to a hand-over (scheduled or done).
  std::set<int64_t> handed_over_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> scheduled_ ABSL_GUARDED_BY(mu_);  // not run yet
  // Bumped by every Reset: hand-overs scheduled before it do nothing.
  uint64_t resets_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SNAPSHOT_SCHEDULER_H_
