// The open collectives of one job (rpc Collective in coordinator.proto):
// each rank's call waits until every participant (the workers alive when
// the collective opened) called the same sequence number; then all are
// answered with the result reduced in rank order, and the collective is
// forgotten. A participant that leaves before calling, or a wait that runs
// out, fails the collective for everyone at once. Memory: at most kMaxOpen
// collectives of at most one kMaxCollectiveBytes contribution per
// participant, and the outcome of the last kRemembered.
//
// Threads: Call runs on gRPC's callback threads, DropDeparted and
// ExpireWaits on the service's notifier thread. mu_ guards every field;
// answers are computed and sent outside it (an answer finishes a reactor).
#ifndef SHARDPS_COORDINATOR_COLLECTIVES_H_
#define SHARDPS_COORDINATOR_COLLECTIVES_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardps/v1/coordinator.pb.h"

namespace shardps::coordinator {

// Called exactly once per call, with its result or its error.
using CollectiveAnswer =
    std::function<void(absl::StatusOr<v1::CollectiveResponse>)>;

class Collectives {
 public:
  static constexpr size_t kMaxOpen = 16;
  static constexpr size_t kRemembered = 64;

  // Adds a call to its collective (opening it with the ranks alive in
  // `view` when it is the sequence's first). `answer` runs on this thread
  // when the call is refused or completes the collective, later otherwise.
  // The codes of rpc Collective; a refused call changes nothing. `now`:
  // real time, the start of the call's timeout.
  void Call(const v1::CollectiveRequest& request, const v1::ClusterView& view,
            absl::Time now, CollectiveAnswer answer) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails (ABORTED) every open collective that waits for a participant
  // that `view` shows gone or held by another process. Also remembers
  // `view`, so that a call made with an older one sees the departures.
  void DropDeparted(const v1::ClusterView& view) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails (DEADLINE_EXCEEDED) every open collective with a call whose
  // timeout ran out before `now`.
  void ExpireWaits(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails every open collective, and every later call, with UNAVAILABLE.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  size_t open() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Caller {
    uint64_t incarnation = 0;
    bool called = false;
    std::string values;
    CollectiveAnswer answer;
  };
  struct Open {
    v1::CollectiveRequest first;         // the opening call, values cleared
    uint32_t src_rank = 0;               // BROADCAST's resolved src
    std::map<uint32_t, Caller> callers;  // participants, ascending ranks
    absl::Time deadline = absl::InfiniteFuture();  // the earliest call's
  };
  using Answers = std::vector<
      std::pair<CollectiveAnswer, absl::StatusOr<v1::CollectiveResponse>>>;

  // The error of a call that cannot join anything open; OK to go on.
  absl::Status CheckCaller(const v1::CollectiveRequest& request,
                           const v1::ClusterView& view) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens sequence request.sequence() over the ranks alive in `view`.
  absl::StatusOr<Open*> OpenFor(const v1::CollectiveRequest& request,
                                const v1::ClusterView& view)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the collective out of open_, fails every call it holds with
  // `status` and remembers that.
  void FailLocked(uint64_t sequence, const absl::Status& status,
                  Answers* answers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remember(uint64_t sequence, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The result of a complete collective, for every caller (outside mu_).
  static Answers Complete(Open open);
  // "ranks 1, 3" of `open`'s participants that called (or not).
  static std::string Ranks(const Open& open, bool called);

  mutable absl::Mutex mu_;
  std::map<uint64_t, Open> open_ ABSL_GUARDED_BY(mu_);
  // (sequence, outcome) of the last kRemembered collectives, oldest first.
  std::deque<std::pair<uint64_t, absl::Status>> finished_ ABSL_GUARDED_BY(mu_);
  // The newest view DropDeparted saw.
  v1::ClusterView view_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_COLLECTIVES_H_
