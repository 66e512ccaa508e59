// SyncAggregator's two-phase steps (PushPullRequest.second_phase): a
// complete step is sealed (each chunk's sum of squares goes back to the
// workers), and its update waits for the step's decision (a clip
// coefficient, or a skip), which every rank pushes the same.
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "server/sync_aggregator.h"

namespace shardps::server {

absl::Status SyncAggregator::CheckPhases(const Step& step,
                                         const PushArgs& args) const {
  if (step.num_contributed == 0) return absl::OkStatus();
  const bool same_scale =
      step.loss_scale.has_value() == args.loss_scale.has_value() &&
      (!args.loss_scale.has_value() ||
       std::memcmp(&*step.loss_scale, &*args.loss_scale, sizeof(float)) == 0);
  if (step.second_phase == args.second_phase && same_scale) {
    return absl::OkStatus();
  }
  auto name = [](bool second_phase, const std::optional<float>& scale) {
    if (!second_phase) return std::string("a one-phase step");
    return scale.has_value()
               ? absl::StrFormat("a two-phase step with loss scale %.9g",
                                 *scale)
               : std::string("a two-phase step without loss scale");
  };
  return absl::InvalidArgumentError(absl::StrCat(
      "rank ", args.rank, " pushes chunk ", step.chunk->spec.id, " (",
      step.chunk->tensor_name, ") of step ", args.step, " as ",
      name(args.second_phase, args.loss_scale),
      ", but the step's first push made it ",
      name(step.second_phase, step.loss_scale),
      ": every worker of a step must clip and scale the loss alike"));
}

float SyncAggregator::InverseLossScale(const Step& step) {
  // torch's unscale_: the reciprocal in double, rounded to float.
  return step.loss_scale.has_value()
             ? static_cast<float>(1.0 / double{*step.loss_scale})
             : 1.0f;
}

ChunkReply SyncAggregator::SealedReply(const Step& step, bool speculative) {
  ChunkReply reply;
  reply.chunk_id = step.chunk->spec.id;
  reply.version = step.chunk->version;
  reply.sum_of_squares = step.sum_of_squares;
  if (speculative && step.speculated) {
    // Shared with the step: the decision commits this buffer, never
    // writes it.
    reply.weights = step.speculative_weights;
    reply.speculative = true;
  }
  return reply;
}

GradientScaling SyncAggregator::Scaling(const Step& step,
                                        const StepDecision& decision) {
  GradientScaling scaling;
  scaling.inv_loss_scale = InverseLossScale(step);
  scaling.clip_coefficient = decision.clip_coefficient;
  return scaling;
}

void SyncAggregator::Seal(Step* step, PendingReplies* replies) const {
  Chunk* chunk = step->chunk;
  const float inv = InverseLossScale(*step);
  step->sum_of_squares =
      step->num_with_gradient == 0
          ? 0.0
          : SumOfSquaresOfMean(step->sum.data(),
                               static_cast<int32_t>(step->num_summed), inv,
                               chunk->spec.num_elements);
  step->sealed = true;
  // Speculative weights: the update the decision makes when it neither
  // clips nor skips (most steps of a long run), computed now so that the
  // weights travel while other chunks are still pushed. Not for a step
  // that must be skipped, nor one without gradients (its update is a
  // skip, whatever the decision).
  step->speculated = step->speculate && step->num_with_gradient > 0 &&
                     std::isfinite(step->sum_of_squares);
  if (step->speculated) {
    updater_->Speculate(*step->chunk, step->sum.data(),
                        static_cast<int32_t>(step->num_summed),
                        step->hyperparameters, Scaling(*step, StepDecision{}),
                        &step->speculative_weights, &step->speculative_slots);
  } else if (!step->speculate) {
    // Not asked (the workers' last steps clipped): no copy held meanwhile.
    step->speculative_weights.reset();
    step->speculative_slots.clear();
  }
  for (Waiter& w : step->waiters) {
    replies->emplace_back(std::move(w.sink), SealedReply(*step, w.speculative));
  }
  step->waiters.clear();
}

absl::Status SyncAggregator::Decide(const PushArgs& args, Step* step,
                                    std::shared_ptr<ReplySink> sink) {
  Chunk* chunk = step->chunk;
  const StepDecision& d = *args.decision;
  auto disagree = [&](const StepDecision& first) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d decides step %d of chunk %d (%s) with clip coefficient "
        "%.9g%s, "
        "but the step's first decision was %.9g%s: every worker of a step "
        "must clip with the same max_grad_norm",
        args.rank, args.step, chunk->spec.id, chunk->tensor_name,
        d.clip_coefficient, d.skip ? " (skip)" : "", first.clip_coefficient,
        first.skip ? " (skip)" : ""));
  };
  bool schedule = false;
  {
    // Locked as step->chunk: the thread-safety analysis does not know that
    // `chunk` is the same.
    absl::ReleasableMutexLock lock(&step->chunk->mu);
    const int64_t version = step->chunk->version;
    if (args.step == version - 1) {
      // A decision of the step just applied (a rank behind the first, or
      // one whose reply was lost): answer with the weights, if it is the
      // decision that was applied.
      if (!step->applied.has_value()) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank ", args.rank, " decides step ", args.step,
                         " of chunk ", chunk->spec.id, " (", chunk->tensor_name,
                         "), whose update was not a two-phase step's"));
      }
      if (*step->applied != d) return disagree(*step->applied);
      // Most often no loss: the decision of a rank behind the first.
      ChunkReply reply =
          RetryReply(*step, args.push_only, args.speculative_weights);
      lock.Release();
      updater_->Deliver(sink.get(), std::move(reply));
      return absl::OkStatus();
    }
    if (args.step != version) {
      return absl::OutOfRangeError(absl::StrCat(
          "decision for step ", args.step, " of chunk ", chunk->spec.id,
          " is in the ", args.step < version ? "past" : "future",
          ": the chunk is at step ", version));
    }
    if (!step->sealed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", args.rank, " decides step ", args.step, " of chunk ",
          chunk->spec.id, " (", chunk->tensor_name, "), which is not sealed: ",
          step->second_phase ? "not every rank's gradient is in yet"
                             : "it is not a two-phase step"));
    }
    // A chunk's non-finite sum makes the step's norm non-finite, which
    // every worker skips; applied, the overflow would stay in the weights
    // and the optimizer state for good.
    if (!d.skip && !std::isfinite(step->sum_of_squares)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", args.rank, " decides to apply step ", args.step,
          " of chunk ", chunk->spec.id, " (", chunk->tensor_name,
          "), whose sum of squares is not finite: the step must be skipped"));
    }
    if (step->decided.has_value()) {
      if (*step->decided != d) return disagree(*step->decided);
    } else {
      step->decided = d;
      schedule = true;
    }
    step->waiters.push_back({args.rank, args.push_only, std::move(sink), 0,
                             args.speculative_weights});
  }
  if (schedule) ScheduleApply(step);
  return absl::OkStatus();
}

}  // namespace shardps::server
