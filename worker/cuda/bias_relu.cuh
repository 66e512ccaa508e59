// Elementwise kernels of a linear layer followed by ReLU, on the GPU: bias add
// with optional ReLU, ReLU backward and the bias-gradient column reduction.
// Plain C++ types at the boundary. CPU twins: bias_relu_cpu.h, whose
// comments define the results.
#ifndef SHARDPS_WORKER_CUDA_BIAS_RELU_CUH_
#define SHARDPS_WORKER_CUDA_BIAS_RELU_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardps::worker {

// Device-pointer versions of the CPU twins, enqueued on `stream`. Each returns
// the launch error, if any (cudaGetLastError()). REQUIRES: rows, cols, n >= 1.
cudaError_t LaunchBiasActivation(float* y, const float* bias, int rows,
                                 int cols, bool relu, cudaStream_t stream);
cudaError_t LaunchReluBackward(float* dy, const float* y, int64_t n,
                               cudaStream_t stream);
// Deterministic: a fixed summation order that does not depend on timing.
cudaError_t LaunchBiasGrad(const float* dy, int rows, int cols, float* db,
                           cudaStream_t stream);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CUDA_BIAS_RELU_CUH_
