#include "common/encoding.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardps {

v1::Encoding EffectiveEncoding(v1::Encoding e) {
  return e == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_FP32 : e;
}

void ByteSource::CopyTo(char* dst) const {
  CopyTo(dst, [](uint64_t) {});
}

void ByteSource::CopyTo(char* dst,
                        absl::FunctionRef<void(uint64_t)> copied) const {
  uint64_t done = 0;
  ForEachPiece([&](absl::string_view piece) {
    std::memcpy(dst + done, piece.data(), piece.size());
    done += piece.size();
    copied(done);
  });
}

void StringByteSource::ForEachPiece(
    absl::FunctionRef<void(absl::string_view)> piece) const {
  constexpr uint64_t kPiece = 64 << 10;
  for (uint64_t at = 0; at < bytes_.size(); at += kPiece) {
    piece(bytes_.substr(at, kPiece));
  }
}
bool IsKnownEncoding(v1::Encoding e) {
  return e >= v1::ENCODING_FP32 && e <= v1::ENCODING_TOPK;
}

std::string EncodingName(v1::Encoding e) {
  if (!v1::Encoding_IsValid(e)) return absl::StrCat("encoding ", e);
  std::string name = v1::Encoding_Name(e);
  return name;
}

absl::Status CheckPayload(v1::Encoding encoding, uint64_t payload_bytes,
                          int64_t num_elements) {
  const uint64_t n = static_cast<uint64_t>(num_elements);
  uint64_t want = 0;
  switch (encoding) {
    case v1::ENCODING_FP32:
      want = 4 * n;
      break;
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
      want = 2 * n;
      break;
    case v1::ENCODING_INT8:
      want = 4 + n;  // the scale, then one byte per element
      break;
    case v1::ENCODING_TOPK:
      // A count, then k indices and k values: the count itself is checked
      // when the payload is decoded.
      if (payload_bytes >= 12 && (payload_bytes - 4) % 8 == 0 &&
          (payload_bytes - 4) / 8 <= n) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "payload has ", payload_bytes, " bytes; ENCODING_TOPK of ",
          num_elements,
          " elements needs 4 + 8k bytes for 1 <= k <= ", num_elements));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported encoding ", EncodingName(encoding), " (",
                       static_cast<int>(encoding), ")"));
  }
  if (payload_bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload has ", payload_bytes, " bytes; ", EncodingName(encoding),
        " of ", num_elements, " elements needs ", want));
  }
  return absl::OkStatus();
}

int64_t FirstNonFinite(const float* x, int64_t n) {
  // A float is NaN or infinite exactly when its exponent bits are all ones.
  // Integer tests vectorize (a float sum would not, being order-sensitive);
  // the common all-finite case is one pass over memory.
  constexpr uint32_t kExponent = 0x7f800000u;
  constexpr int64_t kBlock = 4096;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = begin + kBlock < n ? begin + kBlock : n;
    uint32_t bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, 4);
      bad |= static_cast<uint32_t>((bits & kExponent) == kExponent);
    }
    if (bad != 0) {
      for (int64_t i = begin; i < end; ++i) {
        if (!std::isfinite(x[i])) return i;
      }
    }
  }
  return -1;
}

}  // namespace shardps
