// Turns CUDA runtime and cuBLAS results into absl::Status on the spot, for the
// host code of the CUDA backend and its tests. Out-of-memory becomes
// ResourceExhausted; every other failure is Internal.
#ifndef SHARDPS_WORKER_CUDA_CUDA_STATUS_H_
#define SHARDPS_WORKER_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardps::worker {

// `what` is the failed expression; file:line says where it ran.
inline absl::Status CudaToStatus(cudaError_t error, const char* what,
                                 const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(
      error == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                         : absl::StatusCode::kInternal,
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ") at ", file, ":", line));
}

inline absl::Status CudaToStatus(cublasStatus_t status, const char* what,
                                 const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::Status(
      status == CUBLAS_STATUS_ALLOC_FAILED
          ? absl::StatusCode::kResourceExhausted
          : absl::StatusCode::kInternal,
      absl::StrCat(what, ": ", cublasGetStatusName(status), " (",
                   cublasGetStatusString(status), ") at ", file, ":", line));
}

}  // namespace shardps::worker

// Returns a Status from the enclosing function when the cudaError_t or
// cublasStatus_t `expr` is not a success.
#define SHARDPS_CUDA_RETURN_IF_ERROR(expr) \
  SHARDPS_RETURN_IF_ERROR(                 \
      ::shardps::worker::CudaToStatus((expr), #expr, __FILE__, __LINE__))

#endif  // SHARDPS_WORKER_CUDA_CUDA_STATUS_H_
