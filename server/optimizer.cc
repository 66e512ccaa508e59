#include "server/optimizer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/multiversion.h"
#include "server/lr_schedule.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {
namespace {

using Spec = v1::OptimizerSpec;

// ---------------------------------------------------------------------------
// Validation.

// InvalidArgument("OptimizerSpec.<field> must be <want>, got <value>") unless
// `ok`. Callers write `ok` so that NaN fails it.
absl::Status Require(bool ok, absl::string_view field, absl::string_view want,
                     float value) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "OptimizerSpec.", field, " must be ", want, ", got ", value));
}

bool InUnitInterval(float x) { return x >= 0 && x < 1; }  // [0, 1)
bool FiniteNonNegative(float x) { return std::isfinite(x) && x >= 0; }

absl::Status Validate(const Spec& spec) {
  if (spec.kind() == Spec::KIND_UNSPECIFIED ||
      !Spec::Kind_IsValid(spec.kind())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OptimizerSpec.kind must be KIND_SGD, KIND_ADAM, KIND_ADAMW or "
        "KIND_ADAGRAD, got ",
        Spec::Kind_IsValid(spec.kind()) ? Spec::Kind_Name(spec.kind())
                                        : absl::StrCat(spec.kind())));
  }
  if (spec.nesterov() && spec.momentum() == 0) {
    return absl::InvalidArgumentError(
        "OptimizerSpec.nesterov needs momentum > 0");
  }
  const float lr = spec.learning_rate();
  const absl::Status checks[] = {
      Require(std::isfinite(lr) && lr > 0, "learning_rate", "finite and > 0",
              lr),
      Require(InUnitInterval(spec.momentum()), "momentum", "in [0, 1)",
              spec.momentum()),
      Require(FiniteNonNegative(spec.weight_decay()), "weight_decay",
              "finite and >= 0", spec.weight_decay()),
      Require(InUnitInterval(spec.beta1()), "beta1", "in [0, 1)", spec.beta1()),
      Require(InUnitInterval(spec.beta2()), "beta2", "in [0, 1)", spec.beta2()),
      Require(FiniteNonNegative(spec.epsilon()), "epsilon", "finite and >= 0",
              spec.epsilon()),
      Require(FiniteNonNegative(spec.initial_accumulator()),
              "initial_accumulator", "finite and >= 0",
              spec.initial_accumulator()),
  };
  for (const absl::Status& status : checks) {
    if (!status.ok()) return status;
  }
  absl::Status schedule = ValidateLrSchedule(spec.schedule());
  if (schedule.ok()) return schedule;
  return absl::InvalidArgumentError(
      absl::StrCat("OptimizerSpec.schedule: ", schedule.message()));
}

// ---------------------------------------------------------------------------
// Per-call constants.

enum class Rule { kSgd, kSgdMomentum, kSgdNesterov, kAdam, kAdamW, kAdagrad };

Rule RuleOf(const Spec& spec) {
  switch (spec.kind()) {
    case Spec::KIND_ADAM:
      return Rule::kAdam;
    case Spec::KIND_ADAMW:
      return Rule::kAdamW;
    case Spec::KIND_ADAGRAD:
      return Rule::kAdagrad;
    default:  // KIND_SGD; Create rejects the rest.
      if (spec.momentum() == 0) return Rule::kSgd;
      return spec.nesterov() ? Rule::kSgdNesterov : Rule::kSgdMomentum;
  }
}

// Everything the update loops need, in float. The loops copy the fields they
// use into locals, which no store through a weight pointer can change.
struct Coefficients {
  Rule rule;
  float lr;
  float weight_decay;
  float momentum;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step;                   // lr / bc1
  float bias_correction2_sqrt;  // sqrt(bc2)
  float epsilon;
  float decay;  // AdamW: 1 - lr * weight_decay
  // The averaged gradient is multiplied by these, in this order, when they
  // are not 1 (GradientScaling).
  float inv_loss_scale = 1;
  float clip_coefficient = 1;
};

