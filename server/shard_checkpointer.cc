#include "server/shard_checkpointer.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "common/status.h"

namespace shardps::server {

ShardCheckpointer::ShardCheckpointer(std::string dir, uint32_t shard_index,
                                     uint32_t num_shards, int keep)
    : dir_(std::move(dir)),
      shard_index_(shard_index),
      num_shards_(num_shards),
      keep_(keep) {}

absl::StatusOr<std::optional<RestoredShard>> ShardCheckpointer::LoadLatest()
    const {
  absl::StatusOr<CheckpointInfo> latest = LatestCommitted(dir_);
  if (absl::IsNotFound(latest.status())) return std::nullopt;
  if (!latest.ok()) return latest.status();
  return LoadFrom(*latest);
}

absl::StatusOr<RestoredShard> ShardCheckpointer::LoadStep(int64_t step) const {
  SHARDPS_ASSIGN_OR_RETURN(const CheckpointInfo info, CommittedAt(dir_, step));
  return LoadFrom(info);
}

absl::StatusOr<RestoredShard> ShardCheckpointer::LoadFrom(
    const CheckpointInfo& latest) const {
  RestoredShard restored;
  restored.step = latest.step;
  restored.skipped = latest.skipped;
  SHARDPS_ASSIGN_OR_RETURN(restored.declaration, CheckpointDeclaration(latest));
  SHARDPS_ASSIGN_OR_RETURN(restored.chunks,
                           LoadChunksForShard(latest, shard_index_, num_shards_,
                                              restored.declaration));
  return restored;
}

absl::StatusOr<CheckpointWrite> ShardCheckpointer::Write(
    int64_t step, const v1::DeclareRequest& declaration,
    const std::vector<ChunkState>& chunks) {
  CheckpointWrite out;
  out.step = step;
  const absl::Time start = absl::Now();
  absl::StatusOr<ShardFile> mine = WriteShardCheckpoint(
      dir_, step, shard_index_, num_shards_, declaration, chunks);
  if (!mine.ok()) {
    Failed(step, mine.status());
    return mine.status();
  }
  out.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  out.bytes = mine->bytes;
  {
    absl::MutexLock lock(&mu_);
    progress_.written_step = std::max(progress_.written_step, step);
  }
  absl::StatusOr<bool> committed = TryCommit(step, *mine);
  if (!committed.ok()) {
    Failed(step, committed.status());
    return committed.status();
  }
  out.committed = *committed;
  return out;
}

void ShardCheckpointer::Failed(int64_t step, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  progress_.failed_step = step;
  progress_.error = std::string(why.message());
}

CheckpointProgress ShardCheckpointer::Progress() const {
  CheckpointProgress progress;
  {
    absl::MutexLock lock(&mu_);
    progress = progress_;
  }
  // Listed outside the lock: that may take a while on a network disk. A
  // directory that cannot be listed reports no commit; writing to it fails
  // and says why.
  absl::StatusOr<int64_t> committed = NewestCommittedStep(dir_);
  if (committed.ok() && *committed != kNoCommittedStep) {
    progress.committed_step = *committed;
  }
  return progress;
}

absl::StatusOr<bool> ShardCheckpointer::TryCommit(int64_t step,
                                                  const ShardFile& mine) {
  std::vector<ShardFile> files(num_shards_);
  for (uint32_t s = 0; s < num_shards_; ++s) {
    if (s == shard_index_) {
      files[s] = mine;
      continue;
    }
    absl::StatusOr<ShardFile> other =
        DescribeShardFile(dir_, step, s, num_shards_);
    // Renamed into place only once complete: a missing file means that
    // shard has not finished, and it will commit when it does.
    if (absl::IsNotFound(other.status())) return false;
    if (!other.ok()) return other.status();
    files[s] = *std::move(other);
  }
  SHARDPS_RETURN_IF_ERROR(CommitCheckpoint(dir_, step, num_shards_, files));
  SHARDPS_RETURN_IF_ERROR(PruneCheckpoints(dir_, keep_));
  return true;
}

}  // namespace shardps::server
