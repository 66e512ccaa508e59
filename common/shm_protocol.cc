#include "common/shm_protocol.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/message_ring.h"

namespace shardps::shm {

std::string FormatRegion(absl::string_view path, uint64_t bytes) {
  return absl::StrCat(path, " ", bytes);
}

absl::StatusOr<RegionName> ParseRegion(absl::string_view key,
                                       absl::string_view text) {
  std::vector<absl::string_view> parts =
      absl::StrSplit(text, absl::MaxSplits(' ', 1));
  RegionName name;
  if (parts.size() != 2 || parts[0].empty() ||
      !absl::SimpleAtoi(parts[1], &name.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        key, " metadata \"", text, "\" is not \"<path> <bytes>\""));
  }
  name.path = std::string(parts[0]);
  return name;
}

std::string FormatRings(const RingPlace& place) {
  return absl::StrCat(place.offset, " ", place.bytes);
}

absl::StatusOr<RingPlace> ParseRings(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ' ');
  RingPlace place;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &place.offset) ||
      !absl::SimpleAtoi(parts[1], &place.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kRingsKey, " metadata \"", text, "\" is not \"<offset> <bytes>\""));
  }
  return place;
}

StreamLayout PlanStreamRegion(absl::Span<const int64_t> chunk_bytes) {
  StreamLayout layout;
  uint64_t at = 0;
  for (int64_t bytes : chunk_bytes) {
    layout.gradient_at.push_back(at);
    at += Align(static_cast<uint64_t>(bytes));
  }
  for (int64_t bytes : chunk_bytes) {
    layout.weights_at.push_back(at);
    at += Align(static_cast<uint64_t>(bytes));
  }
  layout.payload_bytes = at;  // a multiple of kAlignment: rings start aligned
  layout.rings.offset = at;
  layout.rings.bytes =
      MessageRing::BytesFor(chunk_bytes.size(), kRingMessageBytes);
  return layout;
}

uint64_t MaxStreamRegionBytes(uint64_t bytes, uint64_t chunks) {
  // Each chunk twice, each padded by less than kAlignment; rings for as
  // many headers as chunks (BytesFor grows with the count).
  return 2 * (bytes + kAlignment * chunks) + kAlignment +
         2 * MessageRing::BytesFor(chunks, kRingMessageBytes);
}

std::vector<uint64_t> PlanBufferRegion(absl::Span<const int64_t> tensor_bytes,
                                       uint64_t* bytes) {
  std::vector<uint64_t> at;
  at.reserve(tensor_bytes.size());
  uint64_t end = 0;
  for (int64_t b : tensor_bytes) {
    at.push_back(end);
    end += Align(static_cast<uint64_t>(b));
  }
  *bytes = end;
  return at;
}

uint64_t MaxBufferRegionBytes(uint64_t bytes, uint64_t chunks) {
  return bytes + kAlignment * chunks + kAlignment;
}

absl::Status Unavailable(absl::string_view why) {
  return absl::UnavailableError(absl::StrCat(kErrorPrefix, why));
}

bool IsFallback(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         absl::StartsWith(status.message(), kErrorPrefix);
}

}  // namespace shardps::shm
