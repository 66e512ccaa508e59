// The CUDA backend: cuBLAS GEMMs plus the kernels of bias_relu.cu and
// softmax_xent.cu. Inputs, parameters and gradients pass through pinned host
// buffers; each layer's gradients are copied back on a second stream while
// the backward pass goes on with the layers below. Host code only (compiled
// by the C++ compiler); the device code lives in the .cu files.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/backend.h"
#include "worker/cuda/bias_relu.cuh"
#include "worker/cuda/cuda_status.h"
#include "worker/cuda/softmax_xent.cuh"

namespace shardps::worker {
namespace {

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T[], DeviceFree>;
template <typename T>
using PinnedPtr = std::unique_ptr<T[], PinnedFree>;

template <typename T>
absl::Status DeviceAlloc(size_t n, DevicePtr<T>* out) {
  void* p = nullptr;
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, n * sizeof(T)));
  out->reset(static_cast<T*>(p));
  return absl::OkStatus();
}

template <typename T>
absl::Status PinnedAlloc(size_t n, PinnedPtr<T>* out) {
  void* p = nullptr;
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, n * sizeof(T), 0));
  out->reset(static_cast<T*>(p));
  return absl::OkStatus();
}

// c (m, n) = op(a) (m, k) * op(b) (k, n), all row-major with leading
// dimensions lda, ldb, ldc. cuBLAS is column-major, where row-major c is c^T
// = op(b)^T op(a)^T: the same call with the operands swapped.
absl::Status RowMajorGemm(cublasHandle_t handle, bool trans_a, bool trans_b,
                          int m, int n, int k, const float* a, int lda,
                          const float* b, int ldb, float* c, int ldc) {
  const float one = 1.0f;
  const float zero = 0.0f;
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cublasSgemm(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                  trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &one, b, ldb, a,
                  lda, &zero, c, ldc));
  return absl::OkStatus();
}

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(int device);
  ~CudaBackend() override;
  std::string name() const override { return name_; }

 protected:
  absl::Status DoInit(const ModelSpec& spec, int max_batch) override;
  // Always the first layer too: this backend computes it in the step.
  absl::Status DoSetParams(absl::Span<const absl::Span<const float>> params,
                           bool first_layer) override;
  // Reports every gradient after the one copy back (Backend does).
  absl::StatusOr<double> DoGradients(const float* x, const int32_t* labels,
                                     int b, float scale,
                                     absl::Span<const absl::Span<float>> grads,
                                     const GradientReady& ready,
                                     const GradientPartReady& part,
                                     bool first_layer_ahead) override;
  absl::StatusOr<EvalResult> DoEvaluate(const float* x, const int32_t* labels,
                                        int b) override;

 private:
  CudaBackend(int device, std::string name)
      : device_(device), name_(std::move(name)) {}
  absl::Status CreateStreams();
  int num_layers() const { return static_cast<int>(sizes_.size()) - 1; }
  float* d_weight(int l) { return d_params_.get() + offsets_[2 * l]; }
  float* d_bias(int l) { return d_params_.get() + offsets_[2 * l + 1]; }
  const float* d_input(int l) {
    return l == 0 ? d_x_.get() : d_acts_[l - 1].get();
  }
  // Copies the batch to the device and runs the forward pass and the fused
  // softmax cross-entropy (gradient into d_delta_[0] unless evaluating).
  absl::Status ForwardAndLoss(const float* x, const int32_t* labels, int b,
                              float scale, bool want_gradient);
  absl::Status Backward(int b);
  // Waits for `stream` and sums the row results copied to the host.
  absl::StatusOr<EvalResult> FinishRows(int b);

  const int device_;
  const std::string name_;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_ = nullptr;  // gradient downloads, overlapping compute
  cublasHandle_t cublas_ = nullptr;
  std::vector<cudaEvent_t> layer_done_;  // per layer: its gradients are ready

  std::vector<int> sizes_;       // layer widths, input first
  std::vector<size_t> offsets_;  // of each parameter in the flat arrays
  DevicePtr<float> d_params_, d_grads_, d_x_, d_row_loss_;
  DevicePtr<float> d_delta_[2];           // (max_batch, max width), ping-pong
  std::vector<DevicePtr<float>> d_acts_;  // d_acts_[l]: (max_batch, width l+1)
  DevicePtr<int32_t> d_labels_, d_row_correct_;
  PinnedPtr<float> h_params_, h_grads_, h_x_, h_row_loss_;
  PinnedPtr<int32_t> h_labels_, h_row_correct_;
};

