#include "server/sync_aggregator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/status.h"
#include "server/gradient_decode.h"
#include "server/optimizer.h"
#include "server/server_metrics.h"

namespace shardps::server {
namespace {

// Updates of chunks up to this size run on the thread that completed the
// step; larger ones go to the update pool, in parallel across chunks.
constexpr int64_t kInlineApplyBytes = 256 << 10;

}  // namespace

SyncAggregator::Step::Step(Chunk* c, uint32_t num_workers) : chunk(c) {
  absl::MutexLock lock(&chunk->mu);
  sum.resize(chunk->spec.num_elements);
  early.resize(num_workers);
  contributed.assign(num_workers, false);
}

SyncAggregator::SyncAggregator(const AggregatorOptions& options,
                               std::vector<Chunk*> chunks,
                               const ChunkUpdater* updater,
                               const RankTracker* ranks, ThreadPool* pool)
    : options_(options), updater_(updater), ranks_(ranks), pool_(pool) {
  steps_.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i] != nullptr) {
      steps_[i] = std::make_unique<Step>(chunks[i], ranks->num_workers());
      absl::MutexLock lock(&chunks[i]->mu);
      FoldMoved(steps_[i].get());
    }
  }
}

bool SyncAggregator::Complete(const Step& step) const {
  return step.num_contributed > 0 && step.fold == step.contributed.size();
}

void SyncAggregator::AddToSum(Step* step, const float* gradient) {
  const int64_t n = step->chunk->spec.num_elements;
  float* __restrict sum = step->sum.data();
  if (step->num_summed == 0) {
    if (gradient == nullptr) {
      std::fill(sum, sum + n, 0.0f);
    } else {
      std::copy(gradient, gradient + n, sum);
    }
  } else if (gradient == nullptr) {
    // Adding the zeros, not skipping them: -0 + 0 is +0, as it always was.
    for (int64_t i = 0; i < n; ++i) sum[i] += 0.0f;
  } else {
    const float* __restrict g = gradient;
    for (int64_t i = 0; i < n; ++i) sum[i] += g[i];
  }
  ++step->num_summed;
}

void SyncAggregator::AddEarly(Step* step, const Early& early) {
  if (early.payload == nullptr) {
    AddToSum(step, early.gradient.get());
    return;
  }
  // Checked on arrival (CheckGradient): its length and values are fine.
  DecodeCheckedPayload(early.encoding, *early.payload,
                       /*add=*/step->num_summed > 0, step->sum.data());
  ++step->num_summed;
}

void SyncAggregator::FoldMoved(Step* step) const {
  if (options_.budget == nullptr) return;
  // A complete step counts as the next step's, waiting for rank 0, from
  // the moment it completes: its update may still be running, and a chunk
  // the budget did not count would let a rank read past it as if no sum
  // needed rank 0 (its push would then come early, at the next step).
  const ReceiveBudget::Fold now =
      step->fold < step->contributed.size()
          ? ReceiveBudget::Fold(step->chunk->version, step->fold)
          : ReceiveBudget::Fold(step->chunk->version + 1, 0);
  options_.budget->MoveFold(step->counted_at, now);
  step->counted_at = now;
}

void SyncAggregator::Fold(
    Step* step, std::vector<std::shared_ptr<ReplySink>>* released) const {
  const int64_t version = step->chunk->version;
  while (step->fold < step->contributed.size()) {
    const uint32_t r = step->fold;
    if (step->contributed[r]) {
      // Summed on arrival, or early and waiting for this moment.
      if (std::unique_ptr<Early> early = std::move(step->early[r])) {
        AddEarly(step, *early);
        released->push_back(std::move(early->reader));
      }
    } else if (ranks_->WaitsFor(r, version)) {
      break;
    }
    ++step->fold;
  }
  FoldMoved(step);
}

absl::Status SyncAggregator::CheckHyperparameters(const Step& step,
                                                  const PushArgs& args) const {
  if (step.num_contributed == 0) return absl::OkStatus();
  // Bitwise: two workers computing "the same" value differently must be
  // told.
  const std::optional<HyperparameterDifference> d =
      FirstDifference(step.hyperparameters, args.hyperparameters);
  if (!d.has_value()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "rank ", args.rank, " pushes chunk ", step.chunk->spec.id, " (",
      step.chunk->tensor_name, ") of step ", args.step, " with ", d->field, " ",
      d->b, ", but the step's first push used ", d->a,
      ": every worker of a step must use the same ", d->field));
}

