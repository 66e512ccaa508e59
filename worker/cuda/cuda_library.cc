#include "worker/cuda/cuda_library.h"

#define SHARDPS_EXPORT __attribute__((visibility("default")))

extern "C" SHARDPS_EXPORT void* shardps_cuda_new_backend(int device,
                                                         absl::Status* status) {
  absl::StatusOr<std::unique_ptr<shardps::worker::Backend>> backend =
      shardps::worker::NewCudaBackendInLibrary(device);
  *status = backend.status();
  return backend.ok() ? backend->release() : nullptr;
}

extern "C" SHARDPS_EXPORT int64_t
shardps_cuda_gemm_time_ns(const void* model_spec, int batch, int device,
                          int repeats, absl::Status* status) {
  absl::StatusOr<absl::Duration> t =
      shardps::worker::CublasStepGemmTimeInLibrary(
          *static_cast<const shardps::worker::ModelSpec*>(model_spec), batch,
          device, repeats);
  *status = t.status();
  return t.ok() ? absl::ToInt64Nanoseconds(*t) : -1;
}
