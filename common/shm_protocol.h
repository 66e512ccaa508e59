// The shared-memory protocol between a worker and a shard on one machine,
// written once for both sides: how a call names its regions (gRPC metadata),
// how each region is laid out, the size limits a shard derives from the
// layout it holds, and the error that sends a worker back to gRPC.
//
// Regions (each a sealed memfd, common/shared_memory.h), every item at a
// kAlignment boundary:
//   stream region (kStreamRegionKey, one per PushPull call, one per shard
//     for Pulls): the gradients of the call's chunks, then their weights,
//     then, with rings (kRingsKey), the requests' and the replies' message
//     ring (common/message_ring.h);
//   gradient and weight regions (kGradientRegionKey, kWeightRegionKey, one
//     of each per worker): every tensor of the layout, in layout order; the
//     worker computes its gradients and keeps its weights there, so a push
//     names where its gradient lies and its reply where its weights go.
// A shard refuses a region larger than its layout can need (Max*Bytes), so a
// worker cannot make it map more than the model. Every refusal of a region
// is UNAVAILABLE starting with kErrorPrefix (Unavailable(), IsFallback()):
// the worker then carries the payloads in the messages.
#ifndef SHARDPS_COMMON_SHM_PROTOCOL_H_
#define SHARDPS_COMMON_SHM_PROTOCOL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace shardps::shm {

// gRPC metadata keys. Regions are named "<path> <bytes>" (FormatRegion).
inline constexpr char kStreamRegionKey[] = "shardps-shm";
inline constexpr char kGradientRegionKey[] = "shardps-shm-gradients";
inline constexpr char kWeightRegionKey[] = "shardps-shm-weights";
// The rings in the stream region, as "<offset> <bytes>" (FormatRings): the
// requests' ring at offset, the replies' right after it, each `bytes` long.
inline constexpr char kRingsKey[] = "shardps-shm-rings";
// A PushPullRequest or PushPullResponse header in a ring is at most this.
inline constexpr uint64_t kRingMessageBytes = 256;
// Every tensor, chunk and ring in a region starts at a multiple of this.
inline constexpr uint64_t kAlignment = 64;
// The start of every error that means "go on without shared memory".
inline constexpr char kErrorPrefix[] = "shared memory: ";

// `bytes` rounded up to kAlignment.
constexpr uint64_t Align(uint64_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// A region as a call names it.
struct RegionName {
  std::string path;
  uint64_t bytes = 0;
};
std::string FormatRegion(absl::string_view path, uint64_t bytes);
// InvalidArgument naming `key` and the text unless it is "<path> <bytes>".
absl::StatusOr<RegionName> ParseRegion(absl::string_view key,
                                       absl::string_view text);

// Where a stream's rings lie in its region.
struct RingPlace {
  uint64_t offset = 0;
  uint64_t bytes = 0;  // each
};
std::string FormatRings(const RingPlace& place);
// InvalidArgument unless `text` is "<offset> <bytes>".
absl::StatusOr<RingPlace> ParseRings(absl::string_view text);

// A stream region for chunks of the given byte sizes, in that order.
struct StreamLayout {
  std::vector<uint64_t> gradient_at;  // by position
  std::vector<uint64_t> weights_at;   // by position
  uint64_t payload_bytes = 0;         // gradients and weights
  RingPlace rings;                    // right after the payloads
  // The region's size with or without its rings.
  uint64_t bytes(bool with_rings) const {
    return payload_bytes + (with_rings ? 2 * rings.bytes : 0);
  }
};
StreamLayout PlanStreamRegion(absl::Span<const int64_t> chunk_bytes);
// The largest stream region (rings included) that PlanStreamRegion gives
// for any subset of `chunks` chunks of `bytes` in all: what a shard that
// owns them accepts.
uint64_t MaxStreamRegionBytes(uint64_t bytes, uint64_t chunks);

// A gradient or weight region for tensors of the given byte sizes, in
// layout order: each tensor's offset, and the region's size in *bytes.
std::vector<uint64_t> PlanBufferRegion(absl::Span<const int64_t> tensor_bytes,
                                       uint64_t* bytes);
// The largest buffer region a model of `bytes` in `chunks` chunks can plan
// (a tensor holds at least one chunk).
uint64_t MaxBufferRegionBytes(uint64_t bytes, uint64_t chunks);

// UNAVAILABLE "shared memory: <why>": the worker goes on over gRPC.
absl::Status Unavailable(absl::string_view why);
// True for Unavailable()'s statuses (as a shard sent them, before any
// context is prefixed to the message).
bool IsFallback(const absl::Status& status);

}  // namespace shardps::shm

#endif  // SHARDPS_COMMON_SHM_PROTOCOL_H_
