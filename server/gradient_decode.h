// Decoding of pushed gradient chunks: a payload is checked against its
// encoding (one the shard accepts) and the chunk's size, then written as fp32
// into the aggregation buffer, checked for NaN and infinity. The codecs
// themselves are common/codec.h. Pure functions; thread-compatible.
#ifndef SHARDPS_SERVER_GRADIENT_DECODE_H_
#define SHARDPS_SERVER_GRADIENT_DECODE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// A set of gradient encodings: bit e for v1::Encoding e.
using EncodingSet = uint32_t;
inline constexpr EncodingSet EncodingBit(v1::Encoding e) {
  return EncodingSet{1} << static_cast<int>(e);
}
inline constexpr EncodingSet kAllGradientEncodings =
    EncodingBit(v1::ENCODING_FP32) | EncodingBit(v1::ENCODING_BF16) |
    EncodingBit(v1::ENCODING_FP16) | EncodingBit(v1::ENCODING_INT8) |
    EncodingBit(v1::ENCODING_TOPK);

// Parses shardps-server --encodings: "all", or a comma-separated list of
// fp32, bf16, fp16, int8, topk. InvalidArgument naming an unknown one.
absl::StatusOr<EncodingSet> ParseEncodingSet(absl::string_view list);
// The set as encoding names ("ENCODING_FP32", ...), in enum order.
std::vector<std::string> EncodingSetNames(EncodingSet set);

// InvalidArgument when `payload_bytes` of `encoding` cannot be a gradient of
// `num_elements` values (unknown encoding, wrong length) or `encoding` is
// not in `accepted`.
absl::Status CheckGradientPayload(v1::Encoding encoding, uint64_t payload_bytes,
                                  int64_t num_elements,
                                  EncodingSet accepted = kAllGradientEncodings);

// Decodes `payload` (checked by CheckGradientPayload) into out[0,
// num_elements). InvalidArgument naming the chunk, tensor, rank and element
// when a value is NaN or infinite, unless `allow_nonfinite`. `out` is
// scratch: on error its contents are unspecified.
absl::Status DecodeGradient(v1::Encoding encoding, const ByteSource& payload,
                            const GradientOrigin& origin, bool allow_nonfinite,
                            float* out);

// sum[i] += element i of the decoded `payload` (one binary32 add each):
// the same bits as DecodeGradient into scratch and adding that, and the
// same errors, but the usual encodings go straight from the received
// slices into the sum. On error `sum` is unchanged.
absl::Status AddGradient(v1::Encoding encoding, const ByteSource& payload,
                         const GradientOrigin& origin, bool allow_nonfinite,
                         float* sum);

// OK when DecodeGradient would accept `payload`, its error otherwise;
// writes nothing.
absl::Status CheckGradient(v1::Encoding encoding, const ByteSource& payload,
                           const GradientOrigin& origin, bool allow_nonfinite);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_GRADIENT_DECODE_H_
