// An Optimizer turns the gradients that N workers pushed for a chunk into an
// update of the chunk's weights and optimizer slots, following PyTorch's SGD,
// Adam, AdamW and Adagrad; TensorOptimizers gives each tensor of a
// declaration its own. Immutable after Create: Apply may run concurrently on
// disjoint arrays.
#ifndef SHARDPS_SERVER_OPTIMIZER_H_
#define SHARDPS_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/step_hyperparameters.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// What a two-phase step (PushPullRequest.second_phase) changes in an
// update: the averaged gradient is multiplied by inv_loss_scale, then by
// clip_coefficient (each skipped when 1), and Adam's bias correction counts
// only the updates that stepped the optimizer.
struct GradientScaling {
  float inv_loss_scale = 1;
  float clip_coefficient = 1;
  // Updates before this one that did not step the optimizer (no gradient,
  // loss-scale skips; negative after a state written in with more steps):
  // bias correction uses t = update - skipped_updates + 1.
  int64_t skipped_updates = 0;
};

// The sum of the squares, in double, of the gradient ApplySum computes from
// `sum` and `count` before clipping (the mean, times inv_loss_scale): the
// chunk's part of a two-phase step's norm. Deterministic: a fixed order of
// additions, whatever the machine. Non-finite when a value is.
double SumOfSquaresOfMean(const float* sum, int32_t count, float inv_loss_scale,
                          int64_t n);

class Optimizer {
 public:
  // Elements per block in Apply: the mean gradient of a block is kept in a
  // stack array (8 KiB) that stays in L1 while the update loop reads it.
  static constexpr int64_t kBlockSize = 2048;

  // Fills the defaults the proto documents for zero fields (beta1 0.9,
  // beta2 0.999, epsilon 1e-8, or 1e-10 for Adagrad) and validates. Returns
  // InvalidArgument naming the field for: KIND_UNSPECIFIED or an unknown
  // kind, learning_rate <= 0 or non-finite, momentum outside [0, 1),
  // nesterov without momentum, weight_decay < 0, beta1 or beta2 outside
  // [0, 1), epsilon < 0, initial_accumulator < 0, any non-finite value, or a
  // schedule that ValidateLrSchedule rejects. Fields the kind does not use
  // are ignored but still checked.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(
      const v1::OptimizerSpec& spec);

  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // The spec with defaults filled in.
  const v1::OptimizerSpec& spec() const { return spec_; }

  // State arrays per weight array, each as long as the weights:
  //   SGD without momentum  0
  //   SGD with momentum     1  [0] momentum buffer
  //   Adam, AdamW           2  [0] first moment m, [1] second moment v
  //   Adagrad               1  [0] sum of squared gradients
  int num_slots() const;

  // Sets the n elements of each slot to its initial value: 0, except
  // Adagrad's sum, which starts at initial_accumulator.
  // REQUIRES: slots.size() == num_slots(), each slot has n elements.
  void InitSlots(absl::Span<float* const> slots, int64_t n) const;

  // learning_rate * LrFactor(schedule, update), for the 0-based update.
  float LearningRate(int64_t update) const;

  // OK when Apply may take `step`: InvalidArgument naming the field for a
  // value out of its range (CheckStepHyperparameters), a momentum when
  // this optimizer keeps no momentum buffer (SGD declared with momentum 0,
  // or another kind), a beta1 or beta2 for a kind other than Adam and
  // AdamW.
  absl::Status CheckStepHyperparameters(const StepHyperparameters& step) const;

  // Applies update number `update` (0-based; it selects the learning rate
  // and Adam's bias correction t = update + 1) to `weights` and `slots`.
  // Each field of `step` that is set replaces the declared value for this
  // update (a schedule the workers run): learning_rate replaces
  // LearningRate(update); momentum the declared momentum (at 0 the update
  // is plain SGD and leaves the momentum buffer as it is, as torch does);
  // beta1 and beta2 the declared betas, bias correction included (t still
  // update + 1). Unset fields keep the declared values.
  // `contributions` are the gradients of N >= 1 workers in rank order. The
  // gradient used is their mean, computed per element exactly as
  //   float s = c[0][i]; for r in 1..N-1: s += c[r][i];
  //   g = s / static_cast<float>(N);
  // so that callers can reproduce it bitwise; `scaling` then multiplies it
  // (GradientScaling). Then, in float32 (PyTorch's
  // formulas; wd = weight_decay, lr = LearningRate(update) or the given
  // learning_rate, rounded to float from double either way; momentum, b1
  // and b2 the declared or given ones):
  //   SGD      g += wd*w; with momentum: buf = momentum*buf + g, then
  //            g = g + momentum*buf (nesterov) or g = buf; w -= lr*g.
  //   Adam     g += wd*w; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
  //            w -= (lr/bc1) * (m / (sqrt(v)/sqrt(bc2) + eps)), with
  //            bc1 = 1-b1^t, bc2 = 1-b2^t computed in double.
  //   AdamW    w *= 1 - lr*wd, then Adam without the g += wd*w term.
  //   Adagrad  g += wd*w; sum += g*g; w -= lr * (g / (sqrt(sum) + eps)).
  // Allocation-free. Reads the contributions, writes only weights[0, n) and
  // slots[k][0, n).
  // REQUIRES: contributions.size() >= 1, slots.size() == num_slots(), every
  // array has n elements, no array overlaps another, and
  // CheckStepHyperparameters(step) is OK.
  void Apply(int64_t update, absl::Span<const float* const> contributions,
             float* weights, absl::Span<float* const> slots, int64_t n,
             const StepHyperparameters& step = {},
             const GradientScaling& scaling = {}) const;

  // Apply with the contributions already added: `sum` holds the gradients
  // of `count` >= 1 workers summed in rank order as Apply sums them
  // (s = c[0]; s += c[1]; ...), so the update is bitwise the one Apply
  // makes from those `count` contributions. `sum` is only read.
  void ApplySum(int64_t update, const float* sum, int32_t count, float* weights,
                absl::Span<float* const> slots, int64_t n,
                const StepHyperparameters& step = {},
                const GradientScaling& scaling = {}) const;

 private:
  explicit Optimizer(v1::OptimizerSpec spec) : spec_(std::move(spec)) {}

  const v1::OptimizerSpec spec_;
};

// The optimizer of every tensor of a declaration: a tensor whose
// TensorSpec.optimizer has a kind (not KIND_UNSPECIFIED) gets its own, the
// others share the declaration's. Immutable after Create; movable (the
// Optimizers stay where they are).
class TensorOptimizers {
 public:
  // InvalidArgument naming the tensor ("tensor 1 (fc1.bias) optimizer:
  // OptimizerSpec...") for a tensor's spec that Optimizer::Create refuses,
  // or naming DeclareRequest.optimizer when a tensor without its own needs
  // the declaration's and Create refuses that. (A declaration whose every
  // tensor has its own optimizer needs none of its own.)
  static absl::StatusOr<TensorOptimizers> Create(
      const v1::DeclareRequest& declaration);

  // The optimizer of tensor `tensor` (an index into Layout.tensors).
  // REQUIRES: tensor < the layout's number of tensors.
  const Optimizer& of(uint32_t tensor) const { return *by_tensor_[tensor]; }

 private:
  std::vector<std::unique_ptr<Optimizer>> owned_;
  std::vector<const Optimizer*> by_tensor_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_OPTIMIZER_H_