// learning_rate * LrFactor, in double.
double ScheduledLr(const Spec& spec, int64_t update) {
  return static_cast<double>(spec.learning_rate()) *
         LrFactor(spec.schedule(), update);
}

// Scalars are combined in double and rounded once, as PyTorch does with its
// Python-float hyperparameters. The fields of `step` are the workers' own
// (their schedulers' values this step) and replace the declared ones; Adam's
// bias correction uses the step's betas, as torch's 1 - beta1 ** step with
// the group's current beta1.
Coefficients CoefficientsAt(const Spec& spec, int64_t update,
                            const StepHyperparameters& step,
                            const GradientScaling& scaling) {
  const double lr = step.learning_rate.has_value()
                        ? static_cast<double>(*step.learning_rate)
                        : ScheduledLr(spec, update);
  const float momentum = step.momentum.value_or(spec.momentum());
  const float beta1_f = step.beta1.value_or(spec.beta1());
  const float beta2_f = step.beta2.value_or(spec.beta2());
  const double beta1 = beta1_f;
  const double beta2 = beta2_f;
  // Adam's own step count: updates skipped whole do not count (torch's
  // GradScaler never calls optimizer.step() for them).
  const double t = static_cast<double>(update - scaling.skipped_updates + 1);
  const double bias_correction1 = 1.0 - std::pow(beta1, t);
  const double bias_correction2 = 1.0 - std::pow(beta2, t);
  Coefficients k;
  k.rule = RuleOf(spec);
  // torch's SGD skips its momentum buffer whole at momentum 0 (neither
  // decayed nor added to): a plain step that leaves the slot alone.
  if (momentum == 0 &&
      (k.rule == Rule::kSgdMomentum || k.rule == Rule::kSgdNesterov)) {
    k.rule = Rule::kSgd;
  }
  k.lr = static_cast<float>(lr);
  k.weight_decay = spec.weight_decay();
  k.momentum = momentum;
  k.beta1 = beta1_f;
  k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  k.beta2 = beta2_f;
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.step = static_cast<float>(lr / bias_correction1);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  k.epsilon = spec.epsilon();
  k.decay = static_cast<float>(1.0 - lr * spec.weight_decay());
  k.inv_loss_scale = scaling.inv_loss_scale;
  k.clip_coefficient = scaling.clip_coefficient;
  return k;
}

// ---------------------------------------------------------------------------
// Update loops over one block. `Len` is either int64_t (the last, partial
// block) or FullBlock, whose compile-time trip count lets GCC vectorize at
// -O2 too (its "very cheap" cost model wants a known multiple of the vector
// width). Every pointer is __restrict: the caller guarantees disjoint arrays,
// and without it the compiler would add runtime overlap checks (or, at -O2,
// not vectorize at all).

using FullBlock = std::integral_constant<int64_t, Optimizer::kBlockSize>;

template <typename Len>
[[gnu::always_inline]] inline void Copy(Len len, const float* __restrict src,
                                        float* __restrict dst) {
  for (int64_t i = 0; i < len; ++i) dst[i] = src[i];
}
template <typename Len>
[[gnu::always_inline]] inline void Sum2(Len len, const float* __restrict a,
                                        const float* __restrict b,
                                        float* __restrict dst) {
  for (int64_t i = 0; i < len; ++i) dst[i] = a[i] + b[i];
}
template <typename Len>
[[gnu::always_inline]] inline void AddTo(Len len, const float* __restrict src,
                                         float* __restrict dst) {
  for (int64_t i = 0; i < len; ++i) dst[i] += src[i];
}
template <typename Len>
[[gnu::always_inline]] inline void DivideBy(Len len, float divisor,
                                            float* __restrict dst) {
  // A division, not a multiplication by 1/N: the mean is a contract. For a
  // power of two, 1/N is exact and multiplying gives the same floats faster.
  const int n = static_cast<int>(divisor);
  if ((n & (n - 1)) == 0) {
    const float inverse = 1.0f / divisor;
    for (int64_t i = 0; i < len; ++i) dst[i] *= inverse;
  } else {
    for (int64_t i = 0; i < len; ++i) dst[i] /= divisor;
  }
}