absl::StatusOr<std::unique_ptr<Backend>> CudaBackend::Create(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it, so later calls do not report it again
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device: ",
        error != cudaSuccess ? cudaGetErrorString(error) : "0 devices"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", device, " out of range: ", count, " device(s)"));
  }
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop;
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  std::unique_ptr<CudaBackend> backend(new CudaBackend(
      device, absl::StrCat("cuda:", device, " (", prop.name, ")")));
  SHARDPS_RETURN_IF_ERROR(backend->CreateStreams());
  return backend;
}

absl::Status CudaBackend::CreateStreams() {
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  SHARDPS_CUDA_RETURN_IF_ERROR(cublasCreate(&cublas_));
  SHARDPS_CUDA_RETURN_IF_ERROR(cublasSetStream(cublas_, compute_));
  // Plain FP32 GEMMs (no TF32), so results stay within float rounding of the
  // CPU reference.
  SHARDPS_CUDA_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  // Errors cannot be reported from here; the buffers are freed after this
  // body, with the device still current.
  cudaSetDevice(device_);
  if (compute_ != nullptr) cudaStreamSynchronize(compute_);
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  for (cudaEvent_t e : layer_done_) cudaEventDestroy(e);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (compute_ != nullptr) cudaStreamDestroy(compute_);
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
}

