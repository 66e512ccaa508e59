#include "common/codec_loops.h"

#include <algorithm>
#include <cstdint>

#include "common/float_bits.h"
#include "common/multiversion.h"

namespace shardps::codec_loops {

using float_bits::Bits;
using float_bits::FromBits;
using float_bits::kAbsMask;
using float_bits::kInfBits;
using float_bits::Load16;
using float_bits::Load32;
using float_bits::Store16;
using float_bits::Store32;
using float_bits::Sum;

namespace {

// ---------------------------------------------------------------------------
// Bit-level conversions: integer operations, and floating-point ones only
// where the result is exact, so that every vector width gives the same bits
// and a denormals-are-zero mode changes nothing.

// binary32 bits -> bfloat16, rounded to nearest even: adding 0x7fff plus the
// kept half's lowest bit carries exactly when the dropped half is above the
// midpoint, or at it with an odd kept half. A NaN comes out a quiet NaN
// (rounding its payload could carry into infinity).
[[gnu::always_inline]] inline uint32_t Bf16FromBits(uint32_t b) {
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x40u;
  return (b & kAbsMask) > kInfBits ? quiet_nan : rounded;
}

// binary32 bits -> binary16, rounded to nearest even. REQUIRES: |x| < 65520
// (the result is meaningless for larger values, infinities and NaN).
[[gnu::always_inline]] inline uint32_t Fp16FromBits(uint32_t b) {
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & kAbsMask;
  // |x| >= 2^-14, a normal binary16: rebias the exponent (127 -> 15) and
  // round away the 13 low mantissa bits as in Bf16FromBits; a carry ripples
  // into the exponent.
  const uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  // |x| < 2^-14: the result is m = rint(|x| * 2^24) (a subnormal m * 2^-24,
  // or 0x400, the smallest normal). With the implicit bit, |x| = mant *
  // 2^(e - 150), so m = rint(mant >> (126 - e)). A shift of 31 leaves
  // nothing but a remainder below the half: every |x| < 2^-25 gives 0. (The
  // shift is kept in [1, 31] for the normal inputs, whose `sub` is unused.)
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = std::max(std::min(126u - e, 31u), 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rem = mant & ((half << 1) - 1);
  uint32_t sub = mant >> shift;
  sub += static_cast<uint32_t>(rem > half) |
         (static_cast<uint32_t>(rem == half) & sub);
  return sign | (a < 0x38800000u ? sub : normal);
}

// binary16 -> binary32 bits, exactly.
[[gnu::always_inline]] inline uint32_t BitsFromFp16(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  // Normal: rebias the exponent (15 -> 127); infinity and NaN (exponent 31)
  // get 255 instead.
  const uint32_t rebias = 0x38000000u
                          << static_cast<uint32_t>(magnitude >= 0x7c00u);
  const uint32_t normal = (magnitude << 13) + rebias;
  // Zero or subnormal m * 2^-24 (m < 1024): m converts to binary32 exactly,
  // and so does the product (a normal binary32 or zero). Computed for every
  // h, so that the loop has no branch around a floating-point operation.
  const uint32_t sub =
      Bits(static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(magnitude < 0x400u);
  return sign | (sub & is_sub) | (normal & ~is_sub);
}

// 1.5 * 2^23: for |t| <= 2^22, t + kRoundMagic lies in [2^23, 2^24), where
// binary32's spacing is 1, so the addition rounds t to an integer, ties to
// even, and the sum's bits are those of kRoundMagic plus that integer.
constexpr float kRoundMagic = 12582912.0f;

// ---------------------------------------------------------------------------
// Loops. Each multiversioned function takes `residual` possibly null and
// dispatches once to an always-inline template, so that both variants are
// vectorised.

template <bool kResidual>
[[gnu::always_inline]] inline uint32_t MaxAbsBitsOf(const float* __restrict x,
                                                    const float* __restrict r,
                                                    int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, Bits(Sum<kResidual>(x, r, i)) & kAbsMask);
  }
  return m;
}

}  // namespace

// The largest |y| bits: for non-negative binary32 the integer order is the
// numeric order, and anything from kInfBits up is infinite or NaN.
SHARDPS_MULTIVERSIONED uint32_t MaxAbsBits(const float* x, const float* r,
                                           int64_t n) {
  return r != nullptr ? MaxAbsBitsOf<true>(x, r, n)
                      : MaxAbsBitsOf<false>(x, r, n);
}

// FP32, BF16 and FP16: y = x + rin (or x) encoded into `out`, y - decoded
// written to rout, and the largest |y| bits returned, as MaxAbsBits would
// give them, so that one pass over the values both checks and encodes.

// Stores element i of `out` and returns the value it decodes to.
template <v1::Encoding kEncoding>
[[gnu::always_inline]] inline float Put(char* __restrict out, int64_t i,
                                        float y) {
  if constexpr (kEncoding == v1::ENCODING_FP32) {
    Store32(out + 4 * i, Bits(y));
    return y;  // y - y: the +0 residual fp32 leaves, for every finite y
  } else if constexpr (kEncoding == v1::ENCODING_BF16) {
    const uint32_t h = Bf16FromBits(Bits(y));
    Store16(out + 2 * i, h);
    return FromBits(h << 16);
  } else {
    const uint32_t h = Fp16FromBits(Bits(y));
    Store16(out + 2 * i, h);
    return FromBits(BitsFromFp16(h));
  }
}

// rin and rout may be the same array (in place), so they are not
// __restrict: element i is read before it is written.
template <v1::Encoding kEncoding, bool kResidual>
[[gnu::always_inline]] inline uint32_t EncodeToOf(const float* __restrict x,
                                                  const float* rin, float* rout,
                                                  int64_t n,
                                                  char* __restrict out) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float y = kResidual ? x[i] + rin[i] : x[i];
    m = std::max(m, Bits(y) & kAbsMask);
    const float decoded = Put<kEncoding>(out, i, y);
    if constexpr (kResidual) rout[i] = y - decoded;
  }
  return m;
}