// g = the contributions at [offset, offset + len), summed in rank order,
// divided by `divisor`. The first two ranks are added in one pass; (c0 + c1)
// is the same float as s = c0; s += c1.
template <typename Len>
[[gnu::always_inline]] inline void MeanGradient(
    Len len, absl::Span<const float* const> contributions, int32_t divisor,
    int64_t offset, float* __restrict g) {
  const size_t num = contributions.size();
  if (num == 1) {
    Copy(len, contributions[0] + offset, g);
  } else {
    Sum2(len, contributions[0] + offset, contributions[1] + offset, g);
    for (size_t r = 2; r < num; ++r) AddTo(len, contributions[r] + offset, g);
  }
  if (divisor != 1)
    DivideBy(len, static_cast<float>(divisor), g);  // s / 1 == s
}

// The unscaling, then the clipping, of a two-phase step (each a float
// multiplication, as torch's unscale_ and clip_grad_norm_ make them).
template <typename Len>
[[gnu::always_inline]] inline void ScaleGradient(Len len, const Coefficients& k,
                                                 float* __restrict g) {
  if (k.inv_loss_scale != 1.0f) {
    for (int64_t i = 0; i < len; ++i) g[i] *= k.inv_loss_scale;
  }
  if (k.clip_coefficient != 1.0f) {
    for (int64_t i = 0; i < len; ++i) g[i] *= k.clip_coefficient;
  }
}

// g += wd * w (L2 penalty folded into the gradient, as PyTorch does).
template <typename Len>
[[gnu::always_inline]] inline void AddWeightDecay(Len len, float wd,
                                                  const float* __restrict w,
                                                  float* __restrict g) {
  for (int64_t i = 0; i < len; ++i) g[i] += wd * w[i];
}
template <typename Len>
[[gnu::always_inline]] inline void Scale(Len len, float factor,
                                         float* __restrict w) {
  for (int64_t i = 0; i < len; ++i) w[i] *= factor;
}

template <typename Len>
[[gnu::always_inline]] inline void Sgd(Len len, float lr,
                                       const float* __restrict g,
                                       float* __restrict w) {
  for (int64_t i = 0; i < len; ++i) w[i] -= lr * g[i];
}
// Heavy-ball momentum, or Nesterov's when kNesterov; a template parameter so
// that each instance compiles to its own branch-free, vectorised loop.
template <bool kNesterov, typename Len>
[[gnu::always_inline]] inline void SgdMomentum(Len len, float lr,
                                               float momentum,
                                               const float* __restrict g,
                                               float* __restrict w,
                                               float* __restrict buf) {
  for (int64_t i = 0; i < len; ++i) {
    const float b = momentum * buf[i] + g[i];
    buf[i] = b;
    if constexpr (kNesterov) {
      w[i] -= lr * (g[i] + momentum * b);
    } else {
      w[i] -= lr * b;
    }
  }
}

// sqrtf may set errno, which keeps GCC and Clang from vectorizing any loop
// that calls it unless the code is built with -fno-math-errno (no attribute
// or pragma does it in GCC 12). Taking the square roots in a loop of their
// own keeps the other Adam and Adagrad loops vectorized either way; this one
// is vectorized too under -fno-math-errno, which the build should pass.
template <typename Len>
[[gnu::always_inline]] inline void Sqrt(Len len, const float* __restrict x,
                                        float* __restrict root) {
  for (int64_t i = 0; i < len; ++i) root[i] = std::sqrt(x[i]);
}

