#include <algorithm>

#include "worker/cuda/bias_relu.cuh"

namespace shardps::worker {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops need no more blocks than keep every SM busy.
constexpr int64_t kMaxBlocks = 4096;

int BlocksFor(int64_t n) {
  return static_cast<int>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

__global__ void BiasActivationKernel(float* y, const float* bias, int64_t n,
                                     int cols, bool relu) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float v = y[i] + bias[i % cols];
    if (relu && v < 0.0f) v = 0.0f;  // NaN propagates, as in the twin
    y[i] = v;
  }
}

__global__ void ReluBackwardKernel(float* dy, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (!(y[i] > 0.0f)) dy[i] = 0.0f;
  }
}

// Block (32, 8) covers 32 columns: thread (x, t) sums rows t, t + 8, ... of
// column x, then row 0 adds the 8 partial sums in order. Reads are coalesced
// along rows and the order is fixed, so results are reproducible.
constexpr int kGradCols = 32;
constexpr int kGradRowGroups = 8;

__global__ void BiasGradKernel(const float* dy, int rows, int cols, float* db) {
  __shared__ float partial[kGradRowGroups][kGradCols];
  const int col = blockIdx.x * kGradCols + threadIdx.x;
  float sum = 0.0f;
  if (col < cols) {
    for (int r = threadIdx.y; r < rows; r += kGradRowGroups) {
      sum += dy[static_cast<int64_t>(r) * cols + col];
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
    for (int g = 0; g < kGradRowGroups; ++g) total += partial[g][threadIdx.x];
    db[col] = total;
  }
}

}  // namespace

cudaError_t LaunchBiasActivation(float* y, const float* bias, int rows,
                                 int cols, bool relu, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * cols;
  BiasActivationKernel<<<BlocksFor(n), kThreads, 0, stream>>>(y, bias, n, cols,
                                                              relu);
  return cudaGetLastError();
}

cudaError_t LaunchReluBackward(float* dy, const float* y, int64_t n,
                               cudaStream_t stream) {
  ReluBackwardKernel<<<BlocksFor(n), kThreads, 0, stream>>>(dy, y, n);
  return cudaGetLastError();
}

cudaError_t LaunchBiasGrad(const float* dy, int rows, int cols, float* db,
                           cudaStream_t stream) {
  const dim3 block(kGradCols, kGradRowGroups);
  const int blocks = (cols + kGradCols - 1) / kGradCols;
  BiasGradKernel<<<blocks, block, 0, stream>>>(dy, rows, cols, db);
  return cudaGetLastError();
}

}  // namespace shardps::worker