template <v1::Encoding kEncoding>
[[gnu::always_inline]] inline uint32_t EncodeToWith(const float* x,
                                                    const float* rin,
                                                    float* rout, int64_t n,
                                                    char* out) {
  return rin != nullptr ? EncodeToOf<kEncoding, true>(x, rin, rout, n, out)
                        : EncodeToOf<kEncoding, false>(x, rin, rout, n, out);
}

// REQUIRES: `encoding` is FP32, BF16 or FP16.
SHARDPS_MULTIVERSIONED uint32_t EncodeTo(v1::Encoding encoding, const float* x,
                                         const float* rin, float* rout,
                                         int64_t n, char* out) {
  if (encoding == v1::ENCODING_BF16) {
    return EncodeToWith<v1::ENCODING_BF16>(x, rin, rout, n, out);
  }
  if (encoding == v1::ENCODING_FP16) {
    return EncodeToWith<v1::ENCODING_FP16>(x, rin, rout, n, out);
  }
  return EncodeToWith<v1::ENCODING_FP32>(x, rin, rout, n, out);
}

void EncodeInPlace(v1::Encoding encoding, const float* x, float* r, int64_t n,
                   char* out) {
  EncodeTo(encoding, x, r, r, n, out);
}

template <bool kResidual>
[[gnu::always_inline]] inline void Int8Of(const float* __restrict x,
                                          float* __restrict r, int64_t n,
                                          float s, char* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = Sum<kResidual>(x, r, i);
    // |y / s| <= 127 * (1 + 2^-23) or so; the clamp is for the last ulp.
    // The rounded quotient is read off the sum's bits, then clamped as an
    // integer: no float-to-int conversion or float compare, which would
    // keep GCC from vectorising the loop.
    const int32_t rounded = static_cast<int32_t>(Bits(y / s + kRoundMagic)) -
                            static_cast<int32_t>(Bits(kRoundMagic));
    const int32_t qi = std::min(std::max(rounded, -127), 127);
    out[i] = static_cast<char>(qi);
    // Exact by Sterbenz as well: with q != 0, y and q * s are within a
    // factor of two; with q == 0, r = y.
    if constexpr (kResidual) r[i] = y - static_cast<float>(qi) * s;
  }
}

