#include "coordinator/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "coordinator/coordinator_protocol.h"

namespace shardps::coordinator {
namespace {

constexpr uint32_t kMaxMembersPerRole = 65536;

const char* RoleName(v1::Role role) {
  return role == v1::ROLE_SERVER ? "server" : "worker";
}
const char* IndexName(v1::Role role) {
  return role == v1::ROLE_SERVER ? "shard index" : "rank";
}

const char* KindText(MembershipEvent::Kind kind) {
  switch (kind) {
    case MembershipEvent::Kind::kJoined:
      return "joined";
    case MembershipEvent::Kind::kReplaced:
      return "joined again from the same address, replacing its old membership";
    case MembershipEvent::Kind::kLeft:
      return "left";
    case MembershipEvent::Kind::kExpired:
      return "expired (no heartbeat within the timeout)";
    case MembershipEvent::Kind::kRejected:
      return "rejected";
    case MembershipEvent::Kind::kFinished:
      return "finished its training and left";
    case MembershipEvent::Kind::kJobFinished:
      return "job finished";
    case MembershipEvent::Kind::kRollback:
      return "restarted from the last committed checkpoint";
  }
  return "changed";
}

absl::Status CheckProgress(int64_t step, int64_t epoch) {
  if (step < 0 || epoch < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step, " and epoch ", epoch, " must not be negative"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DescribeEvent(const MembershipEvent& e) {
  if (e.kind == MembershipEvent::Kind::kRejected) {
    return absl::StrCat("rejected join: ", e.detail, "; generation ",
                        e.generation, " unchanged");
  }
  if (e.kind == MembershipEvent::Kind::kJobFinished) {
    return absl::StrCat("job finished (", e.detail, "); generation ",
                        e.generation);
  }
  if (e.kind == MembershipEvent::Kind::kRollback) {
    return absl::StrCat(RoleName(e.role), " ", e.index, " (", e.address, ") ",
                        KindText(e.kind), ": ", e.detail,
                        " for every member; generation ", e.generation);
  }
  return absl::StrCat(
      RoleName(e.role), " ", e.index,
      e.address.empty() ? "" : absl::StrCat(" (", e.address, ")"), " ",
      KindText(e.kind), "; generation ", e.generation);
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Create(
    MembershipOptions options) {
  if (options.job_id.empty()) {
    return absl::InvalidArgumentError("--job_id is empty");
  }
  if (options.num_servers < 1 || options.num_servers > kMaxMembersPerRole) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_servers=", options.num_servers, " must be in [1, 65536]"));
  }
  if (options.num_workers < 1 || options.num_workers > kMaxMembersPerRole) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_workers=", options.num_workers, " must be in [1, 65536]"));
  }
  if (options.heartbeat_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_timeout_ms=",
                     absl::ToInt64Milliseconds(options.heartbeat_timeout),
                     " must be positive"));
  }
  if (!options.clock) options.clock = [] { return absl::Now(); };
  return std::unique_ptr<Membership>(new Membership(std::move(options)));
}

Membership::Membership(MembershipOptions options)
    : options_(std::move(options)), start_(options_.clock()) {
  absl::MutexLock lock(&mu_);
  servers_.resize(options_.num_servers);
  workers_.resize(options_.num_workers);
}

absl::Status Membership::ValidateJoin(const v1::JoinRequest& r) const {
  if (r.protocol_version() != kCoordinatorProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", r.protocol_version(),
        ", this coordinator speaks version ", kCoordinatorProtocolVersion));
  }
  if (r.job_id() != options_.job_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job id \"", r.job_id(), "\", this coordinator runs job \"",
        options_.job_id, "\""));
  }
  if (r.role() != v1::ROLE_SERVER && r.role() != v1::ROLE_WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("role ", v1::Role_Name(r.role()),
                     ": join as ROLE_SERVER or ROLE_WORKER"));
  }
  const std::string& a = r.address();
  const size_t colon = a.rfind(':');
  if (r.role() == v1::ROLE_SERVER &&
      (colon == std::string::npos || colon == 0 || colon + 1 == a.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a server joins with its host:port address, got \"", a, "\""));
  }
  const uint32_t count =
      r.role() == v1::ROLE_SERVER ? options_.num_servers : options_.num_workers;
  if (r.requested_index() >= 0 &&
      static_cast<uint32_t>(r.requested_index()) >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        IndexName(r.role()), " ", r.requested_index(), " is outside [0, ",
        count, "): this job has ", count, " ", RoleName(r.role()), "s"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Membership::PickIndex(const v1::JoinRequest& r) const {
  const std::vector<Slot>& slots = Slots(r.role());
  const int32_t requested = r.requested_index();
  const char* what = IndexName(r.role());
  if (r.role() == v1::ROLE_SERVER) {
    // A server joining from an address it held before is a restart: it gets
    // its old index back (replacing itself when the old lease is still live).
    // Prefer the live slot; a dead one with that address is free anyway.
    std::optional<uint32_t> own;
    for (uint32_t i = 0; i < slots.size(); ++i) {
      if (slots[i].address != r.address()) continue;
      if (!own.has_value() || slots[i].alive()) own = i;
      if (slots[i].alive()) break;
    }
    if (own.has_value() &&
        (requested < 0 || requested == static_cast<int32_t>(*own))) {
      return *own;
    }
    if (own.has_value() && slots[*own].alive()) {
      return absl::AlreadyExistsError(
          absl::StrCat("address ", r.address(), " already holds shard index ",
                       *own, "; it cannot also take shard index ", requested));
    }
  }
  if (requested >= 0) {
    const Slot& slot = slots[requested];
    if (!slot.alive()) return static_cast<uint32_t>(requested);
    return absl::AlreadyExistsError(absl::StrCat(
        what, " ", requested, " is held by ",
        slot.address.empty() ? "another live member" : slot.address,
        " (generation ", generation_, ")"));
  }
  // A finished rank is not free for "any": a late worker must not start a
  // job's training over.
  for (uint32_t i = 0; i < slots.size(); ++i) {
    if (!slots[i].alive() && !slots[i].finished) return i;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("all ", slots.size(), " ", RoleName(r.role()),
                   " slots are held by live members or finished (", what,
                   "s 0 to ", slots.size() - 1, ")"));
}

absl::StatusOr<v1::JoinResponse> Membership::Join(const v1::JoinRequest& r) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::JoinResponse> result = JoinLocked(r);
  if (!result.ok()) {
    MembershipEvent e;
    e.kind = MembershipEvent::Kind::kRejected;
    e.role = r.role();
    e.address = r.address();
    e.generation = generation_;
    e.detail = absl::StrCat(
        v1::Role_Name(r.role()), " from \"", r.address(), "\" asking for ",
        r.requested_index() < 0 ? "any index"
                                : absl::StrCat("index ", r.requested_index()),
        " in job \"", r.job_id(), "\": ", result.status().ToString());
    AddEvent(std::move(e));
  }
  return result;
}