absl::Status CudaBackend::DoInit(const ModelSpec& spec, int max_batch) {
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  sizes_.assign(spec.layer_sizes().begin(), spec.layer_sizes().end());
  offsets_.clear();
  size_t total = 0;
  for (int l = 0; l < num_layers(); ++l) {
    offsets_.push_back(total);
    total += static_cast<size_t>(sizes_[l]) * sizes_[l + 1];
    offsets_.push_back(total);
    total += sizes_[l + 1];
  }
  offsets_.push_back(total);
  const size_t rows = max_batch;
  const size_t in = sizes_[0];
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(total, &d_params_));
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(total, &d_grads_));
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows * in, &d_x_));
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows, &d_row_loss_));
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows, &d_labels_));
  SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows, &d_row_correct_));
  for (DevicePtr<float>& d : d_delta_) {
    SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows * spec.max_width(), &d));
  }
  d_acts_.resize(num_layers());
  for (int l = 0; l < num_layers(); ++l) {
    SHARDPS_RETURN_IF_ERROR(DeviceAlloc(rows * sizes_[l + 1], &d_acts_[l]));
  }
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(total, &h_params_));
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(total, &h_grads_));
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(rows * in, &h_x_));
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(rows, &h_row_loss_));
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(rows, &h_labels_));
  SHARDPS_RETURN_IF_ERROR(PinnedAlloc(rows, &h_row_correct_));
  while (static_cast<int>(layer_done_.size()) < num_layers()) {
    cudaEvent_t e = nullptr;
    SHARDPS_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    layer_done_.push_back(e);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSetParams(
    absl::Span<const absl::Span<const float>> params, bool /*first_layer*/) {
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // The previous upload may still be reading the pinned buffer.
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  for (size_t i = 0; i < params.size(); ++i) {
    std::memcpy(h_params_.get() + offsets_[i], params[i].data(),
                params[i].size() * sizeof(float));
  }
  // Stream order puts the next step's kernels after this copy; no wait here.
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      d_params_.get(), h_params_.get(), offsets_.back() * sizeof(float),
      cudaMemcpyHostToDevice, compute_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ForwardAndLoss(const float* x, const int32_t* labels,
                                         int b, float scale,
                                         bool want_gradient) {
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // Normally idle by now (the last step waited, the parameter upload ran
  // while the caller built this batch); a failed step may have left copies
  // that still read the pinned input buffers.
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  std::memcpy(h_x_.get(), x, sizeof(float) * b * sizes_[0]);
  std::memcpy(h_labels_.get(), labels, sizeof(int32_t) * b);
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_x_.get(), h_x_.get(), sizeof(float) * b * sizes_[0],
                      cudaMemcpyHostToDevice, compute_));
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_labels_.get(), h_labels_.get(), sizeof(int32_t) * b,
                      cudaMemcpyHostToDevice, compute_));
  for (int l = 0; l < num_layers(); ++l) {
    const int in = sizes_[l];
    const int out = sizes_[l + 1];
    // act (b, out) = input (b, in) * W^T, W being (out, in).
    SHARDPS_RETURN_IF_ERROR(RowMajorGemm(cublas_, false, true, b, out, in,
                                         d_input(l), in, d_weight(l), in,
                                         d_acts_[l].get(), out));
    SHARDPS_CUDA_RETURN_IF_ERROR(
        LaunchBiasActivation(d_acts_[l].get(), d_bias(l), b, out,
                             /*relu=*/l + 1 < num_layers(), compute_));
  }
  SHARDPS_CUDA_RETURN_IF_ERROR(LaunchSoftmaxXent(
      d_acts_[num_layers() - 1].get(), d_labels_.get(), b, sizes_.back(), scale,
      want_gradient ? d_delta_[0].get() : nullptr, d_row_loss_.get(),
      d_row_correct_.get(), compute_));
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(h_row_loss_.get(), d_row_loss_.get(), sizeof(float) * b,
                      cudaMemcpyDeviceToHost, compute_));
  SHARDPS_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(h_row_correct_.get(), d_row_correct_.get(),
                      sizeof(int32_t) * b, cudaMemcpyDeviceToHost, compute_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Backward(int b) {
  float* dz = d_delta_[0].get();  // d(loss)/d(pre-activation) of layer l
  float* da = d_delta_[1].get();  // d(loss)/d(input) of layer l
  for (int l = num_layers() - 1; l >= 0; --l) {
    const int in = sizes_[l];
    const int out = sizes_[l + 1];
    float* d_grad_w = d_grads_.get() + offsets_[2 * l];
    float* d_grad_b = d_grads_.get() + offsets_[2 * l + 1];
    // dW (out, in) = dz^T (out, b) * input (b, in); db = column sums of dz.
    SHARDPS_RETURN_IF_ERROR(RowMajorGemm(cublas_, true, false, out, in, b, dz,
                                         out, d_input(l), in, d_grad_w, in));
    SHARDPS_CUDA_RETURN_IF_ERROR(
        LaunchBiasGrad(dz, b, out, d_grad_b, compute_));
    // Download this layer's weight and bias gradients (adjacent in the flat
    // array) while the layers below are computed.
    SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_done_[l], compute_));
    SHARDPS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, layer_done_[l], 0));
    SHARDPS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(h_grads_.get() + offsets_[2 * l], d_grad_w,
                        sizeof(float) * (offsets_[2 * l + 2] - offsets_[2 * l]),
                        cudaMemcpyDeviceToHost, copy_));
    if (l == 0) break;
    // da (b, in) = dz (b, out) * W (out, in), then back through the ReLU that
    // produced this layer's input.
    SHARDPS_RETURN_IF_ERROR(RowMajorGemm(cublas_, false, false, b, in, out, dz,
                                         out, d_weight(l), in, da, in));
    SHARDPS_CUDA_RETURN_IF_ERROR(LaunchReluBackward(
        da, d_acts_[l - 1].get(), static_cast<int64_t>(b) * in, compute_));
    std::swap(dz, da);
  }
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_));
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> CudaBackend::FinishRows(int b) {
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  // Summed in double, in row order: reproducible, and the same order as the
  // CPU backend.
  double sum = 0.0;
  EvalResult result;
  for (int r = 0; r < b; ++r) {
    sum += h_row_loss_[r];
    result.correct += h_row_correct_[r];
  }
  result.mean_loss = sum / b;
  return result;
}

absl::StatusOr<double> CudaBackend::DoGradients(
    const float* x, const int32_t* labels, int b, float scale,
    absl::Span<const absl::Span<float>> grads, const GradientReady& /*ready*/,
    const GradientPartReady& /*part*/, bool /*first_layer_ahead*/) {
  SHARDPS_RETURN_IF_ERROR(
      ForwardAndLoss(x, labels, b, scale, /*want_gradient=*/true));
  SHARDPS_RETURN_IF_ERROR(Backward(b));
  SHARDPS_ASSIGN_OR_RETURN(const EvalResult rows, FinishRows(b));
  for (size_t i = 0; i < grads.size(); ++i) {
    std::memcpy(grads[i].data(), h_grads_.get() + offsets_[i],
                grads[i].size() * sizeof(float));
  }
  return rows.mean_loss;
}

absl::StatusOr<EvalResult> CudaBackend::DoEvaluate(const float* x,
                                                   const int32_t* labels,
                                                   int b) {
  SHARDPS_RETURN_IF_ERROR(
      ForwardAndLoss(x, labels, b, 1.0f, /*want_gradient=*/false));
  return FinishRows(b);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackendInLibrary(int device) {
  return CudaBackend::Create(device);
}

}  // namespace shardps::worker
