// Decoding of pushed gradient chunks: a payload is checked against its
// encoding and the chunk's size, then written as fp32 into the aggregation
// buffer, checked for NaN and infinity while it is in cache. Every wire
// encoding's decoder belongs here. Pure functions; thread-compatible.
#ifndef SHARDPS_SERVER_GRADIENT_DECODE_H_
#define SHARDPS_SERVER_GRADIENT_DECODE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/chunking.h"
#include "common/encoding.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// Where a gradient chunk came from, for error messages.
struct GradientOrigin {
  uint32_t rank = 0;
  const ChunkSpec* spec = nullptr;
  absl::string_view tensor;  // the chunk's tensor name
};

// InvalidArgument when `payload_bytes` of `encoding` cannot be a gradient of
// `num_elements` values (unsupported encoding, wrong length).
absl::Status CheckGradientPayload(v1::Encoding encoding, uint64_t payload_bytes,
                                  int64_t num_elements);

// Decodes `payload` (checked by CheckGradientPayload) into out[0,
// num_elements). InvalidArgument naming the chunk, tensor, rank and element
// when a value is NaN or infinite, unless `allow_nonfinite`. `out` is
// scratch: on error its contents are unspecified.
absl::Status DecodeGradient(v1::Encoding encoding, const ByteSource& payload,
                            const GradientOrigin& origin, bool allow_nonfinite,
                            float* out);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_GRADIENT_DECODE_H_