absl::StatusOr<v1::JoinResponse> Membership::JoinLocked(
    const v1::JoinRequest& r) {
  SHARDPS_RETURN_IF_ERROR(ValidateJoin(r));
  if (job_finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job \"", options_.job_id,
                     "\" has finished: every worker completed its training"));
  }
  ExpireLocked();
  SHARDPS_ASSIGN_OR_RETURN(const uint32_t index, PickIndex(r));
  const SlotRef ref(r.role(), index);
  Slot& slot = Slots(r.role())[index];
  MembershipEvent::Kind kind = MembershipEvent::Kind::kJoined;
  // Held before: a server restarting. Its state comes from the job's last
  // committed checkpoint, which the other shards are past: roll back.
  const bool restart = slot.last_heartbeat != absl::InfinitePast();
  if (slot.alive()) {
    members_.erase(slot.member_id);
    kind = MembershipEvent::Kind::kReplaced;
  }
  slot.member_id = absl::StrFormat("%s%u-%016x-%u", RoleName(r.role()), index,
                                   options_.incarnation, next_member_++);
  slot.address = r.address();
  slot.last_heartbeat = options_.clock();
  slot.step = 0;
  slot.epoch = 0;
  slot.finished = false;
  slot.incarnation = r.incarnation();
  slot.stalled.clear();
  members_[slot.member_id] = ref;
  ++generation_;
  Record(kind, ref);
  if (restart && r.role() == v1::ROLE_SERVER && r.restored()) {
    // Numbered from the start time, so that they keep growing across
    // coordinator restarts.
    rollback_id_ = std::max(rollback_id_ + 1,
                            static_cast<uint64_t>(absl::ToUnixMicros(start_)));
    rollback_step_ = r.restored_step();
    MembershipEvent e;
    e.kind = MembershipEvent::Kind::kRollback;
    e.role = r.role();
    e.index = index;
    e.address = r.address();
    e.generation = generation_;
    e.detail =
        absl::StrCat("rollback ", rollback_id_, " to step ", rollback_step_);
    AddEvent(std::move(e));
  }

  v1::JoinResponse response;
  response.set_member_id(slot.member_id);
  response.set_index(index);
  *response.mutable_view() = ViewLocked();
  response.set_heartbeat_timeout_ms(
      absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  return response;
}

