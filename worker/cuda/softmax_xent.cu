#include <cmath>

#include "worker/cuda/softmax_xent.cuh"

namespace shardps::worker {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // 256 threads: one warp per row
constexpr unsigned kFullMask = 0xffffffffu;

// Keeps the larger value, and on ties the lower index (as the CPU twin's
// first-maximum scan does).
__device__ void MaxWithIndex(float* value, int* index) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(kFullMask, *value, offset);
    const int i = __shfl_xor_sync(kFullMask, *index, offset);
    if (v > *value || (v == *value && i < *index)) {
      *value = v;
      *index = i;
    }
  }
}

// A butterfly sum leaves the same bits in every lane: each step adds the same
// two operands, and float addition is commutative.
__device__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__global__ void SoftmaxXentKernel(const float* logits, const int32_t* labels,
                                  int rows, int cols, float scale,
                                  float* dlogits, float* row_loss,
                                  int32_t* row_correct) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;  // uniform per warp, so shuffles stay full-warp
  const float* z = logits + static_cast<int64_t>(row) * cols;
  const int32_t y = labels[row];
  // Read before any lane can overwrite it when dlogits aliases logits; the
  // shuffles below order every read before every write.
  const float z_label = z[y];

  float best = -INFINITY;
  int best_index = cols;  // sentinel for lanes past the end
  if (lane < cols) {
    best = z[lane];
    best_index = lane;
  }
  for (int j = lane + kWarp; j < cols; j += kWarp) {
    if (z[j] > best) {
      best = z[j];
      best_index = j;
    }
  }
  MaxWithIndex(&best, &best_index);
  // Lane 0's view is the answer even if NaNs made the lanes disagree.
  const float m = __shfl_sync(kFullMask, best, 0);
  best_index = __shfl_sync(kFullMask, best_index, 0);

  float partial = 0.0f;
  for (int j = lane; j < cols; j += kWarp) partial += expf(z[j] - m);
  const float sum = WarpSum(partial);
  if (lane == 0) {
    row_loss[row] = logf(sum) - (z_label - m);
    row_correct[row] = best_index == y ? 1 : 0;
  }
  if (dlogits == nullptr) return;
  float* dz = dlogits + static_cast<int64_t>(row) * cols;
  const float inv_sum = 1.0f / sum;
  for (int j = lane; j < cols; j += kWarp) {
    dz[j] = scale * (expf(z[j] - m) * inv_sum - (j == y ? 1.0f : 0.0f));
  }
}

}  // namespace

cudaError_t LaunchSoftmaxXent(const float* logits, const int32_t* labels,
                              int rows, int cols, float scale, float* dlogits,
                              float* row_loss, int32_t* row_correct,
                              cudaStream_t stream) {
  const int blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  SoftmaxXentKernel<<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
      logits, labels, rows, cols, scale, dlogits, row_loss, row_correct);
  return cudaGetLastError();
}

}  // namespace shardps::worker