ChunkReply SyncAggregator::RetryReply(const Step& step, bool push_only,
                                      bool holds) const {
  const bool held = holds && step.applied_speculation;
  ChunkReply reply = CurrentReply(*step.chunk, push_only || held);
  reply.speculative = held;
  reply.decision = step.applied;
  // A worker that lost the sealed step's reply needs the chunk's part of
  // the norm too.
  if (step.applied.has_value()) {
    reply.sum_of_squares = step.applied_sum_of_squares;
  }
  return reply;
}

void SyncAggregator::Clear(Step* step) const {
  step->fold = 0;
  FoldMoved(step);
  step->num_summed = 0;
  for (std::unique_ptr<Early>& early : step->early) early.reset();
  step->contributed.assign(step->contributed.size(), false);
  step->num_contributed = 0;
  step->num_with_gradient = 0;
  step->hyperparameters = {};
  step->apply_scheduled = false;
  step->second_phase = false;
  step->loss_scale.reset();
  step->sealed = false;
  step->decided.reset();
  step->speculate = false;
  step->speculated = false;
}

absl::Status SyncAggregator::Contribute(
    const PushArgs& args, Step* step, const std::shared_ptr<ReplySink>& sink) {
  Chunk* chunk = step->chunk;
  if (args.rank < step->fold) {
    // Not waited for when the sum went past it (it left the job meanwhile):
    // the step is decided without it.
    return absl::AbortedError(absl::StrCat(
        "rank ", args.rank, " pushes chunk ", chunk->spec.id, " (",
        chunk->tensor_name, ") of step ", args.step,
        " after the step went on without it (the rank left the job)"));
  }
  // Nothing is marked before the gradient decoded cleanly, so a rejected
  // push leaves no trace (the sum is scratch while num_summed is 0).
  const GradientOrigin origin{args.rank, &chunk->spec, chunk->tensor_name};
  const int64_t n = chunk->spec.num_elements;
  // Under loss scaling an overflow is expected: it makes the step's norm
  // non-finite, and the workers skip the step.
  const bool allow_nonfinite =
      options_.allow_nonfinite || args.loss_scale.has_value();
  if (args.rank == step->fold) {
    // Every rank below is summed: add this one now.
    if (args.no_gradient) {
      AddToSum(step, nullptr);
    } else if (step->num_summed == 0) {
      SHARDPS_RETURN_IF_ERROR(DecodeGradient(args.encoding, *args.payload,
                                             origin, allow_nonfinite,
                                             step->sum.data()));
      ++step->num_summed;
    } else {
      // Decoded straight into the sum (nothing added when refused).
      SHARDPS_RETURN_IF_ERROR(AddGradient(args.encoding, *args.payload, origin,
                                          allow_nonfinite, step->sum.data()));
      ++step->num_summed;
    }
  } else {
    // A rank below has not pushed yet: keep the gradient and stop reading
    // this stream until it is summed.
    auto early = std::make_unique<Early>();
    int64_t held = 0;
    if (!args.no_gradient && DecodesInPieces(args.encoding) &&
        (early->payload = args.payload->Retain()) != nullptr) {
      // Kept as it came (the slices it arrived in, no copy), checked now.
      SHARDPS_RETURN_IF_ERROR(CheckGradient(args.encoding, *early->payload,
                                            origin, allow_nonfinite));
      early->encoding = args.encoding;
      held = static_cast<int64_t>(early->payload->size());
    } else if (!args.no_gradient) {
      early->gradient.reset(new float[n]);
      SHARDPS_RETURN_IF_ERROR(DecodeGradient(args.encoding, *args.payload,
                                             origin, allow_nonfinite,
                                             early->gradient.get()));
      held = n * int64_t{4};
    }
    early->reader = sink;
    sink->Hold(held);
    step->early[args.rank] = std::move(early);
  }
  if (!args.no_gradient) ++step->num_with_gradient;
  step->contributed[args.rank] = true;
  if (step->num_contributed == 0) {
    step->first_contribution = absl::Now();
    step->hyperparameters = args.hyperparameters;
    step->second_phase = args.second_phase;
    step->loss_scale = args.loss_scale;
  }
  ++step->num_contributed;
  if (args.speculative_weights) step->speculate = true;
  return absl::OkStatus();
}