absl::StatusOr<Membership::Slot*> Membership::FindLive(
    const std::string& member_id) {
  auto it = members_.find(member_id);
  if (it != members_.end()) {
    const SlotRef ref = it->second;
    Slot* slot = &Slots(ref.first)[ref.second];
    if (options_.clock() - slot->last_heartbeat <= options_.heartbeat_timeout) {
      return slot;
    }
    // Only the caller's own lease is checked here: every member heartbeats,
    // so scanning all of them per call would be O(members^2) work a
    // heartbeat interval. The others expire in Expire (the daemon's ticker)
    // and Join.
    Remove(ref, MembershipEvent::Kind::kExpired);
    MaybeFinishJob();
  }
  return absl::NotFoundError(
      absl::StrCat("member \"", member_id, "\" is not part of generation ",
                   generation_, " (unknown, left, or expired after ",
                   absl::FormatDuration(options_.heartbeat_timeout),
                   " without a heartbeat): join again"));
}

void Membership::RecordProgress(Slot* slot, int64_t step, int64_t epoch) {
  slot->last_heartbeat = options_.clock();
  slot->step = step;
  slot->epoch = epoch;
  global_step_ = std::max(global_step_, step);
  epoch_ = std::max(epoch_, epoch);
}

absl::StatusOr<v1::HeartbeatResponse> Membership::Heartbeat(
    const v1::HeartbeatRequest& r) {
  SHARDPS_RETURN_IF_ERROR(CheckProgress(r.step(), r.epoch()));
  absl::MutexLock lock(&mu_);
  SHARDPS_ASSIGN_OR_RETURN(Slot * slot, FindLive(r.member_id()));
  RecordProgress(slot, r.step(), r.epoch());
  slot->stalled = r.stalled().substr(0, kMaxStalledBytes);
  v1::HeartbeatResponse response;
  response.set_generation(generation_);
  response.set_complete(CompleteLocked());
  response.set_job_finished(job_finished_);
  return response;
}

absl::StatusOr<v1::ProgressResponse> Membership::ReportProgress(
    const v1::ProgressRequest& r) {
  SHARDPS_RETURN_IF_ERROR(CheckProgress(r.step(), r.epoch()));
  absl::MutexLock lock(&mu_);
  SHARDPS_ASSIGN_OR_RETURN(Slot * slot, FindLive(r.member_id()));
  RecordProgress(slot, r.step(), r.epoch());
  v1::ProgressResponse response;
  response.set_global_step(global_step_);
  response.set_epoch(epoch_);
  response.set_generation(generation_);
  return response;
}

