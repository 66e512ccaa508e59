// NewCudaBackend and the GEMM roofline for builds without the CUDA toolkit.
#include "worker/backend.h"
#include "worker/gemm_roofline.h"

namespace shardps::worker {
namespace {
constexpr char kNoCuda[] =
    "this build has no CUDA backend (configure with nvcc available and "
    "SHARDPS_ENABLE_CUDA=ON)";
}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
  return absl::UnimplementedError(kNoCuda);
}

absl::StatusOr<absl::Duration> CublasStepGemmTime(const ModelSpec& spec,
                                                  int batch, int device,
                                                  int repeats) {
  return absl::UnimplementedError(kNoCuda);
}

}  // namespace shardps::worker
