#include "worker/cuda/softmax_xent_cpu.h"

#include <cmath>

namespace shardps::worker {

void SoftmaxXentCpu(const float* logits, const int32_t* labels, int rows,
                    int cols, float scale, float* dlogits, float* row_loss,
                    int32_t* row_correct) {
  for (int r = 0; r < rows; ++r) {
    const float* z = logits + static_cast<int64_t>(r) * cols;
    const int32_t y = labels[r];
    int argmax = 0;
    for (int j = 1; j < cols; ++j) {
      if (z[j] > z[argmax]) argmax = j;
    }
    const float m = z[argmax];
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) sum += std::exp(z[j] - m);
    row_loss[r] = std::log(sum) - (z[y] - m);
    row_correct[r] = argmax == y ? 1 : 0;
    if (dlogits == nullptr) continue;
    float* dz = dlogits + static_cast<int64_t>(r) * cols;
    const float inv_sum = 1.0f / sum;
    for (int j = 0; j < cols; ++j) {
      dz[j] = scale * (std::exp(z[j] - m) * inv_sum - (j == y ? 1.0f : 0.0f));
    }
  }
}

}  // namespace shardps::worker
