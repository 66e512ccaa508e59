#include "common/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/codec_loops.h"
#include "common/encoding.h"
#include "common/float_bits.h"
#include "common/status.h"
#include "common/topk_select.h"

namespace shardps {
namespace {

using codec_loops::AddFloatPayload;
using codec_loops::CheckFloatPayload;
using codec_loops::DecodeBf16Loop;
using codec_loops::DecodeFloatPayload;
using codec_loops::DecodeInt8Payload;
using codec_loops::EncodeBf16Loop;
using codec_loops::EncodeInPlace;
using codec_loops::EncodeInt8Payload;
using codec_loops::EncodeTo;
using codec_loops::kBf16OverflowBits;
using codec_loops::kFp16Max;
using codec_loops::kFp16OverflowBits;
using codec_loops::MaxAbsBits;
using float_bits::Bits;
using float_bits::FromBits;
using float_bits::kAbsMask;
using float_bits::kInfBits;
using float_bits::Load32;
using float_bits::Store32;

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

float ResidualBound(v1::Encoding encoding, float y_max) {
  // Twice what each encoding can drop of a value: BF16 half an ulp of 8
  // significant bits (2^-8 |y|, 2^-134 among subnormals), FP16 half an ulp
  // of 11 (2^-11 |y|, 2^-25 below 2^-14), INT8 half its scale s = y_max /
  // 127 (at least 2^-126), TOPK an unsent value whole.
  const double y = std::fabs(static_cast<double>(y_max));
  double bound = 0;
  switch (encoding) {
    case v1::ENCODING_BF16:
      bound = 0x1p-7 * y + 0x1p-133;
      break;
    case v1::ENCODING_FP16:
      bound = 0x1p-10 * y + 0x1p-24;
      break;
    case v1::ENCODING_INT8:
      bound = y / 127 + 0x1p-125;
      break;
    case v1::ENCODING_TOPK:
      bound = y;
      break;
    default:
      return 0;
  }
  return static_cast<float>(
      std::min<double>(bound, std::numeric_limits<float>::infinity()));
}

absl::Status CheckEncodableWithin(v1::Encoding encoding, const float* x,
                                  const float* residual, float residual_max,
                                  int64_t n) {
  if (residual != nullptr) {
    // |x + r| <= (|x| + |r|)(1 + 2^-24): well below the first value that
    // cannot be encoded, whatever r within its bound, and x alone read.
    const uint32_t limit_bits = OverflowLimit(encoding) == kInfBits
                                    ? 0x7f7fffffu  // FLT_MAX
                                    : OverflowLimit(encoding);
    const double x_max = FromBits(MaxAbsBits(x, nullptr, n));
    const double limit = FromBits(limit_bits);
    if (x_max + static_cast<double>(residual_max) <= limit * (1 - 0x1p-20)) {
      return absl::OkStatus();
    }
  }
  return CheckEncodable(encoding, x, residual, n);
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

// EncodePayload, also giving the largest |y| bits it encoded.
absl::Status EncodeInPlaceChecked(v1::Encoding encoding, const float* x,
                                  int64_t n, double topk_ratio, float* residual,
                                  std::string* out, uint32_t* y_bits) {
  int64_t k = 0;
  absl::Status status = CheckEncodeArguments(encoding, n, topk_ratio, &k);
  if (!status.ok()) return status;
  const uint32_t limit = OverflowLimit(encoding);
  // Everything is checked before anything is written, so that a refused
  // gradient leaves *out and *residual as they were.
  const uint32_t max_abs_bits = MaxAbsBits(x, residual, n);
  status = RefuseFirst(encoding, x, residual, n, max_abs_bits, limit);
  if (!status.ok()) return status;
  *y_bits = max_abs_bits;
  out->resize(EncodedBytes(encoding, n, k));
  char* bytes = out->data();
  switch (encoding) {
    case v1::ENCODING_FP32:
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
      EncodeInPlace(encoding, x, residual, n, bytes);
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

absl::Status EncodeOutOfPlace(v1::Encoding encoding, const float* x, int64_t n,
                              double topk_ratio, const float* residual_in,
                              float* residual_out, std::string* out,
                              uint32_t* y_bits) {
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
    return EncodeInPlaceChecked(encoding, x, n, topk_ratio,
                                residual_in != nullptr ? residual_out : nullptr,
                                out, y_bits);
  }
  out->resize(EncodedBytes(encoding, n, k));
  *y_bits = codec_loops::EncodeTo(encoding, x, residual_in, residual_out, n,
                                  out->data());
  return RefuseFirst(encoding, x, residual_in, n, *y_bits,
                     OverflowLimit(encoding));
}

}  // namespace

absl::Status EncodePayload(v1::Encoding encoding, const float* x, int64_t n,
                           double topk_ratio, float* residual,
                           std::string* out) {
  uint32_t y_bits;
  return EncodeInPlaceChecked(encoding, x, n, topk_ratio, residual, out,
                              &y_bits);
}

absl::Status EncodePayloadTo(v1::Encoding encoding, const float* x, int64_t n,
                             double topk_ratio, const float* residual_in,
                             float* residual_out, std::string* out,
                             float* y_max) {
  uint32_t y_bits = 0;
  const absl::Status status = EncodeOutOfPlace(
      encoding, x, n, topk_ratio, residual_in, residual_out, out, &y_bits);
  if (status.ok() && y_max != nullptr) *y_max = FromBits(y_bits);
  return status;
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
  if (encoding == v1::ENCODING_INT8) {
    return DecodeInt8(payload, n, allow_nonfinite, out);
  }
  if (encoding == v1::ENCODING_FP32 && allow_nonfinite) {
    std::memcpy(out, payload.data(), payload.size());
    return absl::OkStatus();
  }
  const uint32_t bad = DecodeFloatPayload(encoding, payload.data(), n, out);
  if (bad != 0 && !allow_nonfinite) return NonFiniteError(encoding, out, n);
  return absl::OkStatus();
}

namespace {

// Bytes an element of FP32, BF16 or FP16 takes; 0 for the others.
int FloatWidth(v1::Encoding encoding) {
  if (encoding == v1::ENCODING_FP32) return 4;
  if (encoding == v1::ENCODING_BF16 || encoding == v1::ENCODING_FP16) return 2;
  return 0;
}

// Calls run(bytes, count, at) for each run of whole elements of `width`
// bytes in `payload`, in order: `count` elements from element `at`. An
// element that two pieces cut comes as a run of one, from scratch.
template <typename Run>
void ForEachElementRun(const ByteSource& payload, int width, Run run) {
  int64_t at = 0;
  char split[4];
  int in_split = 0;
  payload.ForEachPiece([&](absl::string_view piece) {
    if (in_split > 0) {
      const int take =
          static_cast<int>(std::min<size_t>(width - in_split, piece.size()));
      std::memcpy(split + in_split, piece.data(), take);
      in_split += take;
      piece.remove_prefix(take);
      if (in_split < width) return;
      run(split, 1, at++);
      in_split = 0;
    }
    const int64_t whole = static_cast<int64_t>(piece.size()) / width;
    run(piece.data(), whole, at);
    at += whole;
    piece.remove_prefix(whole * width);
    std::memcpy(split, piece.data(), piece.size());
    in_split = static_cast<int>(piece.size());
  });
}

// The payload's bytes joined, in a thread's scratch.
absl::string_view Joined(const ByteSource& payload) {
  thread_local std::string joined;
  joined.resize(payload.size());
  payload.CopyTo(joined.data());
  return joined;
}

bool FitsFloats(v1::Encoding encoding, const ByteSource& payload, int64_t n) {
  return FloatWidth(encoding) > 0 && n >= 0 &&
         payload.size() == static_cast<uint64_t>(EncodedBytes(encoding, n));
}

}  // namespace

absl::Status DecodePayload(v1::Encoding encoding, const ByteSource& payload,
                           int64_t n, bool allow_nonfinite, float* out) {
  if (!FitsFloats(encoding, payload, n)) {
    // INT8 and TOPK, and every error of the length: from the bytes joined.
    return DecodePayload(encoding, Joined(payload), n, allow_nonfinite, out);
  }
  const uint32_t bad = DecodeCheckedPayload(encoding, payload, false, out);
  if (bad != 0 && !allow_nonfinite) return NonFiniteError(encoding, out, n);
  return absl::OkStatus();
}

uint32_t DecodeCheckedPayload(v1::Encoding encoding, const ByteSource& payload,
                              bool add, float* out) {
  uint32_t bad = 0;
  ForEachElementRun(
      payload, FloatWidth(encoding),
      [&](const char* in, int64_t count, int64_t at) {
        bad |= add ? AddFloatPayload(encoding, in, count, out + at)
                   : DecodeFloatPayload(encoding, in, count, out + at);
      });
  return bad;
}

bool DecodesInPieces(v1::Encoding encoding) { return FloatWidth(encoding) > 0; }

absl::Status CheckDecodable(v1::Encoding encoding, const ByteSource& payload,
                            int64_t n, bool allow_nonfinite) {
  thread_local std::vector<float> decoded;
  if (!FitsFloats(encoding, payload, n)) {
    decoded.resize(std::max<int64_t>(n, 0));
    return DecodePayload(encoding, Joined(payload), n, allow_nonfinite,
                         decoded.data());
  }
  if (allow_nonfinite) return absl::OkStatus();
  uint32_t bad = 0;
  ForEachElementRun(payload, FloatWidth(encoding),
                    [&](const char* in, int64_t count, int64_t) {
                      bad |= CheckFloatPayload(encoding, in, count);
                    });
  if (bad == 0) return absl::OkStatus();
  // Decoded to name the element.
  decoded.resize(n);
  return DecodePayload(encoding, payload, n, false, decoded.data());
}

absl::Status AddDecodedPayload(v1::Encoding encoding, const ByteSource& payload,
                               int64_t n, bool allow_nonfinite, float* sum) {
  if (!FitsFloats(encoding, payload, n)) {
    thread_local std::vector<float> decoded;
    decoded.resize(std::max<int64_t>(n, 0));
    const absl::Status s = DecodePayload(encoding, Joined(payload), n,
                                         allow_nonfinite, decoded.data());
    if (!s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) sum[i] += decoded[i];
    return absl::OkStatus();
  }
  // Checked whole before anything is added: a refused payload leaves the
  // sum as it was.
  SHARDPS_RETURN_IF_ERROR(
      CheckDecodable(encoding, payload, n, allow_nonfinite));
  DecodeCheckedPayload(encoding, payload, /*add=*/true, sum);
  return absl::OkStatus();
}

void EncodeBf16(const float* x, int64_t n, uint16_t* out) {
  EncodeBf16Loop(x, n, out);
}

void DecodeBf16(const uint16_t* in, int64_t n, float* out) {
  DecodeBf16Loop(in, n, out);
}

}  // namespace shardps
