#include "worker/backend.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardps::worker {

absl::Status Backend::Init(const ModelSpec& spec, int max_batch) {
  if (max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch must be >= 1, got ", max_batch));
  }
  // Every buffer is at most max_batch x max_width floats; keep indices in int.
  if (static_cast<double>(max_batch) * spec.max_width() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch ", max_batch, " x width ", spec.max_width(),
                     " exceeds 2^31 elements"));
  }
  spec_.reset();
  has_params_ = false;
  SHARDPS_RETURN_IF_ERROR(DoInit(spec, max_batch));
  spec_ = spec;
  params_ = spec.Params(/*model_seed=*/0);  // for names and sizes only
  max_batch_ = max_batch;
  return absl::OkStatus();
}

absl::Status Backend::SetParams(
    absl::Span<const absl::Span<const float>> params, bool first_layer) {
  if (!spec_.has_value()) {
    return absl::FailedPreconditionError("SetParams before Init");
  }
  if (!first_layer && DoFirstLayerBlock() == 0) {
    return absl::FailedPreconditionError(
        "SetParams without the first layer, but this backend does not "
        "compute it ahead");
  }
  const std::vector<ParamSpec>& specs = params_;
  if (params.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", specs.size(), " parameters, got ", params.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(params[i].size()) != specs[i].num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat(specs[i].name, " has ", params[i].size(),
                       " floats, expected ", specs[i].num_elements()));
    }
  }
  SHARDPS_RETURN_IF_ERROR(DoSetParams(params, first_layer));
  has_params_ = true;
  first_layer_set_ = first_layer;
  return absl::OkStatus();
}

absl::Status Backend::CheckBatch(absl::Span<const float> x,
                                 absl::Span<const int32_t> labels) const {
  if (!has_params_) {
    return absl::FailedPreconditionError("no parameters: call SetParams");
  }
  if (x.size() != labels.size() * spec_->num_features()) {
    return absl::InvalidArgumentError(
        absl::StrCat("x has ", x.size(), " floats, expected ", labels.size(),
                     " rows x ", spec_->num_features(), " features"));
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= spec_->num_classes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("label ", labels[i], " of row ", i, " is outside [0, ",
                       spec_->num_classes(), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Backend::Gradients(
    absl::Span<const float> x, absl::Span<const int32_t> labels, float scale,
    absl::Span<const absl::Span<float>> grads, const GradientReady& ready,
    const GradientPartReady& part_ready, bool first_layer_ahead) {
  // What was computed ahead serves this call only.
  const std::vector<bool> ahead = std::move(ahead_);
  const int ahead_rows = ahead_rows_;
  ahead_.clear();
  SHARDPS_RETURN_IF_ERROR(CheckBatch(x, labels));
  if (!first_layer_ahead && !first_layer_set_) {
    return absl::FailedPreconditionError(
        "Gradients without the first layer ahead, but SetParams left the "
        "first layer out");
  }
  if (first_layer_ahead &&
      (ahead.empty() || ahead_rows != static_cast<int>(labels.size()) ||
       std::find(ahead.begin(), ahead.end(), false) != ahead.end())) {
    return absl::FailedPreconditionError(
        "Gradients with the first layer ahead, but ForwardFirstLayer did not "
        "compute every block of it for this batch");
  }
  if (labels.size() > static_cast<size_t>(max_batch_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", labels.size(), " rows exceeds max_batch ", max_batch_));
  }
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("scale is ", scale));
  }
  const std::vector<ParamSpec>& specs = params_;
  if (grads.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", specs.size(), " gradient buffers, got ", grads.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(grads[i].size()) != specs[i].num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of ", specs[i].name, " has ", grads[i].size(),
                       " floats, expected ", specs[i].num_elements()));
    }
  }
  std::vector<bool> reported(grads.size(), false);
  const GradientReady report = [&](int param) -> absl::Status {
    if (param < 0 || param >= static_cast<int>(grads.size()) ||
        reported[param]) {
      return absl::InternalError(absl::StrCat(
          "backend reported gradient ", param, " twice or of ", grads.size()));
    }
    reported[param] = true;
    return ready == nullptr ? absl::OkStatus() : ready(param);
  };
  // Parts grow, and stop once the whole parameter is reported.
  std::vector<int64_t> parts(grads.size(), 0);
  const GradientPartReady report_part = [&](int param,
                                            int64_t elements) -> absl::Status {
    if (param < 0 || param >= static_cast<int>(grads.size()) ||
        reported[param] || elements <= parts[param] ||
        elements >= static_cast<int64_t>(grads[param].size())) {
      return absl::InternalError(absl::StrCat(
          "backend reported ", elements, " final elements of gradient ", param,
          " out of order or of ", grads.size()));
    }
    parts[param] = elements;
    return part_ready == nullptr ? absl::OkStatus()
                                 : part_ready(param, elements);
  };
  double loss = 0.0;
  if (labels.empty()) {
    for (const absl::Span<float> g : grads) std::fill(g.begin(), g.end(), 0.f);
  } else if (ready == nullptr && part_ready == nullptr) {
    return DoGradients(
        x.data(), labels.data(), static_cast<int>(labels.size()), scale, grads,
        [](int) { return absl::OkStatus(); },
        [](int, int64_t) { return absl::OkStatus(); }, first_layer_ahead);
  } else {
    SHARDPS_ASSIGN_OR_RETURN(
        loss,
        DoGradients(x.data(), labels.data(), static_cast<int>(labels.size()),
                    scale, grads, report, report_part, first_layer_ahead));
  }
  if (ready == nullptr && part_ready == nullptr) return loss;
  // The rest, last parameter first (backward order).
  for (int p = static_cast<int>(grads.size()) - 1; p >= 0; --p) {
    if (!reported[p]) SHARDPS_RETURN_IF_ERROR(report(p));
  }
  return loss;
}

