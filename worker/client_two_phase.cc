// Client's two-phase steps (StepOptions::second_phase): their options, the
// global norm from every chunk's sum of squares, and the decision sent to
// every chunk (see PushPullRequest.second_phase in parameter_server.proto).
// The step machinery they use (Open, EndPhase, FinishStep) is in client.cc.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "worker/client.h"
#include "worker/open_step.h"

namespace shardps {

absl::Status Client::CheckStepOptions(const StepOptions& options) const {
  auto bad = [](const std::optional<float>& v) {
    return v.has_value() && !(std::isfinite(*v) && *v > 0);
  };
  if (bad(options.loss_scale) || bad(options.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        bad(options.loss_scale) ? "loss scale " : "max_grad_norm ",
        bad(options.loss_scale) ? *options.loss_scale : *options.max_grad_norm,
        " must be finite and > 0"));
  }
  if (!options.second_phase &&
      (options.loss_scale.has_value() || options.max_grad_norm.has_value())) {
    return absl::InvalidArgumentError(
        "a loss scale or max_grad_norm needs a two-phase step "
        "(StepOptions::second_phase)");
  }
  const v1::Encoding g = options_.compression.gradients;
  if (options.loss_scale.has_value() &&
      (g == v1::ENCODING_INT8 || g == v1::ENCODING_TOPK)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaling with ", v1::Encoding_Name(g),
        " gradients: an overflow must reach the servers as inf, which only "
        "FP32, BF16 and FP16 gradients carry"));
  }
  return absl::OkStatus();
}

absl::Status Client::SetMaxGradNorm(float max_norm) {
  if (open_ == nullptr || !open_->options().second_phase) {
    return absl::FailedPreconditionError(
        "max_grad_norm is set on an open two-phase step: BeginStep with "
        "StepOptions::second_phase first");
  }
  StepOptions options = open_->options();
  options.max_grad_norm = max_norm;
  SHARDPS_RETURN_IF_ERROR(CheckStepOptions(options));
  open_->set_max_grad_norm(max_norm);
  return absl::OkStatus();
}

absl::StatusOr<double> Client::GradNorm() {
  if (open_ == nullptr || !open_->options().second_phase) {
    return absl::FailedPreconditionError(
        "GradNorm needs an open two-phase step (StepOptions::second_phase)");
  }
  if (!open_->norm().has_value()) {
    SHARDPS_RETURN_IF_ERROR(CheckAllPushed());
    SHARDPS_RETURN_IF_ERROR(EndPhase());
    absl::StatusOr<double> norm = open_->Norm();
    if (!norm.ok()) {
      AbortStep();
      return norm.status();
    }
    open_->set_norm(*norm);
  }
  return *open_->norm();
}

StepDecision DecideStep(double norm, std::optional<float> max_grad_norm) {
  StepDecision decision;
  decision.skip = !std::isfinite(norm);
  if (!decision.skip && max_grad_norm.has_value()) {
    // As torch's clip_grad_norm_ computes it in float32: max_norm /
    // (total + 1e-6) is reciprocal(total + 1e-6) * max_norm, clamped to 1.
    const float inverse = 1.0f / (static_cast<float>(norm) + 1e-6f);
    decision.clip_coefficient = std::min(1.0f, inverse * *max_grad_norm);
  }
  return decision;
}

absl::Status Client::SendDecision(double norm) {
  const StepDecision decision =
      DecideStep(norm, open_->options().max_grad_norm);
  if (const std::optional<StepDecision>& applied = open_->applied()) {
    if (applied->skip != decision.skip ||
        applied->clip_coefficient != decision.clip_coefficient) {
      const int64_t step = open_->step();
      AbortStep();
      return absl::InvalidArgumentError(absl::StrFormat(
          "step %d: this worker decides clip coefficient %.9g%s, but a shard "
          "already applied %.9g%s from another worker: every worker of a "
          "step must clip with the same max_grad_norm",
          step, decision.clip_coefficient, decision.skip ? " (skip)" : "",
          applied->clip_coefficient, applied->skip ? " (skip)" : ""));
    }
  }
  last_grad_norm_ = norm;
  last_step_skipped_ = decision.skip;
  const bool clipped = decision.skip || decision.clip_coefficient != 1.0f;
  clipped_in_a_row_ = clipped ? clipped_in_a_row_ + 1 : 0;
  StartPhase2(decision);
  return absl::OkStatus();
}

void Client::StartPhase2(const StepDecision& decision) {
  open_->Decide(decision);
  for (auto& lane : lanes_) {
    const std::vector<uint32_t> ids = open_->Pending(lane->chunk_ids);
    if (ids.empty()) continue;
    lane->BeginStep(this, NamesFor(*lane), ids, chunks_.size(), open_->start());
    for (uint32_t id : ids) lane->Queue(id);
    lane->call->Pump();
  }
}

}  // namespace shardps
