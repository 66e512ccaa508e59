#include "common/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/encoding.h"
#include "common/float_bits.h"
#include "common/multiversion.h"
#include "common/topk_select.h"

namespace shardps {
namespace {

using float_bits::Bits;
using float_bits::FromBits;
using float_bits::kAbsMask;
using float_bits::kInfBits;
using float_bits::Load16;
using float_bits::Load32;
using float_bits::Store16;
using float_bits::Store32;
using float_bits::Sum;

// ---------------------------------------------------------------------------
// Bit-level conversions: integer operations, and floating-point ones only
// where the result is exact, so that every vector width gives the same bits
// and a denormals-are-zero mode changes nothing.

// The smallest magnitudes that round to infinity: 0x1.ffp127 (the tie above
// bfloat16's largest, 0x1.fep127, goes to the even infinity) and 65520
// (likewise above binary16's 65504).
constexpr uint32_t kBf16OverflowBits = 0x7f7f8000u;
constexpr uint32_t kFp16OverflowBits = 0x477ff000u;
constexpr float kFp16Max = 65504.0f;

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

// The largest |y| bits: for non-negative binary32 the integer order is the
// numeric order, and anything from kInfBits up is infinite or NaN.
SHARDPS_MULTIVERSIONED uint32_t MaxAbsBits(const float* x, const float* r,
                                           int64_t n) {
  return r != nullptr ? MaxAbsBitsOf<true>(x, r, n)
                      : MaxAbsBitsOf<false>(x, r, n);
}

template <bool kResidual>
[[gnu::always_inline]] inline void Fp32Of(const float* __restrict x,
                                          float* __restrict r, int64_t n,
                                          char* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    Store32(out + 4 * i, Bits(Sum<kResidual>(x, r, i)));
    if constexpr (kResidual) r[i] = 0.0f;
  }
}

SHARDPS_MULTIVERSIONED void EncodeFp32(const float* x, float* r, int64_t n,
                                       char* out) {
  if (r != nullptr) {
    Fp32Of<true>(x, r, n, out);
  } else {
    std::memcpy(out, x, n * 4);
  }
}

template <bool kResidual>
[[gnu::always_inline]] inline void Bf16Of(const float* __restrict x,
                                          float* __restrict r, int64_t n,
                                          char* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = Sum<kResidual>(x, r, i);
    const uint32_t h = Bf16FromBits(Bits(y));
    Store16(out + 2 * i, h);
    // y - decoded is exact: the two are within a factor of two (Sterbenz).
    if constexpr (kResidual) r[i] = y - FromBits(h << 16);
  }
}

SHARDPS_MULTIVERSIONED void EncodeBf16Payload(const float* x, float* r,
                                              int64_t n, char* out) {
  if (r != nullptr) {
    Bf16Of<true>(x, r, n, out);
  } else {
    Bf16Of<false>(x, r, n, out);
  }
}

template <bool kResidual>
[[gnu::always_inline]] inline void Fp16Of(const float* __restrict x,
                                          float* __restrict r, int64_t n,
                                          char* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = Sum<kResidual>(x, r, i);
    const uint32_t h = Fp16FromBits(Bits(y));
    Store16(out + 2 * i, h);
    // Exact, as for bf16; below binary16's range decoded is 0 and r = y.
    if constexpr (kResidual) r[i] = y - FromBits(BitsFromFp16(h));
  }
}

SHARDPS_MULTIVERSIONED void EncodeFp16Payload(const float* x, float* r,
                                              int64_t n, char* out) {
  if (r != nullptr) {
    Fp16Of<true>(x, r, n, out);
  } else {
    Fp16Of<false>(x, r, n, out);
  }
}

// FP32, BF16 and FP16 again with the residual out of place (y = x + rin,
// rout = y - decoded) and the range check folded in: the largest |y| bits
// come back, as MaxAbsBits would give them, so that one pass over the
// values both checks and encodes. The encoded bits are those of the loops
// above.