SHARDPS_MULTIVERSIONED void EncodeInt8Payload(const float* x, float* r,
                                              int64_t n, float s, char* out) {
  if (r != nullptr) {
    Int8Of<true>(x, r, n, s, out);
  } else {
    Int8Of<false>(x, r, n, s, out);
  }
}

// Element i of a payload `in`, and whether it is non-finite (into *bad).
template <v1::Encoding kEncoding>
[[gnu::always_inline]] inline float Get(const char* __restrict in, int64_t i,
                                        uint32_t* bad) {
  if constexpr (kEncoding == v1::ENCODING_FP32) {
    const uint32_t b = Load32(in + 4 * i);
    *bad |= static_cast<uint32_t>((b & kInfBits) == kInfBits);
    return FromBits(b);
  } else if constexpr (kEncoding == v1::ENCODING_BF16) {
    const uint32_t h = Load16(in + 2 * i);
    *bad |= static_cast<uint32_t>((h & 0x7f80u) == 0x7f80u);
    return FromBits(h << 16);
  } else {
    const uint32_t h = Load16(in + 2 * i);
    *bad |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
    return FromBits(BitsFromFp16(h));
  }
}

// What a decoder does with element i: writes it to out[i], adds it to
// out[i] (one binary32 add), or only looks at it (out unused).
enum class Into { kWrite, kAdd, kNothing };

template <v1::Encoding kEncoding, Into kInto>
[[gnu::always_inline]] inline uint32_t DecodeOf(const char* __restrict in,
                                                int64_t n,
                                                float* __restrict out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Get<kEncoding>(in, i, &bad);
    if constexpr (kInto == Into::kWrite) out[i] = v;
    if constexpr (kInto == Into::kAdd) out[i] += v;
  }
  return bad;
}

template <Into kInto>
[[gnu::always_inline]] inline uint32_t DecodeFloat(v1::Encoding encoding,
                                                   const char* in, int64_t n,
                                                   float* out) {
  if (encoding == v1::ENCODING_BF16) {
    return DecodeOf<v1::ENCODING_BF16, kInto>(in, n, out);
  }
  if (encoding == v1::ENCODING_FP16) {
    return DecodeOf<v1::ENCODING_FP16, kInto>(in, n, out);
  }
  return DecodeOf<v1::ENCODING_FP32, kInto>(in, n, out);
}

SHARDPS_MULTIVERSIONED uint32_t DecodeFloatPayload(v1::Encoding encoding,
                                                   const char* in, int64_t n,
                                                   float* out) {
  return DecodeFloat<Into::kWrite>(encoding, in, n, out);
}

SHARDPS_MULTIVERSIONED uint32_t AddFloatPayload(v1::Encoding encoding,
                                                const char* in, int64_t n,
                                                float* sum) {
  return DecodeFloat<Into::kAdd>(encoding, in, n, sum);
}

SHARDPS_MULTIVERSIONED uint32_t CheckFloatPayload(v1::Encoding encoding,
                                                  const char* in, int64_t n) {
  return DecodeFloat<Into::kNothing>(encoding, in, n, nullptr);
}

SHARDPS_MULTIVERSIONED uint32_t DecodeInt8Payload(const char* in, int64_t n,
                                                  float s, float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t q = static_cast<signed char>(in[i]);
    bad |= static_cast<uint32_t>(q == -128);
    out[i] = static_cast<float>(q) * s;
  }
  return bad;
}

SHARDPS_MULTIVERSIONED void EncodeBf16Loop(const float* x, int64_t n,
                                           uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint16_t>(Bf16FromBits(Bits(x[i])));
  }
}

SHARDPS_MULTIVERSIONED void DecodeBf16Loop(const uint16_t* in, int64_t n,
                                           float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = FromBits(static_cast<uint32_t>(in[i]) << 16);
  }
}

}  // namespace shardps::codec_loops
