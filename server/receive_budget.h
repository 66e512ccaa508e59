// A shard's receive budget (shardps-server --max_inflight_mib): the bytes
// of gradients it holds beyond its owned state, whatever the number of
// workers, as far as the shard's own code holds them (gRPC's buffers of a
// parked stream, up to its HTTP/2 window, are not counted). Two things hold
// such bytes: a push being read (its message in gRPC's buffers: up to the
// largest chunk per stream reading) and an early gradient (sync: one that came
// before the ranks below it, kept until they are summed: FP32, BF16 and FP16
// as the slices it arrived in, counted as its wire bytes; otherwise
// decoded). A stream asks the budget before each read; while the budget is
// spent it is parked, reading nothing, and gRPC's flow control stops its
// sender (a parked stream keeps at most the server's stream lookahead in
// gRPC's buffers).
//
// Why it cannot deadlock. Every chunk whose step is not complete has a
// fold: the rank its rank-ordered sum needs next. Order them by (step,
// fold) and take the least, chunk c at step t with fold m: the streams of
// rank m that may still push a gradient of step t may always read, budget
// or not (a stream whose last push said last_of_step may not: its next
// push is of a later step).
// Rank m's stream carrying c holds no early gradient: one of step t would
// be of a chunk whose fold is below m, against (t, m) being least, and one
// of a later step cannot exist, as a worker pushes nothing of step t + 1
// before every reply of step t, c's included. So what that stream reads
// next is c's push, or another that is summed at once or refused: the
// least (step, fold) always advances.
//
// Why it is bounded whatever the number of workers. A read past the budget
// is admitted only while its stream's next push is of step t, and every
// chunk of step t then has fold >= m; as rank m has not pushed the chunks
// still at m, its next push of step t is one of them and is summed at
// once. So no read past the budget ends as an early gradient, and those in
// flight at once are at most one per stream of the least rank (a shard's
// lanes per worker), each of the largest chunk, besides, for a moment, the
// reads whose pushes gRPC's threads are still taking (a read's bytes are
// given back once its push is summed or held). Without last_of_step (a
// stream's first read, a worker that does not say) a stream may read past
// the budget while its rank is least and then take the next step's push
// early: at most one such gradient per stream.
// Thread-safe; a parked stream is woken (its callback run) outside the
// budget's lock.
#ifndef SHARDPS_SERVER_RECEIVE_BUDGET_H_
#define SHARDPS_SERVER_RECEIVE_BUDGET_H_

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
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
    // The least step the stream's next push may be of (none: not known).
    std::optional<int64_t> next_step;
    int64_t bytes = 0;
    std::function<void()> wake;
  };

  // Takes `bytes` for a read by a stream of `rank` (none: its first read,
  // rank not known yet) whose next push is of step `next_step` or later
  // (none: not known) if the budget allows it: it is unspent enough,
  // nothing else is in use, or the rank is the least that some chunk's sum
  // needs next and the stream may still push that chunk's step.
  // Else parks `wake` and returns false; the caller reads nothing until
  // `wake` runs (the bytes are then taken for it).
  bool TryRead(std::optional<uint32_t> rank, int64_t bytes,
               std::function<void()> wake,
               std::optional<int64_t> next_step = std::nullopt);
  // Takes bytes for an early gradient (always: it is already received).
  void Take(int64_t bytes);
  // Gives back bytes taken by TryRead or Take, and runs the wakes of the
  // parked reads that now fit. Call it holding no lock of the store's.
  void Free(int64_t bytes);
  // Where a chunk's sum stands: its step and the rank it needs next.
  using Fold = std::pair<int64_t, uint32_t>;
  // A chunk's fold moved from `from` to `to` (none: the chunk was not
  // counted, or is no longer). A chunk whose step is complete counts at the
  // next step's rank 0 at once, while its update runs: left out, a later
  // rank would read past the budget and then push it early. May be called
  // under a chunk's lock:
  // the reads it admits wake at the next RunAdmitted or Free.
  void MoveFold(std::optional<Fold> from, std::optional<Fold> to);
  // Runs the wakes MoveFold admitted. Call it holding no lock of the
  // store's.
  void RunAdmitted();

  // What the budget holds now, the most it held, and how many reads it
  // parked in all (for tests and the shard's exit log).
  struct Usage {
    int64_t in_use = 0;
    int64_t peak = 0;
    int64_t waited = 0;
  };
  Usage usage() const;

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
  // By fold: how many chunks stand there; the least is the rank that may
  // read past the budget.
  absl::btree_map<Fold, int64_t> folds_ ABSL_GUARDED_BY(mu_);
  std::list<Ticket> parked_ ABSL_GUARDED_BY(mu_);
  // Admitted, not yet woken.
  std::vector<std::function<void()>> admitted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_RECEIVE_BUDGET_H_
