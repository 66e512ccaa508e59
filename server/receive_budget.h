// A shard's receive budget (shardps-server --max_inflight_mib): the bytes
// of gradients it holds beyond its owned state, whatever the number of
// workers. Two things hold such bytes: a push being read (its message in
// gRPC's buffers: up to the largest chunk per stream reading) and an early
// gradient (sync: one that came before the ranks below it, decoded, kept
// until they are summed). A stream asks the budget before each read; while
// the budget is spent it is parked, reading nothing, and gRPC's flow
// control stops its sender (a parked stream keeps at most the server's
// stream lookahead in gRPC's buffers).
//
// Why it cannot deadlock. A stream whose rank some chunk's rank-ordered
// sum needs next (its fold) may always read, budget or not. Take, among
// the chunks whose step is not complete, one whose fold m is the least.
// Rank m's stream carrying that chunk holds no early gradient: one would
// be of a chunk whose fold is below m, which is not complete (else its
// gradient would have been summed), against m being least. A worker sends
// a step's pushes in order and none of the next step before every reply of
// this one, so what that stream reads next is that chunk's push or another
// that is summed at once or refused: the least fold always advances. The
// exempt reads exceed the budget by at most one chunk per distinct fold,
// i.e. per owned chunk, whatever the number of workers.
//
// Thread-safe; a parked stream is woken (its callback run) outside the
// budget's lock.
#ifndef SHARDPS_SERVER_RECEIVE_BUDGET_H_
#define SHARDPS_SERVER_RECEIVE_BUDGET_H_

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardps::server {

class ReceiveBudget {
 public:
  // `bytes` 0: no limit (every read is allowed at once, nothing counted).
  explicit ReceiveBudget(int64_t bytes) : limit_(bytes) {}

  int64_t limit() const { return limit_; }

  // A parked reader: Wake runs once when it may read (or the budget is
  // being torn down), from whichever thread freed the budget.
  struct Ticket {
    std::optional<uint32_t> rank;  // none: not known yet (always allowed)
    int64_t bytes = 0;
    std::function<void()> wake;
  };

  // Takes `bytes` for a read by a stream of `rank` (none: its first read,
  // rank not known yet) if the budget allows it: it is unspent enough,
  // nothing else is in use, or the rank is one some chunk's sum needs next.
  // Else parks `wake` and returns false; the caller reads nothing until
  // `wake` runs (the bytes are then taken for it).
  bool TryRead(std::optional<uint32_t> rank, int64_t bytes,
               std::function<void()> wake);
  // Takes bytes for an early gradient (always: it is already received).
  void Take(int64_t bytes);
  // Gives back bytes taken by TryRead or Take, and runs the wakes of the
  // parked reads that now fit. Call it holding no lock of the store's.
  void Free(int64_t bytes);
  // A chunk's next rank to sum moved from `from` to `to` (none: the chunk
  // was not counted, or is complete). May be called under a chunk's lock:
  // the reads it admits wake at the next RunAdmitted or Free.
  void MoveFold(std::optional<uint32_t> from, std::optional<uint32_t> to);
  // Runs the wakes MoveFold admitted. Call it holding no lock of the
  // store's.
  void RunAdmitted();

  // For tests and GetStatus.
  int64_t in_use() const;
  int64_t peak() const;
  // Reads that were parked, in all.
  int64_t waited() const;

 private:
  bool Allows(const Ticket& t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves every parked ticket the budget now allows to admitted_, its
  // bytes taken.
  void Admit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t waited_ ABSL_GUARDED_BY(mu_) = 0;
  // By rank: the chunks whose fold is that rank.
  std::vector<int64_t> folds_ ABSL_GUARDED_BY(mu_);
  std::list<Ticket> parked_ ABSL_GUARDED_BY(mu_);
  // Admitted, not yet woken.
  std::vector<std::function<void()>> admitted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_RECEIVE_BUDGET_H_
