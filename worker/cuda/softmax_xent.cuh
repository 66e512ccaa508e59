// Fused softmax cross-entropy on the GPU: one warp per row computes the row's
// loss, argmax hit and logit gradient. Plain C++ types at the boundary (no
// Abseil), so host code compiled by the C++ compiler can call it. CPU twin:
// softmax_xent_cpu.h, whose comment defines the results.
#ifndef SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CUH_
#define SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardps::worker {

// Device-pointer version of SoftmaxXentCpu, enqueued on `stream`. Returns the
// launch error, if any (cudaGetLastError()).
// REQUIRES: as SoftmaxXentCpu; rows >= 1.
cudaError_t LaunchSoftmaxXent(const float* logits, const int32_t* labels,
                              int rows, int cols, float scale, float* dlogits,
                              float* row_loss, int32_t* row_correct,
                              cudaStream_t stream);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CUH_