absl::Status SyncAggregator::Push(const PushArgs& args, Chunk* chunk,
                                  std::shared_ptr<ReplySink> sink) {
  Step* step = steps_[chunk->spec.id].get();
  if (args.decision.has_value()) return Decide(args, step, std::move(sink));
  bool ready = false;
  std::vector<std::shared_ptr<ReplySink>> released;
  absl::Status status;
  {
    absl::ReleasableMutexLock lock(&step->chunk->mu);
    if (args.step == step->chunk->version - 1) {
      // The reply to this push was lost: its gradient is already in the
      // weights. Answer with them and apply nothing.
      ChunkReply reply = RetryReply(*step, args.push_only);
      lock.Release();
      updater_->Deliver(sink.get(), std::move(reply));
      return absl::OkStatus();
    }
    if (args.step != step->chunk->version) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", args.step, " of chunk ", chunk->spec.id, " is in the ",
          args.step < step->chunk->version ? "past" : "future",
          ": the chunk is at step ", step->chunk->version));
    }
    SHARDPS_RETURN_IF_ERROR(CheckHyperparameters(*step, args));
    SHARDPS_RETURN_IF_ERROR(CheckPhases(*step, args));
    if (step->sealed && step->contributed[args.rank]) {
      // The reply to this push of a sealed step was lost: its sum of
      // squares again.
      ChunkReply reply = SealedReply(*step, args.speculative_weights);
      lock.Release();
      updater_->Deliver(sink.get(), std::move(reply));
      return absl::OkStatus();
    }
    if (!step->contributed[args.rank]) {
      Fold(step, &released);  // past ranks below that stopped being waited for
      status = Contribute(args, step, sink);
      if (status.ok()) Fold(step, &released);
      // Even when refused: the first Fold may have completed the step.
      ready = !step->apply_scheduled && Complete(*step);
      if (ready) step->apply_scheduled = true;
    }
    // A duplicate of a pending push (a retry while the step is still open)
    // only adds a waiter.
    if (status.ok()) {
      step->waiters.push_back({args.rank, args.push_only, std::move(sink), 0,
                               args.speculative_weights});
    }
  }
  // Outside the lock: a released stream may read (and push) at once.
  for (const std::shared_ptr<ReplySink>& reader : released) reader->Release();
  WakeAdmitted();
  if (ready) ScheduleApply(step);
  return status;
}

void SyncAggregator::ScheduleApply(Step* step) {
  if (options_.inline_updates ||
      step->chunk->spec.bytes() <= kInlineApplyBytes) {
    // A small chunk: updating it here costs less than a thread hop.
    Apply(step);
  } else {
    pool_->Schedule([this, step] { Apply(step); });
  }
}

void SyncAggregator::Apply(Step* step) {
  PendingReplies replies;
  {
    absl::MutexLock lock(&step->chunk->mu);
    // A reset or a join between scheduling and now: the step is not
    // complete any more; the push that completes it schedules again.
    if (!Complete(*step)) {
      step->apply_scheduled = false;
      return;
    }
    if (step->second_phase && !step->decided.has_value()) {
      // Complete, but the update needs the whole step's norm first.
      Seal(step, &replies);
    } else {
      Update(step, &replies);
    }
  }
  // Delivered outside the lock: sinks start gRPC writes.
  updater_->DeliverAll(&replies);
  WakeAdmitted();
}

