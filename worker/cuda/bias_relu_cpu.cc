#include "worker/cuda/bias_relu_cpu.h"

#include <algorithm>

namespace shardps::worker {

void BiasActivationCpu(float* y, const float* bias, int rows, int cols,
                       bool relu) {
  for (int r = 0; r < rows; ++r) {
    float* row = y + static_cast<int64_t>(r) * cols;
    for (int j = 0; j < cols; ++j) row[j] += bias[j];
    if (relu) {
      // Written so that NaN propagates, as in the kernel.
      for (int j = 0; j < cols; ++j) {
        if (row[j] < 0.0f) row[j] = 0.0f;
      }
    }
  }
}

void ReluBackwardCpu(float* dy, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!(y[i] > 0.0f)) dy[i] = 0.0f;
  }
}

void BiasGradCpu(const float* dy, int rows, int cols, float* db) {
  std::fill_n(db, cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* row = dy + static_cast<int64_t>(r) * cols;
    for (int j = 0; j < cols; ++j) db[j] += row[j];
  }
}

}  // namespace shardps::worker
