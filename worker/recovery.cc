#include "worker/recovery.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"

namespace shardps::worker {

int64_t EpochStartAtOrAfter(int64_t step, int64_t steps_per_epoch,
                            int64_t total_steps) {
  const int64_t start =
      (step + steps_per_epoch - 1) / steps_per_epoch * steps_per_epoch;
  return std::min(start, total_steps);
}

int64_t MinVersion(const std::vector<v1::DeclareResponse>& shards) {
  int64_t lo = -1;
  for (const v1::DeclareResponse& s : shards) {
    if (lo < 0 || s.version() < lo) lo = s.version();
  }
  return std::max<int64_t>(lo, 0);
}

bool IsSync(const std::vector<v1::DeclareResponse>& shards) {
  // Shards of one job share a mode; shard 0 speaks for them.
  return shards.empty() ||
         (shards.front().consistency() != v1::CONSISTENCY_ASYNC &&
          shards.front().consistency() != v1::CONSISTENCY_SSP);
}

RollbackProgress RollbackProgressOf(
    const std::vector<v1::DeclareResponse>& shards, uint64_t id, int64_t step,
    bool sync) {
  RollbackProgress p{true, true};
  for (const v1::DeclareResponse& s : shards) {
    p.applied = p.applied && s.rollback_id() >= id;
    p.there = p.there &&
              (!sync || (s.version() == step && s.max_version() <= step + 1));
  }
  return p;
}

std::vector<uint32_t> RanksSharingTheBatch(
    Client* client, const std::function<std::vector<uint32_t>()>& view_ranks,
    uint32_t num_workers, uint32_t self) {
  std::vector<uint32_t> ranks;
  if (view_ranks) {
    absl::StatusOr<std::vector<v1::DeclareResponse>> shards =
        client->Redeclare();
    if (shards.ok() && !shards->empty()) {
      ranks.assign(shards->front().active_ranks().begin(),
                   shards->front().active_ranks().end());
    }
    if (ranks.empty()) ranks = view_ranks();
  }
  if (ranks.empty()) {
    for (uint32_t r = 0; r < num_workers; ++r) ranks.push_back(r);
  }
  // This worker trains whatever its view says (it may lag).
  if (!std::binary_search(ranks.begin(), ranks.end(), self)) {
    ranks.insert(std::upper_bound(ranks.begin(), ranks.end(), self), self);
  }
  return ranks;
}

Recovery::Recovery(RecoveryOptions options, Client* client, Tensors weights,
                   int64_t steps_per_epoch, int64_t total_steps,
                   RollbackNews rollback, bool rejoin_when_dropped)
    : Recovery(
          std::move(options), client, [weights] { return weights; },
          steps_per_epoch, total_steps, std::move(rollback),
          rejoin_when_dropped) {}

Recovery::Recovery(RecoveryOptions options, Client* client,
                   std::function<Tensors()> weights, int64_t steps_per_epoch,
                   int64_t total_steps, RollbackNews rollback,
                   bool rejoin_when_dropped)
    : options_(std::move(options)),
      client_(client),
      weights_(std::move(weights)),
      steps_per_epoch_(steps_per_epoch),
      total_steps_(total_steps),
      rollback_(std::move(rollback)),
      rejoin_when_dropped_(rejoin_when_dropped) {}

void Recovery::Start() {
  sync_ = IsSync(client_->declared());
  if (rollback_) SeeRollback(rollback_().first);
}

void Recovery::SeeRollback(uint64_t id) {
  seen_rollback_ = id;
  client_->set_rollback_id(id);
}

absl::StatusOr<int64_t> Recovery::JoinRunningJob() {
  // Sync: past every step a shard has started. Async and ssp: the
  // servers' versions count updates; this rank's own clock is the step.
  int64_t join = EpochStartAtOrAfter(
      sync_ ? client_->max_version() : client_->start_step(), steps_per_epoch_,
      total_steps_);
  while (true) {
    const absl::Status s = client_->JoinAt(join);
    if (s.ok()) break;
    if (!absl::IsOutOfRange(s) || join >= total_steps_) return s;
    join = EpochStartAtOrAfter(join + 1, steps_per_epoch_, total_steps_);
  }
  join_step_ = join;
  LogInfo(
      "rank %d joins the running job at step %d (start of epoch %d); the "
      "servers wait for it from then on",
      client_->rank(), join, join / steps_per_epoch_ + 1);
  SHARDPS_RETURN_IF_ERROR(AwaitJobAt(join));
  return join;
}

absl::Status Recovery::AwaitJobAt(int64_t step) {
  absl::Time next_log = absl::Now() + options_.log_every;
  absl::Time next_declare = absl::Now() + options_.redeclare_join_every;
  absl::Time failing_since = absl::InfiniteFuture();
  while (true) {
    absl::StatusOr<std::vector<v1::DeclareResponse>> shards =
        client_->Redeclare();
    const int64_t at = shards.ok() ? MinVersion(*shards) : -1;
    if (shards.ok() && at >= step) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (!shards.ok()) {
      // A shard restarting: keep asking for a while.
      failing_since = std::min(failing_since, now);
      if (now - failing_since > options_.shard_away_timeout) {
        return shards.status();
      }
    } else {
      failing_since = absl::InfiniteFuture();
    }
    if (now >= next_declare) {
      // Again, for a shard that restarted and lost it; a no-op elsewhere.
      const absl::Status s = client_->JoinAt(step);
      if (!s.ok() && !absl::IsUnavailable(s)) return s;
      next_declare = now + options_.redeclare_join_every;
    }
    if (now >= next_log) {
      LogInfo("waiting for the job to reach step %d (now at step %s)", step,
              shards.ok() ? absl::StrCat(at) : shards.status().ToString());
      next_log = now + options_.log_every;
    }
    absl::SleepFor(options_.shard_poll);
  }
}

absl::StatusOr<bool> Recovery::AwaitRollback(uint64_t id, int64_t step,
                                             int64_t at) {
  const absl::Time deadline = absl::Now() + options_.rollback_timeout;
  bool announced = false;
  while (true) {
    absl::StatusOr<std::vector<v1::DeclareResponse>> shards =
        client_->Redeclare();
    // A shard that does not answer (restarting, or not yet aware that this
    // process rejoined) is neither: ask again.
    const RollbackProgress p =
        shards.ok() ? RollbackProgressOf(*shards, id, step, sync_)
                    : RollbackProgress{};
    if (p.applied && !p.there && !announced) {
      // Every shard took the rollback long ago (it needed no reset, or the
      // job has moved on since): nothing to go back to.
      SeeRollback(id);
      return false;
    }
    if (!announced) {
      LogWarning(
          "the job rolls back to step %d (rollback %d) from step %d, %d "
          "step(s) to redo: a server restarted from the last committed "
          "checkpoint; waiting for every shard to reset",
          step, id, at, at - step);
      announced = true;
    }
    if (p.applied && p.there) break;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the shards did not all reset to step ", step, " for rollback ", id,
          " within ", absl::FormatDuration(options_.rollback_timeout),
          shards.ok() ? "" : absl::StrCat(": ", shards.status().message())));
    }
    absl::SleepFor(options_.shard_poll);
  }
  SeeRollback(id);
  if (join_step_ > step) {
    // Joined after the rollback's step: join there again (a restarted
    // shard lost it) and wait for the others to get back to it.
    SHARDPS_RETURN_IF_ERROR(client_->JoinAt(join_step_));
    SHARDPS_RETURN_IF_ERROR(AwaitJobAt(join_step_));
  }
  SHARDPS_RETURN_IF_ERROR(client_->Pull(weights_()));
  return true;
}