void SyncAggregator::Update(Step* step, PendingReplies* replies) const {
  // A copy: the thread-safety analysis cannot follow a reference to it.
  const std::optional<StepDecision> decided = step->decided;
  // The speculative update is this decision's, bitwise: the same sum,
  // optimizer state and version, and a coefficient of exactly 1.
  const bool keep =
      step->speculated && decided.has_value() && *decided == StepDecision{};
  if (step->speculated && !keep) updater_->CountRecomputed();
  if (keep) {
    updater_->Commit(step->chunk, &step->speculative_weights,
                     &step->speculative_slots);
  } else if (decided.has_value() && decided->skip) {
    // Every shard skips the whole step (a non-finite norm under loss
    // scaling), as torch's GradScaler skips optimizer.step().
    updater_->Skip(step->chunk);
  } else if (step->num_with_gradient == 0) {
    // No rank had a gradient: leave weights and optimizer state alone,
    // as torch skips a parameter whose grad is None, but still advance
    // the version so the step completes for everyone.
    updater_->Skip(step->chunk);
  } else {
    // The sum is in rank order, so the weights are bitwise deterministic.
    // The mean is over the contributions that arrived (zeros for
    // no_gradient pushes): a rank that left the job mid-step is not
    // waited for.
    updater_->Apply(step->chunk, step->sum.data(),
                    static_cast<int32_t>(step->num_summed),
                    step->hyperparameters,
                    Scaling(*step, decided.value_or(StepDecision{})));
  }
  step->applied = decided;
  step->applied_sum_of_squares = step->sum_of_squares;
  step->applied_speculation = keep;
  replies->reserve(step->waiters.size());
  for (Waiter& w : step->waiters) {
    // A decider that holds the kept weights gets none again.
    replies->emplace_back(std::move(w.sink),
                          RetryReply(*step, w.push_only, w.speculative));
  }
  step->waiters.clear();
  if (options_.metrics != nullptr) {
    options_.metrics->StepDone(absl::Now() - step->first_contribution);
  }
  Clear(step);
}

int64_t SyncAggregator::NextStep(uint32_t rank) const {
  // The step every chunk is at.
  int64_t next = -1;
  for (const auto& step : steps_) {
    if (step == nullptr) continue;
    absl::MutexLock lock(&step->chunk->mu);
    if (next < 0 || step->chunk->version < next) next = step->chunk->version;
  }
  return std::max<int64_t>(next, 0);
}

int64_t SyncAggregator::PrepareJoin(uint32_t rank, int64_t join_step) {
  int64_t past = -1;
  for (const auto& step : steps_) {
    if (step == nullptr) continue;
    absl::MutexLock lock(&step->chunk->mu);
    // A step whose update is already decided, or whose sum went past the
    // rank without it, cannot wait for the rank.
    const bool passed = step->fold > rank && !step->contributed[rank];
    const int64_t decided =
        step->chunk->version + (step->apply_scheduled || passed ? 1 : 0);
    if (decided > join_step) past = std::max(past, decided);
  }
  return past;
}

void SyncAggregator::MembershipChanged() {
  for (const auto& step : steps_) {
    if (step == nullptr) continue;
    bool ready = false;
    std::vector<std::shared_ptr<ReplySink>> released;
    {
      absl::MutexLock lock(&step->chunk->mu);
      // Only when someone pushed: the sum of an empty step may not pass a
      // rank that is still to join it.
      if (step->num_contributed > 0) Fold(step.get(), &released);
      ready = !step->apply_scheduled && Complete(*step);
      if (ready) step->apply_scheduled = true;
    }
    for (const std::shared_ptr<ReplySink>& r : released) r->Release();
    WakeAdmitted();
    if (ready) ScheduleApply(step.get());
  }
}

void SyncAggregator::Reset(Chunk* chunk,
                           std::vector<std::shared_ptr<ReplySink>>* failed) {
  Step* step = steps_[chunk->spec.id].get();
  step->chunk->mu.AssertHeld();
  // The early gradients' streams are among the waiters, which the caller
  // fails: they end, so their reads need no release.
  Clear(step);
  step->applied.reset();
  step->applied_speculation = false;
  for (Waiter& w : step->waiters) failed->push_back(std::move(w.sink));
  step->waiters.clear();
}

std::vector<StalledChunk> SyncAggregator::Stalled(
    absl::Duration timeout) const {
  std::vector<StalledChunk> out;
  const absl::Time now = absl::Now();
  for (const auto& step : steps_) {
    if (step == nullptr) continue;
    absl::MutexLock lock(&step->chunk->mu);
    // A sealed step waits for a decision, not for a rank.
    if (step->num_contributed == 0 || step->sealed ||
        now - step->first_contribution < timeout) {
      continue;
    }
    StalledChunk s;
    s.chunk_id = step->chunk->spec.id;
    s.step = step->chunk->version;
    s.waiting = now - step->first_contribution;
    for (uint32_t r = 0; r < step->contributed.size(); ++r) {
      if (!step->contributed[r] && ranks_->WaitsFor(r, step->chunk->version)) {
        s.missing_ranks.push_back(r);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace shardps::server