absl::StatusOr<v1::LeaveResponse> Membership::Leave(const v1::LeaveRequest& r) {
  absl::MutexLock lock(&mu_);
  SHARDPS_RETURN_IF_ERROR(FindLive(r.member_id()).status());
  const SlotRef ref = members_.at(r.member_id());
  if (r.finished() && ref.first != v1::ROLE_WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("server ", ref.second,
                     " left with finished: only workers finish a job"));
  }
  if (r.finished()) {
    Slots(ref.first)[ref.second].finished = true;
    Remove(ref, MembershipEvent::Kind::kFinished);
  } else {
    Remove(ref, MembershipEvent::Kind::kLeft);
  }
  MaybeFinishJob();
  v1::LeaveResponse response;
  response.set_generation(generation_);
  return response;
}

void Membership::Remove(const SlotRef& ref, MembershipEvent::Kind kind) {
  Slot& slot = Slots(ref.first)[ref.second];
  members_.erase(slot.member_id);
  slot.member_id.clear();
  ++generation_;
  Record(kind, ref);
}

void Membership::MaybeFinishJob() {
  if (job_finished_) return;
  // Finished once training completed somewhere and nobody trains any more:
  // a rank whose worker died and was not replaced does not hold the job up.
  // A rank nobody held since this coordinator started may belong to a
  // worker that has not rejoined a restarted coordinator yet: it holds the
  // job up until it had a heartbeat timeout's time to come back.
  const bool settled = options_.clock() - start_ > options_.heartbeat_timeout;
  size_t finished = 0;
  for (const Slot& w : workers_) {
    if (w.alive()) return;
    if (w.finished) ++finished;
    const bool never_held = w.last_heartbeat == absl::InfinitePast();
    if (!w.finished && never_held && !settled) return;
  }
  if (finished == 0) return;
  job_finished_ = true;
  ++generation_;
  MembershipEvent e;
  e.kind = MembershipEvent::Kind::kJobFinished;
  e.generation = generation_;
  e.detail = finished == workers_.size()
                 ? absl::StrCat("all ", workers_.size(), " workers finished")
                 : absl::StrCat(finished, " of ", workers_.size(),
                                " workers finished; the others left the job");
  AddEvent(std::move(e));
}

int Membership::Expire() {
  absl::MutexLock lock(&mu_);
  return ExpireLocked();
}

int Membership::ExpireLocked() {
  const absl::Time now = options_.clock();
  int expired = 0;
  for (v1::Role role : {v1::ROLE_SERVER, v1::ROLE_WORKER}) {
    const std::vector<Slot>& slots = Slots(role);
    for (uint32_t i = 0; i < slots.size(); ++i) {
      if (slots[i].alive() &&
          now - slots[i].last_heartbeat > options_.heartbeat_timeout) {
        Remove(SlotRef(role, i), MembershipEvent::Kind::kExpired);
        ++expired;
      }
    }
  }
  if (!settled_ && now - start_ > options_.heartbeat_timeout) {
    settled_ = true;
    // Workers that never came back to a restarted coordinator of a running
    // job are gone: a new view lets the servers stop waiting for them.
    const bool unheld =
        std::any_of(workers_.begin(), workers_.end(), [](const Slot& w) {
          return !w.alive() && !w.finished &&
                 w.last_heartbeat == absl::InfinitePast();
        });
    if (unheld && global_step_ > 0) ++generation_;
  }
  MaybeFinishJob();
  return expired;
}

void Membership::Record(MembershipEvent::Kind kind, const SlotRef& ref) {
  MembershipEvent e;
  e.kind = kind;
  e.role = ref.first;
  e.index = ref.second;
  e.address = Slots(ref.first)[ref.second].address;
  e.generation = generation_;
  AddEvent(std::move(e));
}

