// Checkpoints of one running shard: writes the shard's file for a step and,
// when every shard's file of that step is on disk, commits the step (the
// last shard to finish does it; two finishing at once write the same
// manifest), then prunes old ones. Also loads the newest committed
// checkpoint at start-up. Thread-safe: Write may run on any thread.
#ifndef SHARDPS_SERVER_SHARD_CHECKPOINTER_H_
#define SHARDPS_SERVER_SHARD_CHECKPOINTER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint.h"

namespace shardps::server {

// What a shard restores from: the model and its chunks at `step`.
struct RestoredShard {
  int64_t step = 0;
  v1::DeclareRequest declaration;
  std::vector<ChunkState> chunks;
  std::vector<std::string> skipped;  // torn checkpoints passed over
};

// The outcome of one Write, for the daemon's log.
struct CheckpointWrite {
  int64_t step = 0;
  uint64_t bytes = 0;
  double seconds = 0;      // writing this shard's file, fsync included
  bool committed = false;  // this call committed the step
};

// How far this shard's checkpoints got, for GetStatus; steps are 0 for none.
struct CheckpointProgress {
  int64_t written_step = 0;    // the last step whose file this shard wrote
  int64_t committed_step = 0;  // the newest committed step in the directory
  int64_t failed_step = 0;     // the last step not written (failed, skipped)
  std::string error;           // why failed_step was not written
};

class ShardCheckpointer {
 public:
  // `dir` is shared by every shard of the job. REQUIRES: keep >= 1.
  ShardCheckpointer(std::string dir, uint32_t shard_index, uint32_t num_shards,
                    int keep);

  // The newest committed checkpoint's state for this shard (any number of
  // shards may have written it), or nullopt when `dir` holds none. Errors
  // from a checkpoint that exists but cannot be loaded.
  absl::StatusOr<std::optional<RestoredShard>> LoadLatest() const;
  // This shard's chunks from the committed checkpoint of exactly `step`.
  absl::StatusOr<RestoredShard> LoadStep(int64_t step) const;
  // This shard's chunks from `info`, a checkpoint LatestCommitted or
  // CommittedAt verified (the files read are checked again).
  absl::StatusOr<RestoredShard> LoadFrom(const CheckpointInfo& info) const;

  // Writes this shard's file of `step`, then commits the step if every
  // shard's file is there. FailedPrecondition for an unwritable directory.
  absl::StatusOr<CheckpointWrite> Write(int64_t step,
                                        const v1::DeclareRequest& declaration,
                                        const std::vector<ChunkState>& chunks)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Records that the checkpoint of `step` was not written, and `why` (Write
  // records its own failures).
  void Failed(int64_t step, const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

  // The steps written and failed so far; the committed step is read from the
  // directory (NewestCommittedStep), so it counts commits by any shard and
  // checkpoints restored at start.
  CheckpointProgress Progress() const ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& dir() const { return dir_; }

 private:
  // Commits `step` when all its shard files exist; returns whether it did.
  absl::StatusOr<bool> TryCommit(int64_t step, const ShardFile& mine);

  const std::string dir_;
  const uint32_t shard_index_;
  const uint32_t num_shards_;
  const int keep_;

  mutable absl::Mutex mu_;
  CheckpointProgress progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_CHECKPOINTER_H_