template <typename Len>
[[gnu::always_inline]] inline void AdamMoments(Len len, const Coefficients& k,
                                               const float* __restrict g,
                                               float* __restrict m,
                                               float* __restrict v) {
  const float b1 = k.beta1, c1 = k.one_minus_beta1;
  const float b2 = k.beta2, c2 = k.one_minus_beta2;
  for (int64_t i = 0; i < len; ++i) {
    m[i] = b1 * m[i] + c1 * g[i];
    v[i] = b2 * v[i] + c2 * g[i] * g[i];
  }
}
// sqrt_v holds sqrt(v).
template <typename Len>
[[gnu::always_inline]] inline void AdamStep(Len len, const Coefficients& k,
                                            const float* __restrict m,
                                            const float* __restrict sqrt_v,
                                            float* __restrict w) {
  const float step = k.step, eps = k.epsilon;
  // sqrt(v) / sqrt(bc2) as a product with the reciprocal (computed in
  // double): one division per element instead of two.
  const float inv_bc2_sqrt =
      static_cast<float>(1.0 / static_cast<double>(k.bias_correction2_sqrt));
  for (int64_t i = 0; i < len; ++i) {
    const float denom = sqrt_v[i] * inv_bc2_sqrt + eps;
    w[i] -= step * (m[i] / denom);
  }
}

// Moments, square root and step in one pass (the build passes
// -fno-math-errno, so the square root vectorizes inside the loop).
template <typename Len>
[[gnu::always_inline]] inline void AdamFused(Len len, const Coefficients& k,
                                             const float* __restrict g,
                                             float* __restrict m,
                                             float* __restrict v,
                                             float* __restrict w) {
  const float b1 = k.beta1, c1 = k.one_minus_beta1;
  const float b2 = k.beta2, c2 = k.one_minus_beta2;
  const float step = k.step, eps = k.epsilon;
  const float inv_bc2_sqrt =
      static_cast<float>(1.0 / static_cast<double>(k.bias_correction2_sqrt));
  for (int64_t i = 0; i < len; ++i) {
    const float mi = b1 * m[i] + c1 * g[i];
    const float vi = b2 * v[i] + c2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    w[i] -= step * (mi / (std::sqrt(vi) * inv_bc2_sqrt + eps));
  }
}

template <typename Len>
[[gnu::always_inline]] inline void AccumulateSquares(Len len,
                                                     const float* __restrict g,
                                                     float* __restrict sum) {
  for (int64_t i = 0; i < len; ++i) sum[i] += g[i] * g[i];
}
// sqrt_sum holds sqrt(sum).
template <typename Len>
[[gnu::always_inline]] inline void AdagradStep(Len len, float lr, float eps,
                                               const float* __restrict g,
                                               const float* __restrict sqrt_sum,
                                               float* __restrict w) {
  for (int64_t i = 0; i < len; ++i) w[i] -= lr * (g[i] / (sqrt_sum[i] + eps));
}

// One block of Apply. `g` and `scratch` are kBlockSize floats each; the slot
// and weight pointers already point at the block.
template <typename Len>
[[gnu::always_inline]] inline void UpdateBlock(Len len, const Coefficients& k,
                                               float* g, float* scratch,
                                               float* w, float* const* slots) {
  const bool l2 = k.weight_decay != 0 && k.rule != Rule::kAdamW;
  if (l2) AddWeightDecay(len, k.weight_decay, w, g);
  switch (k.rule) {
    case Rule::kSgd:
      Sgd(len, k.lr, g, w);
      break;
    case Rule::kSgdMomentum:
      SgdMomentum</*kNesterov=*/false>(len, k.lr, k.momentum, g, w, slots[0]);
      break;
    case Rule::kSgdNesterov:
      SgdMomentum</*kNesterov=*/true>(len, k.lr, k.momentum, g, w, slots[0]);
      break;
    case Rule::kAdamW:
      if (k.weight_decay != 0) Scale(len, k.decay, w);
      [[fallthrough]];
    case Rule::kAdam:
      AdamFused(len, k, g, slots[0], slots[1], w);
      break;
    case Rule::kAdagrad:
      AccumulateSquares(len, g, slots[0]);
      Sqrt(len, slots[0], scratch);
      AdagradStep(len, k.lr, k.epsilon, g, scratch, w);
      break;
  }
}

