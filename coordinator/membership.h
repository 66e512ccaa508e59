// Membership of one training job, the logic behind the Coordinator service:
// which server holds which shard index, which worker ranks are taken,
// heartbeats and expiry, the generation and the job's progress. Thread-safe;
// time comes from a clock function so that tests drive expiry.
#ifndef SHARDPS_COORDINATOR_MEMBERSHIP_H_
#define SHARDPS_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardps/v1/coordinator.pb.h"

namespace shardps::coordinator {

struct MembershipOptions {
  std::string job_id = "shardps";
  uint32_t num_servers = 1;  // shard indices [0, num_servers)
  uint32_t num_workers = 1;  // ranks [0, num_workers)
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  // Source of "now" for heartbeats and expiry; called with the Membership's
  // lock held, so it must not call back into it. Waits (AwaitViewAfter,
  // AwaitEvents) use real time whatever this is.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  // Mixed into member ids, so that ids from an earlier coordinator process
  // are not mistaken for this one's. The daemon passes a random number.
  uint64_t incarnation = 0;
};

// One membership change, for the daemon's log.
struct MembershipEvent {
  enum class Kind {
    kJoined,
    kReplaced,  // joined from a live member's address: a restart
    kLeft,
    kExpired,
    kRejected,     // a join that was refused; nothing changed
    kFinished,     // a worker left having completed its training
    kJobFinished,  // every worker has finished; role and index are unset
    kRollback,     // a restarted server rolls the job back (detail: how)
  };
  Kind kind = Kind::kJoined;
  v1::Role role = v1::ROLE_UNSPECIFIED;
  uint32_t index = 0;
  std::string address;
  uint64_t generation = 0;  // after the change
  // kRejected: what was asked and why it failed; kJobFinished: a summary.
  std::string detail;
};

// "server 1 (127.0.0.1:5001) joined; generation 3".
std::string DescribeEvent(const MembershipEvent& event);

class Membership {
 public:
  // InvalidArgument for an empty job id, no servers or workers (or more
  // than 65536 of either), or a non-positive heartbeat timeout.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(
      MembershipOptions options);

  // Adds a member and bumps the generation; the rules and error codes are
  // those of rpc Join in coordinator.proto. Expires stale members first, so
  // their indices are free. A rejected join changes nothing but is recorded
  // as a kRejected event.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Renews the member's lease and records its progress. NotFound for an
  // unknown or expired member id (it must join again). O(1): other
  // members' leases are Expire's to check.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the membership and bumps the generation. NotFound as Heartbeat.
  // With request.finished (workers only, else InvalidArgument) the rank
  // counts as finished; the leave that finishes the last rank also finishes
  // the job, in one more generation.
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Heartbeat plus progress. InvalidArgument for a negative step or epoch.
  absl::StatusOr<v1::ProgressResponse> ReportProgress(
      const v1::ProgressRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // Members whose last heartbeat is more than the timeout before the clock's
  // now leave; the generation bumps once per expired member. Returns how many.
  int Expire() ABSL_LOCKS_EXCLUDED(mu_);

  v1::ClusterView View() const ABSL_LOCKS_EXCLUDED(mu_);
  v1::JobStatus Report() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every worker rank has finished (ClusterView.job_finished).
  bool job_finished() const ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until the generation differs from `generation` and returns the view
  // then, or nullopt when `deadline` (real time) passes first.
  std::optional<v1::ClusterView> AwaitViewAfter(uint64_t generation,
                                                absl::Time deadline) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until an event is pending or `deadline` (real time) passes and
  // returns (and forgets) the pending events, oldest first. At most
  // kMaxPendingEvents are kept; older ones are dropped.
  std::vector<MembershipEvent> AwaitEvents(absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr size_t kMaxPendingEvents = 4096;
  // HeartbeatRequest.stalled is cut to this length.
  static constexpr size_t kMaxStalledBytes = 4096;

 private:
  // One shard index or rank.
  struct Slot {
    std::string member_id;  // empty: vacant
    std::string address;    // of the holder, or of the last holder
    absl::Time last_heartbeat = absl::InfinitePast();  // of the last holder
    int64_t step = 0;
    int64_t epoch = 0;
    bool finished = false;     // workers: the last holder left finished
    uint64_t incarnation = 0;  // JoinRequest.incarnation of the holder
    std::string stalled;       // servers: HeartbeatRequest.stalled
    bool alive() const { return !member_id.empty(); }
  };
  using SlotRef = std::pair<v1::Role, uint32_t>;

  explicit Membership(MembershipOptions options);

  absl::StatusOr<v1::JoinResponse> JoinLocked(const v1::JoinRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateJoin(const v1::JoinRequest& request) const;
  // The index a valid join gets, or why it cannot have one.
  absl::StatusOr<uint32_t> PickIndex(const v1::JoinRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot of a live member; NotFound if none, or if the member's own
  // lease ran out (it expires here; other members are left to Expire).
  absl::StatusOr<Slot*> FindLive(const std::string& member_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordProgress(Slot* slot, int64_t step, int64_t epoch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Vacates the slot of `member_id`, bumps the generation, records `kind`.
  void Remove(const SlotRef& ref, MembershipEvent::Kind kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the job finished (one more generation) once a worker finished and
  // none is alive.
  void MaybeFinishJob() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Record(MembershipEvent::Kind kind, const SlotRef& ref)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddEvent(MembershipEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::vector<Slot>& Slots(v1::Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return role == v1::ROLE_SERVER ? servers_ : workers_;
  }
  const std::vector<Slot>& Slots(v1::Role role) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return role == v1::ROLE_SERVER ? servers_ : workers_;
  }
  bool CompleteLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ClusterView ViewLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction; read without the lock.
  const MembershipOptions options_;
  const absl::Time start_;

  mutable absl::Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_member_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<Slot> servers_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> workers_ ABSL_GUARDED_BY(mu_);
  // Live member id -> its slot.
  absl::flat_hash_map<std::string, SlotRef> members_ ABSL_GUARDED_BY(mu_);
  int64_t global_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool job_finished_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t rollback_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool settled_ ABSL_GUARDED_BY(mu_) = false;
  int64_t rollback_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<MembershipEvent> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_MEMBERSHIP_H_