absl::Status Backend::ForwardFirstLayer(absl::Span<const float> x, int begin,
                                        int end, absl::Span<const float> weight,
                                        absl::Span<const float> bias) {
  const int block = DoFirstLayerBlock();
  if (!spec_.has_value() || block == 0) {
    return absl::FailedPreconditionError(
        !spec_.has_value() ? "ForwardFirstLayer before Init"
                           : "this backend does not compute its first layer "
                             "ahead");
  }
  const int64_t in = spec_->num_features();
  const int units = static_cast<int>(params_[1].num_elements());
  const int64_t rows = static_cast<int64_t>(x.size()) / in;
  if (static_cast<int64_t>(x.size()) != rows * in || rows < 1 ||
      rows > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat("x has ", x.size(), " floats: not 1 to ", max_batch_,
                     " rows of ", in, " features"));
  }
  if (begin < 0 || begin % block != 0 ||
      end != std::min(begin + block, units)) {
    return absl::InvalidArgumentError(
        absl::StrCat("units [", begin, ", ", end, ") are not a block of ",
                     block, " of the first layer's ", units));
  }
  if (weight.size() != static_cast<size_t>(params_[0].num_elements()) ||
      bias.size() != static_cast<size_t>(units)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the first layer's weight and bias have ", params_[0].num_elements(),
        " and ", units, " floats, not ", weight.size(), " and ", bias.size()));
  }
  const int b = static_cast<int>(rows);
  if (ahead_.empty() || ahead_rows_ != b) {
    ahead_.assign((units + block - 1) / block, false);
    ahead_rows_ = b;
  }
  DoForwardFirstLayer(x.data(), b, begin, end, weight.data(), bias.data());
  ahead_[begin / block] = true;
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> Backend::Evaluate(absl::Span<const float> x,
                                             absl::Span<const int32_t> labels) {
  ahead_.clear();
  SHARDPS_RETURN_IF_ERROR(CheckBatch(x, labels));
  if (!first_layer_set_) {
    return absl::FailedPreconditionError(
        "Evaluate, but SetParams left the first layer out");
  }
  const int64_t n = static_cast<int64_t>(labels.size());
  double loss_sum = 0.0;
  EvalResult total;
  for (int64_t begin = 0; begin < n; begin += max_batch_) {
    const int b = static_cast<int>(std::min<int64_t>(max_batch_, n - begin));
    SHARDPS_ASSIGN_OR_RETURN(
        const EvalResult part,
        DoEvaluate(x.data() + begin * spec_->num_features(),
                   labels.data() + begin, b));
    loss_sum += part.mean_loss * b;
    total.correct += part.correct;
  }
  total.mean_loss = n > 0 ? loss_sum / n : 0.0;
  return total;
}

}  // namespace shardps::worker
