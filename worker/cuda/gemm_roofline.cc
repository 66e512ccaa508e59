// Host code only: cuBLAS calls timed with CUDA events.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_library.h"
#include "worker/cuda/cuda_status.h"

namespace shardps::worker {
namespace {

struct Gemm {
  int m, n, k;  // (m x k) times (k x n), row-major
};

// The products of one step: Y = X W^T, dW = dY^T X, dX = dY W per layer.
std::vector<Gemm> StepGemms(const ModelSpec& spec, int batch) {
  std::vector<Gemm> gemms;
  const std::vector<int64_t>& sizes = spec.layer_sizes();
  for (size_t l = 0; l + 1 < sizes.size(); ++l) {
    const int in = static_cast<int>(sizes[l]);
    const int out = static_cast<int>(sizes[l + 1]);
    gemms.push_back({batch, out, in});             // forward
    gemms.push_back({out, in, batch});             // weight gradient
    if (l > 0) gemms.push_back({batch, in, out});  // input gradient
  }
  return gemms;
}

struct CudaFree {
  void operator()(float* p) const { cudaFree(p); }
};

}  // namespace

absl::StatusOr<absl::Duration> CublasStepGemmTimeInLibrary(
    const ModelSpec& spec, int batch, int device, int repeats) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= device) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device));
  }
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const std::vector<Gemm> gemms = StepGemms(spec, batch);
  size_t largest = 0;
  for (const Gemm& g : gemms) {
    largest = std::max(
        {largest, size_t(g.m) * g.k, size_t(g.k) * g.n, size_t(g.m) * g.n});
  }
  std::unique_ptr<float, CudaFree> buf[3];
  for (auto& b : buf) {
    void* p = nullptr;
    SHARDPS_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, largest * sizeof(float)));
    b.reset(static_cast<float*>(p));
    SHARDPS_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, largest * sizeof(float)));
  }
  cublasHandle_t handle;
  SHARDPS_CUDA_RETURN_IF_ERROR(cublasCreate(&handle));
  std::unique_ptr<cublasContext, cublasStatus_t (*)(cublasHandle_t)> owned(
      handle, cublasDestroy);
  const float one = 1.0f, zero = 0.0f;
  auto run_step = [&]() -> absl::Status {
    for (const Gemm& g : gemms) {
      // Row-major C = A B is column-major C^T = B^T A^T.
      SHARDPS_CUDA_RETURN_IF_ERROR(cublasSgemm(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, g.n, g.m, g.k, &one, buf[1].get(),
          g.n, buf[0].get(), g.k, &zero, buf[2].get(), g.n));
    }
    return absl::OkStatus();
  };
  SHARDPS_RETURN_IF_ERROR(run_step());  // warm-up
  cudaEvent_t start, stop;
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
  for (int r = 0; r < repeats; ++r) SHARDPS_RETURN_IF_ERROR(run_step());
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  SHARDPS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return absl::Milliseconds(ms / repeats);
}

}  // namespace shardps::worker