// Stores element i of `out` and returns the value it decodes to.
template <v1::Encoding kEncoding>
[[gnu::always_inline]] inline float Put(char* __restrict out, int64_t i,
                                        float y) {
  if constexpr (kEncoding == v1::ENCODING_FP32) {
    Store32(out + 4 * i, Bits(y));
    return y;  // y - y is +0 for every finite y, as Fp32Of leaves it
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

template <v1::Encoding kEncoding, bool kResidual>
[[gnu::always_inline]] inline uint32_t EncodeToOf(const float* __restrict x,
                                                  const float* __restrict rin,
                                                  float* __restrict rout,
                                                  int64_t n,
                                                  char* __restrict out) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float y = Sum<kResidual>(x, rin, i);
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

// The decoders return a nonzero flag when some element is non-finite (fp32,
// bf16, fp16) or q is -128 (int8); the caller then finds which.
SHARDPS_MULTIVERSIONED uint32_t DecodeFp32Payload(const char* in, int64_t n,
                                                  float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = Load32(in + 4 * i);
    bad |= static_cast<uint32_t>((b & kInfBits) == kInfBits);
    out[i] = FromBits(b);
  }
  return bad;
}

SHARDPS_MULTIVERSIONED uint32_t DecodeBf16Payload(const char* in, int64_t n,
                                                  float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = Load16(in + 2 * i);
    bad |= static_cast<uint32_t>((h & 0x7f80u) == 0x7f80u);
    out[i] = FromBits(h << 16);
  }
  return bad;
}

SHARDPS_MULTIVERSIONED uint32_t DecodeFp16Payload(const char* in, int64_t n,
                                                  float* out) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = Load16(in + 2 * i);
    bad |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
    out[i] = FromBits(BitsFromFp16(h));
  }
  return bad;
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

// ---------------------------------------------------------------------------
// Messages.

std::string Num(float v) { return absl::StrFormat("%.9g", v); }

// "ENCODING_FP16: element 3 is 70000", and with a residual what it was made
// of: the value at `i` that an encoder refused.
std::string Element(v1::Encoding encoding, const float* x, const float* r,
                    int64_t i) {
  std::string s = absl::StrCat(EncodingName(encoding), ": element ", i, " is ");
  if (r == nullptr) return absl::StrCat(s, Num(x[i]));
  return absl::StrCat(s, Num(x[i] + r[i]), " (gradient ", Num(x[i]),
                      " plus residual ", Num(r[i]), ")");
}

// InvalidArgument for the first element whose |y| bits are >= `limit`, or
// OK when there is none (`max_abs_bits` says which).
absl::Status RefuseFirst(v1::Encoding encoding, const float* x, const float* r,
                         int64_t n, uint32_t max_abs_bits, uint32_t limit) {
  if (max_abs_bits < limit) return absl::OkStatus();
  int64_t i = 0;
  float y = 0;
  for (; i < n; ++i) {  // max_abs_bits says there is one
    y = r != nullptr ? x[i] + r[i] : x[i];
    if ((Bits(y) & kAbsMask) >= limit) break;
  }
  const std::string element = Element(encoding, x, r, i);
  if (!std::isfinite(y)) {
    return absl::InvalidArgumentError(
        absl::StrCat(element, ", not finite: it cannot be encoded"));
  }
  if (encoding == v1::ENCODING_FP16) {
    return absl::InvalidArgumentError(absl::StrCat(
        element, ", beyond binary16's largest finite value ", Num(kFp16Max),
        " (from 65520 up it would round to infinity)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      element, ", which rounds to infinity in bfloat16 (largest finite ",
      Num(FromBits(0x7f7f0000u)), ")"));
}

absl::Status LengthError(v1::Encoding encoding, uint64_t bytes, int64_t n,
                         int64_t want) {
  return absl::InvalidArgumentError(
      absl::StrCat(EncodingName(encoding), " payload has ", bytes, " bytes; ",
                   n, " elements need ", want));
}

// InvalidArgument naming the first NaN or infinite value of out[0, n).
absl::Status NonFiniteError(v1::Encoding encoding, const float* out,
                            int64_t n) {
  const int64_t i = FirstNonFinite(out, n);
  return absl::InvalidArgumentError(
      absl::StrCat(EncodingName(encoding), ": element ", i < 0 ? 0 : i, " is ",
                   Num(i < 0 ? 0.0f : out[i]), "; gradients must be finite"));
}

absl::Status DecodeInt8(absl::string_view payload, int64_t n,
                        bool allow_nonfinite, float* out) {
  const float s = FromBits(Load32(payload.data()));
  if (!(std::isnormal(s) && s > 0)) {
    const char* what = std::isnan(s)   ? "NaN"
                       : std::isinf(s) ? "infinite"
                       : s == 0        ? "zero"
                       : s < 0         ? "negative"
                                       : "subnormal";
    return absl::InvalidArgumentError(absl::StrCat(
        "ENCODING_INT8 scale is ", Num(s), " (", what,
        "); it must be positive, finite and normal (at least 2^-126)"));
  }
  if (!allow_nonfinite && !std::isfinite(127.0f * s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ENCODING_INT8 scale ", Num(s), " is too large: 127 * scale is ",
        "infinite, so the values would not be finite"));
  }
  if (DecodeInt8Payload(payload.data() + 4, n, s, out) != 0) {
    const char* q = payload.data() + 4;
    const int64_t i = std::find(q, q + n, static_cast<char>(-128)) - q;
    return absl::InvalidArgumentError(absl::StrCat(
        "ENCODING_INT8: element ", i, " is -128; q must be in [-127, 127]"));
  }
  return absl::OkStatus();
}

absl::Status DecodeTopk(absl::string_view payload, int64_t n,
                        bool allow_nonfinite, float* out) {
  if (payload.size() < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("ENCODING_TOPK payload has ", payload.size(),
                     " bytes; it needs at least the 4 of its count k"));
  }
  const int64_t k = Load32(payload.data());
  if (k == 0 || k > n) {
    return absl::InvalidArgumentError(absl::StrCat("ENCODING_TOPK count k is ",
                                                   k, "; it must be in [1, ", n,
                                                   "] for ", n, " elements"));
  }
  const uint64_t want = 4 + 8 * static_cast<uint64_t>(k);
  if (payload.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("ENCODING_TOPK payload has ", payload.size(),
                     " bytes; k = ", k, " needs 4 + 8k = ", want,
                     payload.size() < want ? " (index or value list truncated)"
                                           : " (trailing bytes)"));
  }
  std::fill(out, out + n, 0.0f);
  const char* indices = payload.data() + 4;
  const char* values = indices + 4 * k;
  int64_t previous = -1;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t index = Load32(indices + 4 * j);
    if (index >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("ENCODING_TOPK entry ", j, " has index ", index,
                       "; there are ", n, " elements"));
    }
    if (index <= previous) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ENCODING_TOPK entry ", j, " has index ", index,
          index == previous ? ", a duplicate of entry " : ", below entry ",
          j - 1, "'s ", previous, "; indices must be strictly ascending"));
    }
    const float v = FromBits(Load32(values + 4 * j));
    if (!allow_nonfinite && !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ENCODING_TOPK entry ", j, " (element ", index, ") is ",
                       Num(v), "; gradients must be finite"));
    }
    out[index] = v;
    previous = index;
  }
  return absl::OkStatus();
}

}  // namespace

