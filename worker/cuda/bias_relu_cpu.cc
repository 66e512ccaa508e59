#include "worker/cuda/bias_relu_cpu.h"

#include <algorithm>

namespace shardps::worker {

void BiasActivationCpu(float* y, const float* bias, int rows, int cols,
                       bool relu) {
  // One pass, and selects rather than conditional stores, so that the
  // compiler vectorizes the loops.
  for (int r = 0; r < rows; ++r) {
    float* row = y + static_cast<int64_t>(r) * cols;
    if (relu) {
      // Written so that NaN propagates, as in the kernel.
      for (int j = 0; j < cols; ++j) {
        const float v = row[j] + bias[j];
        row[j] = v < 0.0f ? 0.0f : v;
      }
    } else {
      for (int j = 0; j < cols; ++j) row[j] += bias[j];
    }
  }
}

void ReluBackwardCpu(float* dy, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dy[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

void BiasGradCpu(const float* dy, int rows, int cols, float* db) {
  std::fill_n(db, cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* row = dy + static_cast<int64_t>(r) * cols;
    for (int j = 0; j < cols; ++j) db[j] += row[j];
  }
}

}  // namespace shardps::worker
