// CPU references for the elementwise kernels of a linear layer followed by
// ReLU (bias_relu.cu): bias add with optional ReLU, ReLU backward, and the
// bias gradient. Used by the CPU backend and as the twins the CUDA kernels
// are tested against. Pure functions; thread-safe.
#ifndef SHARDPS_WORKER_CUDA_BIAS_RELU_CPU_H_
#define SHARDPS_WORKER_CUDA_BIAS_RELU_CPU_H_

#include <cstdint>

namespace shardps::worker {

// y (rows x cols, row-major) += bias (cols) on every row, then
// y = max(y, 0) if relu.
void BiasActivationCpu(float* y, const float* bias, int rows, int cols,
                       bool relu);

// dy[i] = 0 wherever y[i] <= 0, for the n elements of a ReLU's output y (the
// ReLU's derivative, since y > 0 exactly where its input was > 0).
void ReluBackwardCpu(float* dy, const float* y, int64_t n);

// db[j] = sum over rows of dy[r][j], for dy (rows x cols, row-major).
void BiasGradCpu(const float* dy, int rows, int cols, float* db);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CUDA_BIAS_RELU_CPU_H_
