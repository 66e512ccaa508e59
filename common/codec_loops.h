// The codecs' loops (common/codec.h): bit-level conversions and one
// multiversioned function per encoder and decoder, each giving the same bits
// on every CPU (IEEE-exact operations, no FMA contraction). They check
// nothing: EncodePayload and DecodePayload check arguments and values.
// Thread-compatible (no state).
#ifndef SHARDPS_COMMON_CODEC_LOOPS_H_
#define SHARDPS_COMMON_CODEC_LOOPS_H_

#include <cstdint>

#include "shardps/v1/parameter_server.pb.h"

namespace shardps::codec_loops {

// The smallest magnitudes that round to infinity: 0x1.ffp127 (the tie above
// bfloat16's largest, 0x1.fep127, goes to the even infinity) and 65520
// (likewise above binary16's 65504).
inline constexpr uint32_t kBf16OverflowBits = 0x7f7f8000u;
inline constexpr uint32_t kFp16OverflowBits = 0x477ff000u;
inline constexpr float kFp16Max = 65504.0f;

// The largest |y| bits, y = x + r (r may be null): for non-negative
// binary32 the integer order is the numeric order, and anything from
// float_bits::kInfBits up is infinite or NaN.
uint32_t MaxAbsBits(const float* x, const float* r, int64_t n);

// Encoders of y = x + r into `out` (the payload's bytes); with r (else
// null) they leave in r what the payload dropped, y - decoded.
// EncodeInPlace takes FP32, BF16 or FP16 (REQUIRES: one of them); INT8 its
// scale s.
void EncodeInPlace(v1::Encoding encoding, const float* x, float* r, int64_t n,
                   char* out);
void EncodeInt8Payload(const float* x, float* r, int64_t n, float s, char* out);

// FP32, BF16 or FP16 (REQUIRES: one of them) with the residual out of
// place: y = x + rin, rout = y - decoded (both null without a residual;
// rout may be rin itself, which is what EncodeInPlace does).
// Returns MaxAbsBits of y, found in the same pass.
uint32_t EncodeTo(v1::Encoding encoding, const float* x, const float* rin,
                  float* rout, int64_t n, char* out);

// Decoders of a payload `in` into `out`: nonzero when some element is
// non-finite (fp32, bf16, fp16) or q is -128 (int8); the caller then finds
// which. INT8 takes its scale s.
// DecodeFloatPayload takes FP32, BF16 or FP16 (REQUIRES: one of them).
uint32_t DecodeFloatPayload(v1::Encoding encoding, const char* in, int64_t n,
                            float* out);
// The same, adding each element to sum[i] (one binary32 add) instead.
uint32_t AddFloatPayload(v1::Encoding encoding, const char* in, int64_t n,
                         float* sum);
// The same, writing nothing: only whether some element is non-finite.
uint32_t CheckFloatPayload(v1::Encoding encoding, const char* in, int64_t n);
uint32_t DecodeInt8Payload(const char* in, int64_t n, float s, float* out);

// bf16 <-> fp32 arrays (common/codec.h's EncodeBf16 and DecodeBf16).
void EncodeBf16Loop(const float* x, int64_t n, uint16_t* out);
void DecodeBf16Loop(const uint16_t* in, int64_t n, float* out);

}  // namespace shardps::codec_loops

#endif  // SHARDPS_COMMON_CODEC_LOOPS_H_