absl::StatusOr<int64_t> Recovery::Recover(const absl::Status& why, int64_t at) {
  if ((!rollback_ && !rejoin_when_dropped_) || absl::IsInvalidArgument(why)) {
    return why;
  }
  // The coordinator's news may trail the refusal a little.
  const absl::Time deadline = absl::Now() + options_.explanation_timeout;
  bool dropped_checked = false;
  while (true) {
    if (rollback_) {
      const auto [id, step] = rollback_();
      if (id > seen_rollback_) {
        SHARDPS_ASSIGN_OR_RETURN(const bool rolled_back,
                                 AwaitRollback(id, step, at));
        if (rolled_back) return std::max(step, join_step_);
        // A push refused for predating that rollback: redo it.
        if (absl::IsAborted(why)) return at;
      }
    }
    const bool refused =
        absl::IsAborted(why) || absl::IsFailedPrecondition(why);
    if (rejoin_when_dropped_ && refused && !dropped_checked) {
      // Dropped: the shards see this process as new to the job.
      const v1::Layout layout = client_->layout();
      const v1::OptimizerSpec optimizer = client_->optimizer();
      const absl::Status s = client_->Declare(layout, optimizer);
      if (s.ok() && client_->must_join()) {
        LogWarning("the servers refused this worker's push (%s); joining again",
                   why.message());
        SHARDPS_ASSIGN_OR_RETURN(const int64_t step, JoinRunningJob());
        SHARDPS_RETURN_IF_ERROR(client_->Pull(weights_()));
        return step;
      }
      // Still a member: wait for a rollback; an ABORTED Declare means the
      // drop is not visible everywhere yet: ask again.
      dropped_checked = s.ok();
    }
    if (absl::Now() > deadline) return why;
    absl::SleepFor(options_.view_poll);
  }
}

}  // namespace shardps::worker