void Membership::AddEvent(MembershipEvent e) {
  events_.push_back(std::move(e));
  // Nobody may be draining (tests, a stuck logger): keep memory bounded.
  if (events_.size() > kMaxPendingEvents) events_.pop_front();
}

bool Membership::CompleteLocked() const {
  // Each live member holds one slot and each slot at most one member: O(1)
  // for the heartbeats that report it.
  return members_.size() == servers_.size() + workers_.size();
}

v1::ClusterView Membership::ViewLocked() const {
  v1::ClusterView view;
  view.set_generation(generation_);
  view.set_job_id(options_.job_id);
  view.set_num_shards(options_.num_servers);
  view.set_num_workers(options_.num_workers);
  for (uint32_t i = 0; i < servers_.size(); ++i) {
    v1::ServerSlot* s = view.add_servers();
    s->set_shard_index(i);
    s->set_address(servers_[i].address);
    s->set_alive(servers_[i].alive());
  }
  for (uint32_t i = 0; i < workers_.size(); ++i) {
    v1::WorkerSlot* w = view.add_workers();
    w->set_rank(i);
    w->set_address(workers_[i].address);
    w->set_alive(workers_[i].alive());
    w->set_finished(workers_[i].finished);
    w->set_incarnation(workers_[i].incarnation);
  }
  view.set_complete(CompleteLocked());
  view.set_global_step(global_step_);
  view.set_epoch(epoch_);
  view.set_job_finished(job_finished_);
  view.set_coordinator_incarnation(options_.incarnation);
  view.set_rollback_id(rollback_id_);
  view.set_settled(settled_);
  view.set_rollback_step(rollback_step_);
  return view;
}

v1::ClusterView Membership::View() const {
  absl::MutexLock lock(&mu_);
  return ViewLocked();
}

uint64_t Membership::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

bool Membership::job_finished() const {
  absl::MutexLock lock(&mu_);
  return job_finished_;
}

v1::JobStatus Membership::Report() const {
  absl::MutexLock lock(&mu_);
  // Read under the lock, so no heartbeat recorded so far is in the future.
  const absl::Time now = options_.clock();
  v1::JobStatus status;
  *status.mutable_view() = ViewLocked();
  for (v1::Role role : {v1::ROLE_SERVER, v1::ROLE_WORKER}) {
    const std::vector<Slot>& slots = Slots(role);
    for (uint32_t i = 0; i < slots.size(); ++i) {
      v1::MemberStatus* m = status.add_members();
      m->set_role(role);
      m->set_index(i);
      m->set_address(slots[i].address);
      m->set_alive(slots[i].alive());
      m->set_heartbeat_age_ms(
          slots[i].last_heartbeat == absl::InfinitePast()
              ? -1
              : absl::ToInt64Milliseconds(now - slots[i].last_heartbeat));
      m->set_step(slots[i].step);
      m->set_epoch(slots[i].epoch);
      m->set_finished(slots[i].finished);
      if (slots[i].alive()) m->set_stalled(slots[i].stalled);
    }
  }
  status.set_heartbeat_timeout_ms(
      absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  status.set_uptime_ms(absl::ToInt64Milliseconds(now - start_));
  status.set_protocol_version(kCoordinatorProtocolVersion);
  return status;
}

std::optional<v1::ClusterView> Membership::AwaitViewAfter(
    uint64_t generation, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return generation_ != generation;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
    return std::nullopt;
  }
  return ViewLocked();
}

std::vector<MembershipEvent> Membership::AwaitEvents(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto pending = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !events_.empty();
  };
  mu_.AwaitWithDeadline(absl::Condition(&pending), deadline);
  std::vector<MembershipEvent> events(events_.begin(), events_.end());
  events_.clear();
  return events;
}

}  // namespace shardps::coordinator
