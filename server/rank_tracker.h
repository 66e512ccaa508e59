// A RankTracker knows which worker ranks a shard waits for and which worker
// processes may push: it follows the coordinator's views and the join steps
// that workers declare. Thread-safe; the aggregation policies ask it whether a
// step is complete, so its lock is taken after a chunk's, never before.
#ifndef SHARDPS_SERVER_RANK_TRACKER_H_
#define SHARDPS_SERVER_RANK_TRACKER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "shardps/v1/coordinator.pb.h"

namespace shardps::server {

class RankTracker {
 public:
  RankTracker(uint32_t shard_index, uint32_t num_workers);

  uint32_t num_workers() const { return num_workers_; }

  // Follows the coordinator's membership (a newer `view` than the last one
  // applied; older ones are ignored). A worker rank that is no longer alive
  // stops being waited for. A rank held by a new process (another
  // incarnation) is not waited for until that process declares a join step.
  // Before the first view every rank is waited for (a static job, or the
  // first workers still arriving). Returns one line per change, for the
  // log; *released is set when a rank that was waited for no longer is.
  std::vector<std::string> ApplyView(const v1::ClusterView& view,
                                     bool* released) ABSL_LOCKS_EXCLUDED(mu_);

  // OK when a request of `rank` from `incarnation` may go on; else the
  // status that refuses it (UNAVAILABLE: this shard has not seen the
  // process join yet; ABORTED: the process is no longer part of the job).
  // REQUIRES: rank < num_workers().
  absl::Status CheckIncarnation(uint32_t rank, uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // CheckIncarnation, and a push of `step` by a rank that is waited for:
  // FAILED_PRECONDITION before a new process declared its join step,
  // OUT_OF_RANGE before that step.
  absl::Status CheckPush(uint32_t rank, uint64_t incarnation,
                         int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);

  // Whether sync step `step` waits for `rank`.
  bool WaitsFor(uint32_t rank, int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);

  // Whether every rank that sync step `step` waits for is marked in
  // `contributed` (indexed by rank).
  bool Complete(const std::vector<bool>& contributed, int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The ranks sync step `step` waits for, ascending.
  std::vector<uint32_t> ActiveRanks(int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ssp: the smallest clock (`clocks`, indexed by rank) of the ranks in the
  // job; ranks that left or have not joined yet hold nobody back. Nothing
  // when no rank is in the job.
  std::optional<int64_t> SlowestClock(const std::vector<int64_t>& clocks) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Where one rank stands, for DeclareResponse.
  struct Standing {
    bool must_join = false;  // a new process that has not declared its join
    bool active = false;     // waited for from `from_step` on
    int64_t from_step = 0;
  };
  Standing standing(uint32_t rank) const ABSL_LOCKS_EXCLUDED(mu_);

  // A join (DeclareRequest.join): `rank` is waited for from `join_step` on.
  // FAILED_PRECONDITION in a static job; CheckIncarnation's codes. On OK the
  // caller checks that no step at or after `join_step` is already decided,
  // and otherwise calls UndoJoin with the returned token.
  struct JoinToken {
    uint32_t rank = 0;
    int64_t join_step = 0;
    uint64_t incarnation = 0;
    int kind = 0;  // the rank's state before the join
    int64_t from_step = 0;
  };
  absl::StatusOr<JoinToken> BeginJoin(uint32_t rank, uint64_t incarnation,
                                      int64_t join_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Restores the rank's state before the join, unless a view changed it
  // meanwhile.
  void UndoJoin(const JoinToken& token) ABSL_LOCKS_EXCLUDED(mu_);

  // The generation of the last view applied; 0 in a static job.
  uint64_t view_generation() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct RankState {
    enum class Kind {
      kActive,   // waited for from `from_step` on
      kPending,  // a new process holds the rank; not waited for yet
      kGone,     // left or expired; not waited for
    };
    Kind kind = Kind::kActive;
    bool seen = false;  // a view showed the rank alive
    uint64_t incarnation = 0;
    int64_t from_step = 0;
    uint64_t changed_generation = 0;  // of the view that set `kind`
    bool WaitsAt(int64_t step) const {
      return kind == Kind::kActive && step >= from_step;
    }
  };
  absl::Status CheckIncarnationLocked(uint32_t rank, uint64_t incarnation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t shard_index_;
  const uint32_t num_workers_;
  mutable absl::Mutex mu_;
  bool coordinated_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t view_generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t coordinator_incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_RANK_TRACKER_H_
