// Initial tensor values from a v1::InitSpec. Element i of tensor t depends only
// on (seed, t, i), never on how the tensor is chunked or which shard holds it,
// so every placement of a model starts from the same weights.
#ifndef SHARDPS_COMMON_TENSOR_INIT_H_
#define SHARDPS_COMMON_TENSOR_INIT_H_

#include <cstdint>

#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

// Fills out[0, n) with elements [offset, offset + n) of tensor `tensor`.
void FillInit(const v1::InitSpec& init, uint32_t tensor, int64_t offset,
              float* out, int64_t n);

}  // namespace shardps

#endif  // SHARDPS_COMMON_TENSOR_INIT_H_
