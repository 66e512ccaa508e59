#include "server/async_aggregator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/gradient_decode.h"
#include "server/server_metrics.h"

namespace shardps::server {

AsyncAggregator::Clocks::Clocks(Chunk* c, uint32_t num_workers) : chunk(c) {
  absl::MutexLock lock(&chunk->mu);
  gradient.resize(chunk->spec.num_elements);
  last_step.assign(num_workers, chunk->version - 1);
}

AsyncAggregator::AsyncAggregator(const AggregatorOptions& options,
                                 std::vector<Chunk*> chunks,
                                 const ChunkUpdater* updater,
                                 const RankTracker* ranks)
    : options_(options), updater_(updater), ranks_(ranks) {
  clocks_.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i] != nullptr) {
      clocks_[i] = std::make_unique<Clocks>(chunks[i], ranks->num_workers());
    }
  }
}

bool AsyncAggregator::StalenessAllows(const Clocks& clocks,
                                      int64_t step) const {
  if (options_.mode != v1::CONSISTENCY_SSP) return true;
  // A rank's clock is the number of steps it has pushed.
  const std::optional<int64_t> slowest = ranks_->SlowestClock(clocks.last_step);
  return !slowest.has_value() || *slowest + 1 >= step + 1 - options_.staleness;
}

void AsyncAggregator::ReleaseHeld(Clocks* clocks,
                                  PendingReplies* replies) const {
  std::vector<Waiter> still_held;
  for (Waiter& w : clocks->held) {
    if (!StalenessAllows(*clocks, w.step)) {
      still_held.push_back(std::move(w));
      continue;
    }
    replies->emplace_back(std::move(w.sink),
                          CurrentReply(*clocks->chunk, w.push_only));
  }
  clocks->held.swap(still_held);
}

absl::Status AsyncAggregator::Push(const PushArgs& args, Chunk* chunk,
                                   std::shared_ptr<ReplySink> sink) {
  if (args.second_phase || args.decision.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", args.rank, " pushes chunk ", chunk->spec.id, " (",
                     chunk->tensor_name,
                     ") as a two-phase step (global-norm clipping or "
                     "loss scaling), which needs a sync shard: this one is ",
                     ConsistencyName(options_.mode, options_.staleness)));
  }
  Clocks* clocks = clocks_[chunk->spec.id].get();
  PendingReplies replies;
  {
    absl::MutexLock lock(&clocks->chunk->mu);
    const int64_t last = clocks->last_step[args.rank];
    if (args.step != last && args.step != last + 1) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", args.step, " of chunk ", chunk->spec.id, " from rank ",
          args.rank, " is in the ", args.step < last ? "past" : "future",
          ": the last step applied for this rank is ", last));
    }
    if (options_.metrics != nullptr) {
      const int64_t newest =
          *std::max_element(clocks->last_step.begin(), clocks->last_step.end());
      options_.metrics->Staleness(std::max<int64_t>(0, newest - args.step));
    }
    if (args.step == last + 1 && args.no_gradient) {
      // Nothing to apply, but the rank's clock moves on as for a push.
      clocks->last_step[args.rank] = args.step;
    } else if (args.step == last + 1) {
      // Applied on arrival, on this thread, with the push's own
      // hyperparameters. (A push of `last` is a retry: already applied, it only
      // gets the current weights.)
      SHARDPS_RETURN_IF_ERROR(
          DecodeGradient(args.encoding, *args.payload,
                         {args.rank, &chunk->spec, chunk->tensor_name},
                         options_.allow_nonfinite, clocks->gradient.data()));
      clocks->last_step[args.rank] = args.step;
      updater_->Apply(clocks->chunk, clocks->gradient.data(), 1,
                      args.hyperparameters);
    }
    clocks->held.push_back(
        {args.rank, args.push_only, std::move(sink), args.step});
    ReleaseHeld(clocks, &replies);
  }
  updater_->DeliverAll(&replies);
  return absl::OkStatus();
}

int64_t AsyncAggregator::NextStep(uint32_t rank) const {
  // Steps are counted per rank: one past the last this rank pushed.
  int64_t next = -1;
  for (const auto& clocks : clocks_) {
    if (clocks == nullptr) continue;
    absl::MutexLock lock(&clocks->chunk->mu);
    const int64_t n = clocks->last_step[rank] + 1;
    if (next < 0 || n < next) next = n;
  }
  return std::max<int64_t>(next, 0);
}

int64_t AsyncAggregator::PrepareJoin(uint32_t rank, int64_t join_step) {
  for (const auto& clocks : clocks_) {
    if (clocks == nullptr) continue;
    absl::MutexLock lock(&clocks->chunk->mu);
    clocks->last_step[rank] = std::max(clocks->last_step[rank], join_step - 1);
  }
  return -1;  // nothing is decided for a rank before it pushes
}

void AsyncAggregator::MembershipChanged() {
  for (const auto& clocks : clocks_) {
    if (clocks == nullptr) continue;
    PendingReplies replies;
    {
      absl::MutexLock lock(&clocks->chunk->mu);
      ReleaseHeld(clocks.get(), &replies);
    }
    updater_->DeliverAll(&replies);
  }
}

void AsyncAggregator::Reset(Chunk* chunk,
                            std::vector<std::shared_ptr<ReplySink>>* failed) {
  Clocks* clocks = clocks_[chunk->spec.id].get();
  clocks->chunk->mu.AssertHeld();
  // Every rank's clock restarts from the checkpoint's step.
  clocks->last_step.assign(clocks->last_step.size(),
                           clocks->chunk->version - 1);
  for (Waiter& w : clocks->held) failed->push_back(std::move(w.sink));
  clocks->held.clear();
}

}  // namespace shardps::server
