// Gradient codecs: the lossy wire encodings of v1::Encoding (BF16, FP16,
// INT8, TOPK) and FP32, with optional error feedback, encoded and decoded
// bitwise identically on every CPU. Pure functions; thread-safe.
#ifndef SHARDPS_COMMON_CODEC_H_
#define SHARDPS_COMMON_CODEC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/encoding.h"
#include "shardps/v1/parameter_server.pb.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "payloads are little-endian and copied as is");

namespace shardps {

// Bytes of a payload of `encoding` for `n` elements: FP32 4n, BF16 and FP16
// 2n, INT8 4 + n, TOPK 4 + 8k (`k` elements kept; `n` unused). -1 for
// UNSPECIFIED or an unknown encoding (normalise with EffectiveEncoding).
int64_t EncodedBytes(v1::Encoding encoding, int64_t n, int64_t k = 0);

// Elements a TOPK encoder keeps of `n`: clamp(ceil(ratio * n), 1, n), the
// product taken in double. 0 when n <= 0. REQUIRES: ratio in (0, 1]; a ratio
// below (or NaN) gives 1, above gives n.
int64_t TopkCount(int64_t n, double ratio);

// Encodes x[0, n) as `encoding` into *out, resized to EncodedBytes. The
// payloads, all little-endian:
//   FP32  n binary32, copied.
//   BF16  n uint16: the high half of each binary32, rounded to nearest even.
//   FP16  n IEEE binary16, rounded to nearest even, subnormals kept.
//   INT8  binary32 scale s = max(max|x| / 127, FLT_MIN) (FLT_MIN = 2^-126,
//         the smallest normal, when the maximum is tiny or zero), then n int8
//         q = clamp(rint(x / s), -127, 127), ties to even; value = q * s.
//         Should 127 * s overflow, s steps down one ulp so no value decodes
//         to infinity.
//   TOPK  uint32 k = TopkCount(n, topk_ratio), k uint32 indices ascending,
//         then their k binary32 values: the k largest |x|, the lower index
//         first among equals (so the set is unique).
// With `residual` (n floats, in/out; error feedback) the encoder compresses
// y = x + residual (one binary32 add) and leaves in residual y - decoded,
// exactly: for TOPK the unsent y and 0 where sent, for FP32 all 0. With
// `residual` null nothing is kept. `topk_ratio` is read for TOPK only.
// InvalidArgument naming the element when a value is not finite or would not
// fit (FP16 from 65520 up: binary16's largest is 65504; BF16 from
// 0x1.ffp127 = 3.3961775e38 up), for an unsupported encoding, n < 0, or TOPK
// with n = 0, n >= 2^32 or `topk_ratio` outside (0, 1]. On error *out and
// *residual are unchanged.
absl::Status EncodePayload(v1::Encoding encoding, const float* x, int64_t n,
                           double topk_ratio, float* residual,
                           std::string* out);

// EncodePayload with the residual out of place: it encodes y = x +
// residual_in and writes y - decoded to residual_out (n floats each, not
// overlapping each other or x; both null for no error feedback), so that the
// caller keeps residual_in without copying it. FP32, BF16 and FP16 check
// the values while encoding them, one pass instead of two. The same bits
// and the same errors as EncodePayload, but on error *out and *residual_out
// hold unspecified values (residual_in is never written).
// With `y_max`, the largest |y| encoded goes there.
absl::Status EncodePayloadTo(v1::Encoding encoding, const float* x, int64_t n,
                             double topk_ratio, const float* residual_in,
                             float* residual_out, std::string* out,
                             float* y_max = nullptr);

// The check EncodePayload makes first, alone: InvalidArgument naming the
// element when x + residual (residual may be null) holds a value `encoding`
// cannot carry (non-finite, or beyond FP16's or BF16's range).
absl::Status CheckEncodable(v1::Encoding encoding, const float* x,
                            const float* residual, int64_t n);

// At least the largest |residual| that encoding values of at most `y_max`
// in magnitude can leave (error feedback's y - decoded), with room to
// spare: 2^-7 y_max + 2^-133 for BF16, 2^-10 y_max + 2^-24 for FP16,
// y_max / 127 + 2^-125 for INT8, y_max for TOPK, 0 for FP32.
float ResidualBound(v1::Encoding encoding, float y_max);

// CheckEncodable where |residual| <= residual_max is known (a
// ResidualBound): when x's largest magnitude plus residual_max is well
// inside what `encoding` carries, x + residual can be encoded whatever the
// residual, and only x is read; otherwise the exact CheckEncodable, its
// result and message.
absl::Status CheckEncodableWithin(v1::Encoding encoding, const float* x,
                                  const float* residual, float residual_max,
                                  int64_t n);

// Decodes `payload`, `n` elements of `encoding`, into out[0, n) (TOPK: zero
// but for the k elements sent). InvalidArgument naming the problem and the
// element or entry: a length that does not fit `n` (for TOPK: k = 0, k > n,
// or not 4 + 8k bytes); an index >= n, repeated or not ascending; an INT8
// scale that is zero, negative, subnormal, NaN or infinite, or a q of -128;
// and, unless `allow_nonfinite`, a NaN or infinite value (INT8: a scale whose
// 127 * s overflows). On error the contents of `out` are unspecified.
absl::Status DecodePayload(v1::Encoding encoding, absl::string_view payload,
                           int64_t n, bool allow_nonfinite, float* out);

// The same from bytes in pieces (the slices a message arrived in): FP32,
// BF16 and FP16 are decoded where they lie, an element split between two
// pieces through a few bytes of scratch; INT8 and TOPK, which need the
// whole payload at once, are gathered into a thread's scratch first. The
// same bits and errors as DecodePayload of the bytes joined.
absl::Status DecodePayload(v1::Encoding encoding, const ByteSource& payload,
                           int64_t n, bool allow_nonfinite, float* out);

// sum[i] += element i of the decoded `payload`, for i in [0, n), each one
// binary32 add: the same bits as DecodePayload into scratch and adding that,
// and the same errors, but FP32, BF16 and FP16 go from the pieces straight
// into the sum (a pass that checks the values, then one that adds them).
// On error `sum` is unchanged.
absl::Status AddDecodedPayload(v1::Encoding encoding, const ByteSource& payload,
                               int64_t n, bool allow_nonfinite, float* sum);

// OK when DecodePayload would accept `payload`, its error otherwise,
// without writing anything (FP32, BF16 and FP16: one pass that only looks).
absl::Status CheckDecodable(v1::Encoding encoding, const ByteSource& payload,
                            int64_t n, bool allow_nonfinite);

// FP32, BF16 and FP16: what the ByteSource decoders read where it lies.
bool DecodesInPieces(v1::Encoding encoding);

// Decodes a payload of FP32, BF16 or FP16 whose length CheckDecodable (or
// DecodePayload) accepted into out, element by element, from its pieces:
// writing each value (add false) or adding it (one binary32 add). Returns
// nonzero when some value was non-finite, and never fails.
uint32_t DecodeCheckedPayload(v1::Encoding encoding, const ByteSource& payload,
                              bool add, float* out);

// Writes x[0, n) as bfloat16, rounded to nearest even, into out[0, n): the
// reply path's weights. Never fails: a NaN stays a (quiet) NaN, and a value
// of magnitude 0x1.ffp127 (3.3961775e38) or more becomes infinity.
void EncodeBf16(const float* x, int64_t n, uint16_t* out);

// Widens bfloat16 in[0, n) into out[0, n) exactly.
void DecodeBf16(const uint16_t* in, int64_t n, float* out);

}  // namespace shardps

#endif  // SHARDPS_COMMON_CODEC_H_
