#include "server/gradient_decode.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/codec.h"
#include "common/status.h"

namespace shardps::server {

namespace {

struct NamedEncoding {
  const char* flag;
  v1::Encoding encoding;
};
constexpr NamedEncoding kGradientEncodings[] = {{"fp32", v1::ENCODING_FP32},
                                                {"bf16", v1::ENCODING_BF16},
                                                {"fp16", v1::ENCODING_FP16},
                                                {"int8", v1::ENCODING_INT8},
                                                {"topk", v1::ENCODING_TOPK}};

}  // namespace

absl::StatusOr<EncodingSet> ParseEncodingSet(absl::string_view list) {
  if (list == "all") return kAllGradientEncodings;
  EncodingSet set = 0;
  for (absl::string_view name : absl::StrSplit(list, ',')) {
    bool known = false;
    for (const NamedEncoding& e : kGradientEncodings) {
      if (name == e.flag) {
        set |= EncodingBit(e.encoding);
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown gradient encoding \"", name, "\" in \"", list,
          "\"; give \"all\" or a list of fp32, bf16, fp16, int8, topk"));
    }
  }
  return set;
}

std::vector<std::string> EncodingSetNames(EncodingSet set) {
  std::vector<std::string> names;
  for (const NamedEncoding& e : kGradientEncodings) {
    if ((set & EncodingBit(e.encoding)) != 0) {
      names.push_back(v1::Encoding_Name(e.encoding));
    }
  }
  return names;
}

absl::Status CheckGradientPayload(v1::Encoding encoding, uint64_t payload_bytes,
                                  int64_t num_elements, EncodingSet accepted) {
  SHARDPS_RETURN_IF_ERROR(CheckPayload(encoding, payload_bytes, num_elements));
  if ((accepted & EncodingBit(encoding)) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        EncodingName(encoding), " is not accepted here (this takes ",
        absl::StrJoin(EncodingSetNames(accepted), ", "), ")"));
  }
  return absl::OkStatus();
}

absl::Status DecodeGradient(v1::Encoding encoding, const ByteSource& payload,
                            const GradientOrigin& origin, bool allow_nonfinite,
                            float* out) {
  const ChunkSpec& spec = *origin.spec;
  if (encoding != v1::ENCODING_FP32) {
    // Decoded from the received slices where they lie.
    absl::Status s = DecodePayload(encoding, payload, spec.num_elements,
                                   allow_nonfinite, out);
    if (s.ok()) return s;
    return absl::InvalidArgumentError(
        absl::StrCat("gradient of chunk ", spec.id, " (", origin.tensor,
                     ", tensor elements from ", spec.offset, ") from rank ",
                     origin.rank, ": ", s.message()));
  }
  if (allow_nonfinite) {
    payload.CopyTo(reinterpret_cast<char*>(out));
    return absl::OkStatus();
  }
  // Checked piece by piece as it is copied, while the piece is in cache.
  int64_t checked = 0;
  int64_t bad = -1;
  payload.CopyTo(reinterpret_cast<char*>(out), [&](uint64_t bytes) {
    const int64_t complete = bytes / 4;
    if (bad < 0 && complete > checked) {
      const int64_t at = FirstNonFinite(out + checked, complete - checked);
      if (at >= 0) bad = checked + at;
      checked = complete;
    }
  });
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "gradient of chunk ", spec.id, " (", origin.tensor, ") from rank ",
      origin.rank, " has a non-finite value at element ", spec.offset + bad,
      " (start servers with --allow_nonfinite to accept)"));
}

namespace {

// The error DecodeGradient gives for a payload the codec refused with
// `refused` (naming the chunk and rank); `refused` when it has none.
absl::Status GradientError(const absl::Status& refused, v1::Encoding encoding,
                           const ByteSource& payload,
                           const GradientOrigin& origin, bool allow_nonfinite) {
  if (refused.ok()) return refused;
  thread_local std::vector<float> scratch;
  scratch.resize(origin.spec->num_elements);
  const absl::Status decoded = DecodeGradient(encoding, payload, origin,
                                              allow_nonfinite, scratch.data());
  return decoded.ok() ? refused : decoded;
}

}  // namespace

absl::Status AddGradient(v1::Encoding encoding, const ByteSource& payload,
                         const GradientOrigin& origin, bool allow_nonfinite,
                         float* sum) {
  return GradientError(
      AddDecodedPayload(encoding, payload, origin.spec->num_elements,
                        allow_nonfinite, sum),
      encoding, payload, origin, allow_nonfinite);
}

absl::Status CheckGradient(v1::Encoding encoding, const ByteSource& payload,
                           const GradientOrigin& origin, bool allow_nonfinite) {
  return GradientError(
      CheckDecodable(encoding, payload, origin.spec->num_elements,
                     allow_nonfinite),
      encoding, payload, origin, allow_nonfinite);
}

}  // namespace shardps::server
