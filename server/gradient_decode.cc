#include "server/gradient_decode.h"

#include "absl/strings/str_cat.h"

namespace shardps::server {

absl::Status CheckGradientPayload(v1::Encoding encoding, uint64_t payload_bytes,
                                  int64_t num_elements) {
  return CheckPayload(encoding, payload_bytes, num_elements);
}

absl::Status DecodeGradient(v1::Encoding encoding, const ByteSource& payload,
                            const GradientOrigin& origin, bool allow_nonfinite,
                            float* out) {
  // FP32 is the only encoding CheckGradientPayload lets through: the bytes
  // are the values.
  (void)encoding;
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
  const ChunkSpec& spec = *origin.spec;
  return absl::InvalidArgumentError(absl::StrCat(
      "gradient of chunk ", spec.id, " (", origin.tensor, ") from rank ",
      origin.rank, " has a non-finite value at element ", spec.offset + bad,
      " (start servers with --allow_nonfinite to accept)"));
}

}  // namespace shardps::server