int64_t EncodedBytes(v1::Encoding encoding, int64_t n, int64_t k) {
  switch (encoding) {
    case v1::ENCODING_FP32:
      return 4 * n;
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
      return 2 * n;
    case v1::ENCODING_INT8:
      return 4 + n;
    case v1::ENCODING_TOPK:
      return 4 + 8 * k;
    default:
      return -1;
  }
}

int64_t TopkCount(int64_t n, double ratio) {
  if (n <= 0) return 0;
  if (!(ratio > 0)) return 1;
  if (ratio >= 1) return n;
  const double k = std::ceil(ratio * static_cast<double>(n));
  return std::clamp(static_cast<int64_t>(k), int64_t{1}, n);
}

namespace {

// The |y| bits from which `encoding` cannot carry a value.
uint32_t OverflowLimit(v1::Encoding encoding) {
  if (encoding == v1::ENCODING_BF16) return kBf16OverflowBits;
  if (encoding == v1::ENCODING_FP16) return kFp16OverflowBits;
  return kInfBits;
}

}  // namespace

absl::Status CheckEncodable(v1::Encoding encoding, const float* x,
                            const float* residual, int64_t n) {
  return RefuseFirst(encoding, x, residual, n, MaxAbsBits(x, residual, n),
                     OverflowLimit(encoding));
}

