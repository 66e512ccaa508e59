// A Backend computes a model's loss gradients and evaluation metrics for one
// batch at a time on some device: the CPU (OpenBLAS, the reference) or a CUDA
// GPU. Parameters and data stay host floats at this interface. Not
// thread-safe: one trainer thread owns a backend.
#ifndef SHARDPS_WORKER_BACKEND_H_
#define SHARDPS_WORKER_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model.h"

namespace shardps::worker {

struct EvalResult {
  double mean_loss = 0.0;  // mean cross-entropy over the rows (0 if none)
  int64_t correct = 0;  // rows whose argmax (lowest index on ties) is the label
};

// The public methods validate their arguments once, here, and then call the
// Do* methods that each device implements.
class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:0 (<device name>)".
  virtual std::string name() const = 0;

  // Sets up buffers for `spec` and batches of at most `max_batch` rows; may be
  // called again to switch models. InvalidArgument if max_batch < 1;
  // ResourceExhausted or Internal if buffers cannot be allocated.
  absl::Status Init(const ModelSpec& spec, int max_batch);

  // Copies in the parameters, host floats in spec.Params() order.
  // `first_layer` false leaves the first layer's weight and bias out (sizes
  // still checked): a step whose first layer was computed ahead
  // (ForwardFirstLayer, from the caller's buffers) does not read them, and
  // they are three quarters of an MLP's bytes. Until a SetParams with them,
  // only Gradients with first_layer_ahead runs. FailedPrecondition before
  // Init, or for first_layer false where first_layer_block() is 0;
  // InvalidArgument for a wrong count or size.
  absl::Status SetParams(absl::Span<const absl::Span<const float>> params,
                         bool first_layer = true);

  // Forward and backward on x (b x num_features, row-major) and labels
  // (b = labels.size() <= max_batch). Writes d(loss)/d(param) for every
  // parameter, in Params() order, into grads (caller-owned, exact sizes),
  // where loss = scale * (sum over the b rows of the cross-entropy): scale
  // 1/b gives the mean. Returns the mean cross-entropy of the rows (0 and
  // zero gradients when b = 0). FailedPrecondition before SetParams;
  // InvalidArgument for bad sizes, labels outside [0, num_classes) or a
  // non-finite scale; Internal for device failures.
  //
  // `ready`, if given, is called once per parameter, with its index, as
  // soon as that parameter's gradient is final in grads (backward order:
  // the last layer first, on a device that finishes layer by layer; all at
  // the end otherwise), so a caller can send it while the rest of backward
  // runs. An error from `ready` stops the computation and is returned.
  //
  // `part_ready`, if given, may be called before `ready` for a parameter
  // with a count of elements: the first `elements` of its gradient are
  // final (0 < elements < its size, growing from call to call), so a caller
  // can send them while the rest of that parameter is computed. A backend
  // that computes a large weight's gradient in blocks of rows reports each
  // block (the CPU backend); others never call it. Errors as for `ready`.
  using GradientReady = std::function<absl::Status(int param)>;
  using GradientPartReady =
      std::function<absl::Status(int param, int64_t elements)>;
  //
  // `first_layer_ahead`: the first layer's output for x was computed by
  // ForwardFirstLayer, every block of it and for as many rows, since the
  // last Gradients or Evaluate, from the weights SetParams gave since (the
  // caller vouches for x and the weights); FailedPrecondition when not, or
  // when not and SetParams left the first layer out.
  absl::StatusOr<double> Gradients(
      absl::Span<const float> x, absl::Span<const int32_t> labels, float scale,
      absl::Span<const absl::Span<float>> grads,
      const GradientReady& ready = nullptr,
      const GradientPartReady& part_ready = nullptr,
      bool first_layer_ahead = false);

  // The first layer's output, computed ahead of Gradients a block of its
  // output units at a time, as each block's weights arrive (a worker
  // computes the next step's first layer while this step's replies come).
  // The units in a block; the backend always computes the layer in these
  // blocks, so ahead or not the results are the same bits. 0: this backend
  // cannot (Gradients computes the layer).
  int first_layer_block() const { return DoFirstLayerBlock(); }
  // Units [begin, end) of the first layer's output for x (1 to max_batch
  // rows), from rows begin..end of `weight` and elements begin..end of
  // `bias` (the layer's whole parameter buffers; nothing else of them is
  // read). begin is a multiple of first_layer_block() and end the next
  // one, or the layer's width. FailedPrecondition before Init or when
  // first_layer_block() is 0; InvalidArgument for another range or sizes.
  absl::Status ForwardFirstLayer(absl::Span<const float> x, int begin, int end,
                                 absl::Span<const float> weight,
                                 absl::Span<const float> bias);

  // Forward only, over any number of rows (taken max_batch at a time).
  // Errors as for Gradients (FailedPrecondition also when SetParams left
  // the first layer out).
  absl::StatusOr<EvalResult> Evaluate(absl::Span<const float> x,
                                      absl::Span<const int32_t> labels);

 protected:
  // Called with validated arguments only; 1 <= b <= max_batch.
  virtual absl::Status DoInit(const ModelSpec& spec, int max_batch) = 0;
  // `first_layer` false (only where DoFirstLayerBlock() > 0): leave the
  // first layer's weight and bias (params[0] and [1]) as they are.
  virtual absl::Status DoSetParams(
      absl::Span<const absl::Span<const float>> params, bool first_layer) = 0;
  // May call `ready` (never null here) for parameters whose gradients
  // are final before it returns; the others are reported after it. May
  // call `part` (never null here) as Gradients documents `part_ready`.
  // `first_layer_ahead`: as Gradients', checked.
  virtual absl::StatusOr<double> DoGradients(
      const float* x, const int32_t* labels, int b, float scale,
      absl::Span<const absl::Span<float>> grads, const GradientReady& ready,
      const GradientPartReady& part, bool first_layer_ahead) = 0;
  virtual int DoFirstLayerBlock() const { return 0; }
  // Called with a validated block.
  virtual void DoForwardFirstLayer(const float* /*x*/, int /*b*/, int /*begin*/,
                                   int /*end*/, const float* /*weight*/,
                                   const float* /*bias*/) {}
  virtual absl::StatusOr<EvalResult> DoEvaluate(const float* x,
                                                const int32_t* labels,
                                                int b) = 0;

 private:
  absl::Status CheckBatch(absl::Span<const float> x,
                          absl::Span<const int32_t> labels) const;

  std::optional<ModelSpec> spec_;
  std::vector<ParamSpec> params_;  // spec_->Params(), for validation
  int max_batch_ = 0;
  bool has_params_ = false;
  bool first_layer_set_ = false;  // by the last SetParams
  // The blocks of the first layer computed ahead, and for how many rows.
  std::vector<bool> ahead_;
  int ahead_rows_ = 0;
};

// The reference backend: OpenBLAS sgemm using `threads` threads (OpenBLAS's
// setting is process-wide, so the last Init wins) plus plain loops.
// InvalidArgument if threads < 1.
absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(int threads = 1);

// A backend on CUDA device `device`. Unimplemented in a build without CUDA;
// FailedPrecondition "no CUDA device: ..." where no usable GPU (or driver)
// exists; InvalidArgument for a device number out of range.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device = 0);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_BACKEND_H_