constexpr int kMaxSlots = 2;

// The whole update (every helper above is forced inline into it), compiled
// for AVX-512, AVX2 and baseline x86-64 and picked at load time: Adam and
// Adagrad are bound by the square roots and divisions, which wider vectors
// speed up. Results are bitwise identical in every version: the operations
// are IEEE-exact and the build passes -ffp-contract=off (no FMAs).
SHARDPS_MULTIVERSIONED void ApplyBlocks(
    const Coefficients& k, absl::Span<const float* const> contributions,
    int32_t divisor, float* weights, absl::Span<float* const> slots,
    int64_t n) {
  constexpr int64_t kBlockSize = Optimizer::kBlockSize;
  alignas(64) float g[kBlockSize];
  alignas(64) float scratch[kBlockSize];
  float* block_slots[kMaxSlots] = {};
  for (int64_t offset = 0; offset < n; offset += kBlockSize) {
    for (size_t s = 0; s < slots.size(); ++s) {
      block_slots[s] = slots[s] + offset;
    }
    const int64_t len = std::min(kBlockSize, n - offset);
    if (len == kBlockSize) {
      MeanGradient(FullBlock(), contributions, divisor, offset, g);
      ScaleGradient(FullBlock(), k, g);
      UpdateBlock(FullBlock(), k, g, scratch, weights + offset, block_slots);
    } else {
      MeanGradient(len, contributions, divisor, offset, g);
      ScaleGradient(len, k, g);
      UpdateBlock(len, k, g, scratch, weights + offset, block_slots);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const v1::OptimizerSpec& spec) {
  Spec filled = spec;
  if (filled.beta1() == 0) filled.set_beta1(0.9f);
  if (filled.beta2() == 0) filled.set_beta2(0.999f);
  if (filled.epsilon() == 0) {
    filled.set_epsilon(spec.kind() == Spec::KIND_ADAGRAD ? 1e-10f : 1e-8f);
  }
  absl::Status status = Validate(filled);
  if (!status.ok()) return status;
  return std::unique_ptr<Optimizer>(new Optimizer(std::move(filled)));
}

int Optimizer::num_slots() const {
  switch (RuleOf(spec_)) {
    case Rule::kSgd:
      return 0;
    case Rule::kAdam:
    case Rule::kAdamW:
      return 2;
    default:  // SGD with momentum, Adagrad
      return 1;
  }
}

void Optimizer::InitSlots(absl::Span<float* const> slots, int64_t n) const {
  assert(static_cast<int>(slots.size()) == num_slots());
  const float initial =
      spec_.kind() == Spec::KIND_ADAGRAD ? spec_.initial_accumulator() : 0.0f;
  for (float* slot : slots) std::fill(slot, slot + n, initial);
}

float Optimizer::LearningRate(int64_t update) const {
  return static_cast<float>(ScheduledLr(spec_, update));
}

absl::Status Optimizer::CheckStepHyperparameters(
    const StepHyperparameters& step) const {
  absl::Status range = shardps::CheckStepHyperparameters(step);
  if (!range.ok()) return range;
  const Rule rule = RuleOf(spec_);
  if (step.momentum.has_value() && rule != Rule::kSgdMomentum &&
      rule != Rule::kSgdNesterov) {
    return absl::InvalidArgumentError(
        spec_.kind() == Spec::KIND_SGD
            ? "momentum is set, but the chunk's SGD was declared with "
              "momentum 0 and keeps no momentum buffer (declare momentum > "
              "0 to change it during training)"
            : absl::StrCat("momentum is set, but the chunk's optimizer is ",
                           Spec::Kind_Name(spec_.kind()),
                           ", which has no momentum"));
  }
  const bool adam = rule == Rule::kAdam || rule == Rule::kAdamW;
  if ((step.beta1.has_value() || step.beta2.has_value()) && !adam) {
    return absl::InvalidArgumentError(absl::StrCat(
        step.beta1.has_value() ? "beta1" : "beta2",
        " is set, but the chunk's optimizer is ", Spec::Kind_Name(spec_.kind()),
        ", which has no betas (only Adam and AdamW do)"));
  }
  return absl::OkStatus();
}

void Optimizer::Apply(int64_t update,
                      absl::Span<const float* const> contributions,
                      float* weights, absl::Span<float* const> slots, int64_t n,
                      const StepHyperparameters& step,
                      const GradientScaling& scaling) const {
  assert(!contributions.empty());
  assert(static_cast<int>(slots.size()) == num_slots());
  assert(CheckStepHyperparameters(step).ok());
  ApplyBlocks(CoefficientsAt(spec_, update, step, scaling), contributions,
              static_cast<int32_t>(contributions.size()), weights, slots, n);
}

void Optimizer::ApplySum(int64_t update, const float* sum, int32_t count,
                         float* weights, absl::Span<float* const> slots,
                         int64_t n, const StepHyperparameters& step,
                         const GradientScaling& scaling) const {
  assert(count >= 1);
  assert(static_cast<int>(slots.size()) == num_slots());
  assert(CheckStepHyperparameters(step).ok());
  ApplyBlocks(CoefficientsAt(spec_, update, step, scaling),
              absl::MakeConstSpan(&sum, 1), count, weights, slots, n);
}

double SumOfSquaresOfMean(const float* sum, int32_t count, float inv_loss_scale,
                          int64_t n) {
  // The gradient exactly as ApplySum computes it (MeanGradient, then
  // ScaleGradient before any clipping), squared and added in double: eight
  // running sums over the elements by index mod 8, then added in order, so
  // the result is the same on every machine and for any number of shards.
  constexpr int kLanes = 8;
  double acc[kLanes] = {};
  const float divisor = static_cast<float>(count);
  const int c = static_cast<int>(count);
  const bool power_of_two = (c & (c - 1)) == 0;
  const float inverse = 1.0f / divisor;
  int64_t i = 0;
  auto value = [&](int64_t j) {
    float g = count == 1     ? sum[j]
              : power_of_two ? sum[j] * inverse
                             : sum[j] / divisor;
    if (inv_loss_scale != 1.0f) g *= inv_loss_scale;
    return static_cast<double>(g);
  };
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double g = value(i + l);
      acc[l] += g * g;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const double g = value(i);
    acc[l] += g * g;
  }
  double total = 0;
  for (double a : acc) total += a;
  return total;
}

absl::StatusOr<TensorOptimizers> TensorOptimizers::Create(
    const v1::DeclareRequest& declaration) {
  TensorOptimizers out;
  const Optimizer* shared = nullptr;  // the declaration's, once needed
  const auto& tensors = declaration.layout().tensors();
  for (int i = 0; i < tensors.size(); ++i) {
    const v1::TensorSpec& tensor = tensors[i];
    const bool own = tensor.optimizer().kind() != Spec::KIND_UNSPECIFIED;
    if (!own && shared != nullptr) {
      out.by_tensor_.push_back(shared);
      continue;
    }
    absl::StatusOr<std::unique_ptr<Optimizer>> created =
        Optimizer::Create(own ? tensor.optimizer() : declaration.optimizer());
    if (!created.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          own ? absl::StrCat("tensor ", i, " (", tensor.name(), ") optimizer")
              : absl::StrCat("DeclareRequest.optimizer (for tensor ", i, " (",
                             tensor.name(), "), which has none of its own)"),
          ": ", created.status().message()));
    }
    out.by_tensor_.push_back(created->get());
    if (!own) shared = created->get();
    out.owned_.push_back(*std::move(created));
  }
  return out;
}

}  // namespace shardps::server