namespace {

// The arguments' checks both encoders make; *k is TOPK's count.
absl::Status CheckEncodeArguments(v1::Encoding encoding, int64_t n,
                                  double topk_ratio, int64_t* k) {
  *k = 0;
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot encode ", n, " elements"));
  }
  switch (encoding) {
    case v1::ENCODING_FP32:
    case v1::ENCODING_INT8:
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
      break;
    case v1::ENCODING_TOPK:
      if (!(topk_ratio > 0 && topk_ratio <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ENCODING_TOPK ratio must be in (0, 1], got ", topk_ratio));
      }
      if (n == 0 || n > int64_t{0xffffffff}) {
        return absl::InvalidArgumentError(
            absl::StrCat("ENCODING_TOPK cannot encode ", n,
                         " elements; it takes 1 to 2^32 - 1"));
      }
      *k = TopkCount(n, topk_ratio);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot encode gradients as ", EncodingName(encoding)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodePayload(v1::Encoding encoding, const float* x, int64_t n,
                           double topk_ratio, float* residual,
                           std::string* out) {
  int64_t k = 0;
  absl::Status status = CheckEncodeArguments(encoding, n, topk_ratio, &k);
  if (!status.ok()) return status;
  const uint32_t limit = OverflowLimit(encoding);
  // Everything is checked before anything is written, so that a refused
  // gradient leaves *out and *residual as they were.
  const uint32_t max_abs_bits = MaxAbsBits(x, residual, n);
  status = RefuseFirst(encoding, x, residual, n, max_abs_bits, limit);
  if (!status.ok()) return status;
  out->resize(EncodedBytes(encoding, n, k));
  char* bytes = out->data();
  switch (encoding) {
    case v1::ENCODING_FP32:
      EncodeFp32(x, residual, n, bytes);
      break;
    case v1::ENCODING_BF16:
      EncodeBf16Payload(x, residual, n, bytes);
      break;
    case v1::ENCODING_FP16:
      EncodeFp16Payload(x, residual, n, bytes);
      break;
    case v1::ENCODING_INT8: {
      // s = max|y| / 127, kept normal (at least 2^-126, which also stands in
      // for an all-zero chunk: q = 0 decodes to 0 for any s) and small
      // enough that 127 * s is finite, one ulp down where it is not.
      float s = std::max(FromBits(max_abs_bits) / 127.0f,
                         std::numeric_limits<float>::min());
      if (!std::isfinite(127.0f * s)) s = FromBits(Bits(s) - 1);
      Store32(bytes, Bits(s));
      EncodeInt8Payload(x, residual, n, s, bytes + 4);
      break;
    }
    default:  // TOPK
      SelectTopk(x, residual, n, k, bytes);
      break;
  }
  return absl::OkStatus();
}

absl::Status EncodePayloadTo(v1::Encoding encoding, const float* x, int64_t n,
                             double topk_ratio, const float* residual_in,
                             float* residual_out, std::string* out) {
  int64_t k = 0;
  absl::Status status = CheckEncodeArguments(encoding, n, topk_ratio, &k);
  if (!status.ok()) return status;
  if (encoding != v1::ENCODING_FP32 && encoding != v1::ENCODING_BF16 &&
      encoding != v1::ENCODING_FP16) {
    // INT8's scale and TOPK's selection need every value first: in place,
    // on a copy of the residual.
    if (residual_in != nullptr) {
      std::copy(residual_in, residual_in + n, residual_out);
    }
    return EncodePayload(encoding, x, n, topk_ratio,
                         residual_in != nullptr ? residual_out : nullptr, out);
  }
  out->resize(EncodedBytes(encoding, n, k));
  const uint32_t max_abs_bits =
      EncodeTo(encoding, x, residual_in, residual_out, n, out->data());
  return RefuseFirst(encoding, x, residual_in, n, max_abs_bits,
                     OverflowLimit(encoding));
}

absl::Status DecodePayload(v1::Encoding encoding, absl::string_view payload,
                           int64_t n, bool allow_nonfinite, float* out) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot decode ", n, " elements"));
  }
  if (encoding == v1::ENCODING_TOPK) {
    return DecodeTopk(payload, n, allow_nonfinite, out);
  }
  const int64_t want = EncodedBytes(encoding, n);
  if (want < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot decode ", EncodingName(encoding)));
  }
  if (payload.size() != static_cast<uint64_t>(want)) {
    return LengthError(encoding, payload.size(), n, want);
  }
  uint32_t bad = 0;
  switch (encoding) {
    case v1::ENCODING_FP32:
      if (allow_nonfinite) {
        std::memcpy(out, payload.data(), payload.size());
      } else {
        bad = DecodeFp32Payload(payload.data(), n, out);
      }
      break;
    case v1::ENCODING_BF16:
      bad = DecodeBf16Payload(payload.data(), n, out);
      break;
    case v1::ENCODING_FP16:
      bad = DecodeFp16Payload(payload.data(), n, out);
      break;
    default:  // INT8
      return DecodeInt8(payload, n, allow_nonfinite, out);
  }
  if (bad != 0 && !allow_nonfinite) return NonFiniteError(encoding, out, n);
  return absl::OkStatus();
}

void EncodeBf16(const float* x, int64_t n, uint16_t* out) {
  EncodeBf16Loop(x, n, out);
}

void DecodeBf16(const uint16_t* in, int64_t n, float* out) {
  DecodeBf16Loop(in, n, out);
}

}  // namespace shardps
