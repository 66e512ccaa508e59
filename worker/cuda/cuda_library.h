// The entry points of libshardps_cuda.so, the CUDA backend as a shared
// library. Workers load it only when a GPU driver is present
// (worker/cuda_loader.cc): merely mapping cuBLAS costs ~215 MiB of resident
// memory, which a CPU-only worker must not pay. No CUDA types here.
#ifndef SHARDPS_WORKER_CUDA_CUDA_LIBRARY_H_
#define SHARDPS_WORKER_CUDA_CUDA_LIBRARY_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/backend.h"
#include "worker/model.h"

namespace shardps::worker {

// The implementations inside the library (see NewCudaBackend and
// CublasStepGemmTime for the contracts).
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackendInLibrary(int device);
absl::StatusOr<absl::Duration> CublasStepGemmTimeInLibrary(
    const ModelSpec& spec, int batch, int device, int repeats);

}  // namespace shardps::worker

// C entry points looked up with dlsym. Each writes its status to *status.
extern "C" {
// Returns a new Backend (owned by the caller) or null.
void* shardps_cuda_new_backend(int device, absl::Status* status);
// Returns the time in nanoseconds, or -1.
int64_t shardps_cuda_gemm_time_ns(const void* model_spec, int batch, int device,
                                  int repeats, absl::Status* status);
}

#endif  // SHARDPS_WORKER_CUDA_CUDA_LIBRARY_H_
