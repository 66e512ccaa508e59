// NewCudaBackend for builds without the CUDA toolkit.
#include "worker/backend.h"

namespace shardps::worker {

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
  return absl::UnimplementedError(
      "this build has no CUDA backend (configure with nvcc available and "
      "SHARDPS_ENABLE_CUDA=ON)");
}

}  // namespace shardps::worker
