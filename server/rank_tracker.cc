#include "server/rank_tracker.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardps::server {

RankTracker::RankTracker(uint32_t shard_index, uint32_t num_workers)
    : shard_index_(shard_index), num_workers_(num_workers) {
  absl::MutexLock lock(&mu_);
  ranks_.resize(num_workers);
}

std::vector<std::string> RankTracker::ApplyView(const v1::ClusterView& view,
                                                bool* released) {
  using Kind = RankState::Kind;
  std::vector<std::string> changes;
  *released = false;
  absl::MutexLock lock(&mu_);
  // A restarted coordinator counts generations from 1 again.
  const bool same_coordinator =
      coordinated_ &&
      view.coordinator_incarnation() == coordinator_incarnation_;
  if (same_coordinator && view.generation() <= view_generation_) {
    return changes;
  }
  coordinated_ = true;
  coordinator_incarnation_ = view.coordinator_incarnation();
  view_generation_ = view.generation();
  const uint64_t g = view.generation();
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.rank() >= ranks_.size()) continue;
    RankState& r = ranks_[w.rank()];
    if (!w.alive()) {
      // Incarnation 0: no worker held the rank since this coordinator
      // started. A rank this shard saw alive under an earlier coordinator
      // that has not come back once the coordinator settled is gone; one it
      // never saw is still to come (a job's first workers). A rank the
      // coordinator saw leave (incarnation set) is gone, also when this
      // shard never saw it (it restarted after).
      if (r.kind == Kind::kGone) continue;
      const bool left = w.incarnation() != 0 || (view.settled() && r.seen);
      if (!left) continue;  // not there yet: the first workers arriving
      *released = *released || r.kind == Kind::kActive;
      r.kind = Kind::kGone;
      r.changed_generation = g;
      changes.push_back(absl::StrCat(
          "rank ", w.rank(), w.finished() ? " finished" : " left the job",
          " (generation ", g, "): steps no longer wait for it"));
      continue;
    }
    if (!r.seen) {  // the first workers arriving
      r.seen = true;
      r.incarnation = w.incarnation();
      continue;
    }
    if (r.kind != Kind::kGone && w.incarnation() == r.incarnation) continue;
    *released = *released || r.kind == Kind::kActive;
    r.kind = Kind::kPending;
    r.incarnation = w.incarnation();
    r.changed_generation = g;
    changes.push_back(absl::StrCat(
        "rank ", w.rank(), " is held by a new worker process (incarnation ",
        w.incarnation(), ", generation ", g,
        "): steps wait for it from the join step it declares"));
  }
  return changes;
}

absl::Status RankTracker::CheckIncarnation(uint32_t rank,
                                           uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  return CheckIncarnationLocked(rank, incarnation);
}

absl::Status RankTracker::CheckIncarnationLocked(uint32_t rank,
                                                 uint64_t incarnation) const {
  const RankState& r = ranks_[rank];
  if (!coordinated_ || !r.seen) return absl::OkStatus();
  if (incarnation > r.incarnation) {
    return absl::UnavailableError(absl::StrCat(
        "shard ", shard_index_,
        " has not yet seen the coordinator's view in which this worker "
        "process (rank ",
        rank, ", incarnation ", incarnation, ") joined; retry"));
  }
  if (incarnation < r.incarnation) {
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " is held by a newer worker process (incarnation ",
        r.incarnation, ") since generation ", r.changed_generation,
        "; this request comes from incarnation ", incarnation,
        ", which is no longer part of the job: join it again"));
  }
  if (r.kind == RankState::Kind::kGone) {
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " left the job at generation ", r.changed_generation,
        " (it left or stopped sending heartbeats): join the job again"));
  }
  return absl::OkStatus();
}

absl::Status RankTracker::CheckPush(uint32_t rank, uint64_t incarnation,
                                    int64_t step) const {
  absl::MutexLock lock(&mu_);
  SHARDPS_RETURN_IF_ERROR(CheckIncarnationLocked(rank, incarnation));
  const RankState& r = ranks_[rank];
  if (r.kind == RankState::Kind::kPending) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank,
        " joined a running job: declare the step it joins at first "
        "(DeclareRequest.join)"));
  }
  if (step < r.from_step) {
    return absl::OutOfRangeError(absl::StrCat("step ", step, " of rank ", rank,
                                              " is before its join step ",
                                              r.from_step));
  }
  return absl::OkStatus();
}

bool RankTracker::WaitsFor(uint32_t rank, int64_t step) const {
  absl::MutexLock lock(&mu_);
  return ranks_[rank].WaitsAt(step);
}

bool RankTracker::Complete(const std::vector<bool>& contributed,
                           int64_t step) const {
  absl::MutexLock lock(&mu_);
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (!contributed[r] && ranks_[r].WaitsAt(step)) return false;
  }
  return true;
}

std::vector<uint32_t> RankTracker::ActiveRanks(int64_t step) const {
  std::vector<uint32_t> ranks;
  absl::MutexLock lock(&mu_);
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (ranks_[r].WaitsAt(step)) ranks.push_back(r);
  }
  return ranks;
}

std::optional<int64_t> RankTracker::SlowestClock(
    const std::vector<int64_t>& clocks) const {
  std::optional<int64_t> slowest;
  absl::MutexLock lock(&mu_);
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (ranks_[r].kind != RankState::Kind::kActive) continue;
    slowest = slowest.has_value() ? std::min(*slowest, clocks[r]) : clocks[r];
  }
  return slowest;
}

RankTracker::Standing RankTracker::standing(uint32_t rank) const {
  absl::MutexLock lock(&mu_);
  const RankState& r = ranks_[rank];
  Standing s;
  s.must_join = r.kind == RankState::Kind::kPending;
  s.active = r.kind == RankState::Kind::kActive;
  s.from_step = r.from_step;
  return s;
}

absl::StatusOr<RankTracker::JoinToken> RankTracker::BeginJoin(
    uint32_t rank, uint64_t incarnation, int64_t join_step) {
  absl::MutexLock lock(&mu_);
  if (!coordinated_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", shard_index_,
        " follows no coordinator (a static job): a worker cannot join it "
        "while it runs"));
  }
  SHARDPS_RETURN_IF_ERROR(CheckIncarnationLocked(rank, incarnation));
  RankState& r = ranks_[rank];
  JoinToken token;
  token.rank = rank;
  token.join_step = join_step;
  token.incarnation = r.incarnation;
  token.kind = static_cast<int>(r.kind);
  token.from_step = r.from_step;
  r.kind = RankState::Kind::kActive;
  r.from_step = join_step;
  return token;
}

void RankTracker::UndoJoin(const JoinToken& token) {
  absl::MutexLock lock(&mu_);
  RankState& now = ranks_[token.rank];
  // Unless a view changed the rank meanwhile.
  if (now.kind == RankState::Kind::kActive &&
      now.from_step == token.join_step &&
      now.incarnation == token.incarnation) {
    now.kind = static_cast<RankState::Kind>(token.kind);
    now.from_step = token.from_step;
  }
}

uint64_t RankTracker::view_generation() const {
  absl::MutexLock lock(&mu_);
  return view_generation_;
}

}  // namespace shardps::server
