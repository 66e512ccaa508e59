// Top-k selection for the TOPK encoding: the k largest |x + r| of a chunk,
// by a radix select on the bits of |y| (their integer order is the numeric
// order). One histogram of the high 16 bits finds the bin of the k-th
// largest, a second of the low 16 bits within that bin its exact bits t; a
// collect pass then takes, in index order, every |y| above t and the first
// (k - those above) equal to t, so the lower index wins a tie. O(n) and
// deterministic on every CPU. Thread-safe (scratch is per thread).
#ifndef SHARDPS_COMMON_TOPK_SELECT_H_
#define SHARDPS_COMMON_TOPK_SELECT_H_

#include <cstdint>

namespace shardps {

// Writes the TOPK payload of the k largest |x + r| (r: the residual, or
// null) into out (4 + 8k bytes: k, then k indices, then k values, in index
// order) and, with a residual, leaves in r the unsent y and 0 where sent.
// REQUIRES: 1 <= k <= n.
void SelectTopk(const float* x, float* r, int64_t n, int64_t k, char* out);

}  // namespace shardps

#endif  // SHARDPS_COMMON_TOPK_SELECT_H_
