// The GEMM roofline of a training step on a GPU: the time cuBLAS takes for
// the matrix products alone of one forward and backward pass, with every
// operand already on the device. The CUDA backend's step can approach it, not
// beat it; shardps-bench gpu reports the ratio. No CUDA types here.
#ifndef SHARDPS_WORKER_GEMM_ROOFLINE_H_
#define SHARDPS_WORKER_GEMM_ROOFLINE_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/model.h"

namespace shardps::worker {

// Mean time of the step's GEMMs (per layer: forward, weight gradient, and
// input gradient except for the first layer) at batch `batch` on `device`,
// over `repeats` runs after a warm-up. Unimplemented in a build without
// CUDA; FailedPrecondition when there is no GPU.
absl::StatusOr<absl::Duration> CublasStepGemmTime(const ModelSpec& spec,
                                                  int batch, int device,
                                                  int repeats);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_GEMM_ROOFLINE_H_
