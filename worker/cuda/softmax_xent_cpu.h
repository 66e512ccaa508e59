// CPU reference for the fused softmax cross-entropy kernel (softmax_xent.cu):
// per-row loss, argmax hit and logit gradient. Used by the CPU backend and as
// the twin the CUDA kernel is tested against. Pure function; thread-safe.
#ifndef SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CPU_H_
#define SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CPU_H_

#include <cstdint>

namespace shardps::worker {

// For each row r of `logits` (rows x cols, row-major) with label y_r:
//   row_loss[r]    = log(sum_j exp(z_rj)) - z_{r,y_r}, computed as
//                    log(sum_j exp(z_rj - m_r)) - (z_{r,y_r} - m_r) with m_r
//                    the row maximum, so large logits cannot overflow;
//   row_correct[r] = 1 if the first maximal logit is at y_r, else 0;
//   dlogits[r][j]  = scale * (softmax(z_r)_j - [j == y_r]) unless dlogits is
//                    null; dlogits may alias logits.
// REQUIRES: cols >= 1 and every label in [0, cols).
void SoftmaxXentCpu(const float* logits, const int32_t* labels, int rows,
                    int cols, float scale, float* dlogits, float* row_loss,
                    int32_t* row_correct);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CUDA_SOFTMAX_XENT_CPU_H_
