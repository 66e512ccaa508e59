#include "server/snapshot_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardps::server {

SnapshotScheduler::SnapshotScheduler(SnapshotOptions options, ThreadPool* pool)
    : options_(std::move(options)), pool_(pool) {}

void SnapshotScheduler::SetNumChunks(size_t n) {
  absl::MutexLock lock(&mu_);
  num_chunks_ = n;
}

bool SnapshotScheduler::Due(int64_t step) const {
  return Periodic(step) || requested_.count(step) > 0;
}

bool SnapshotScheduler::Copied(uint32_t chunk_id, int64_t step) const {
  if (handed_over_.count(step) > 0) return true;
  auto it = copies_.find(step);
  if (it == copies_.end()) return false;
  return std::any_of(
      it->second.begin(), it->second.end(),
      [chunk_id](const ChunkState& c) { return c.chunk_id == chunk_id; });
}

void SnapshotScheduler::AfterUpdate(const Chunk& chunk) {
  const int64_t step = chunk.version;
  // The common case, without the lock: no checkpoint at this step.
  if (!options_.on_checkpoint ||
      (!Periodic(step) && num_requested_.load() == 0)) {
    return;
  }
  uint64_t resets = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!Due(step) || Copied(chunk.spec.id, step)) return;
    resets = resets_;
  }
  // Copied without the scheduler's lock: other chunks' updates go on.
  ChunkState copy;
  copy.chunk_id = chunk.spec.id;
  copy.version = step;
  copy.skipped_updates = chunk.skipped_updates;
  copy.weights = *chunk.weights;
  copy.slots = chunk.slots;
  absl::MutexLock lock(&mu_);
  // A request taken back or a reset meanwhile: the copy is not wanted.
  if (resets != resets_ || !Due(step) || Copied(chunk.spec.id, step)) return;
  std::vector<ChunkState>& copies = copies_[step];
  copies.push_back(std::move(copy));
  if (copies.size() < num_chunks_) return;
  std::vector<ChunkState> all = std::move(copies);
  copies_.erase(step);
  if (requested_.erase(step) > 0) num_requested_.store(requested_.size());
  handed_over_.insert(step);
  scheduled_.insert(step);
  pool_->Schedule([this, step, resets, all = std::move(all)]() mutable {
    {
      absl::MutexLock lock(&mu_);
      scheduled_.erase(step);
      if (resets != resets_) return;  // counted before a reset
    }
    options_.on_checkpoint(step, std::move(all));
  });
}

absl::Status SnapshotScheduler::Rewrite(
    const Chunk& chunk, const std::vector<std::vector<float>>& slots,
    int64_t skipped_updates) {
  const int64_t step = chunk.version;
  absl::MutexLock lock(&mu_);
  if (handed_over_.count(step) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard_index,
                     " has already taken its checkpoint of "
                     "step ",
                     step,
                     " without this optimizer state: write it at the next "
                     "step"));
  }
  auto it = copies_.find(step);
  if (it == copies_.end()) return absl::OkStatus();
  for (ChunkState& copy : it->second) {
    if (copy.chunk_id != chunk.spec.id) continue;
    copy.slots = slots;
    copy.skipped_updates = skipped_updates;
  }
  return absl::OkStatus();
}

absl::Status SnapshotScheduler::CheckRequest(int64_t step) const {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint step ", step, " is negative"));
  }
  if (!options_.on_checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard_index,
        " writes no checkpoints: start it with a checkpoint directory"));
  }
  return absl::OkStatus();
}

absl::Status SnapshotScheduler::Request(int64_t step,
                                        absl::Span<Chunk* const> owned) {
  SHARDPS_RETURN_IF_ERROR(CheckRequest(step));
  absl::MutexLock request_lock(&request_mu_);
  // Marked first: a chunk that reaches `step` from now on copies it. One
  // that passed it before, without a copy, makes the request too late.
  bool marked = false;
  {
    absl::MutexLock lock(&mu_);
    if (!Due(step)) {
      requested_.insert(step);
      num_requested_.store(requested_.size());
      marked = true;
    }
  }
  int64_t reached = -1;
  for (Chunk* chunk : owned) {
    absl::MutexLock chunk_lock(&chunk->mu);
    if (chunk->version < step) continue;
    absl::MutexLock lock(&mu_);
    if (!Copied(chunk->spec.id, step)) {
      reached = chunk->version;
      break;
    }
  }
  if (reached < 0) return absl::OkStatus();
  if (marked) {
    // Taken back with any copy made meanwhile, so that no partial
    // checkpoint is left waiting.
    absl::MutexLock lock(&mu_);
    requested_.erase(step);
    num_requested_.store(requested_.size());
    copies_.erase(step);
  }
  return absl::OutOfRangeError(absl::StrCat(
      "shard ", options_.shard_index, " has already reached step ", reached,
      ", too late for a checkpoint of step ", step, ": ask for a later step"));
}

void SnapshotScheduler::Reset(int64_t step) {
  absl::MutexLock lock(&mu_);
  ++resets_;
  // Passed but not written yet: the chunks pass these steps again.
  for (const auto& [copied, unused] : copies_) requested_.insert(copied);
  for (int64_t scheduled : scheduled_) requested_.insert(scheduled);
  copies_.clear();
  scheduled_.clear();
  requested_.erase(requested_.begin(), requested_.upper_bound(step));
  // Steps beyond the reset will be passed again.
  handed_over_.erase(handed_over_.upper_bound(step), handed_over_.end());
  num_requested_.store(requested_.size());
}

}  // namespace shardps::server
