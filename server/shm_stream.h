// The shard's side of the shared-memory protocol (common/shm_protocol.h):
// the regions a PushPull or Pull call names in its metadata, checked
// against what this shard's chunks can need and mapped. Every refusal is
// shm::Unavailable (the worker goes on over gRPC). Stateless; safe from any
// handler.
#ifndef SHARDPS_SERVER_SHM_STREAM_H_
#define SHARDPS_SERVER_SHM_STREAM_H_

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "common/shared_memory.h"
#include "common/shm_protocol.h"
#include "grpcpp/server_context.h"
#include "server/parameter_store.h"
#include "server/region_cache.h"

namespace shardps::server {

// What the shard allows (ServiceOptions).
struct ShmPolicy {
  bool shared_memory = true;  // regions at all
  bool rings = true;          // message rings in a stream region
};

// The mapped regions of one PushPull call; each null (or no rings) when the
// call names none.
struct StreamRegions {
  // The call's own region (shm::kStreamRegionKey), read-write.
  std::unique_ptr<SharedRegion> stream;
  // Where the message rings lie in `stream` (checked by MessageRing::Check).
  std::optional<shm::RingPlace> rings;
  // The worker's gradient region, read-only.
  std::unique_ptr<SharedRegion> gradients;
  // The worker's weight region, read-write, pages mapped as touched.
  std::unique_ptr<SharedRegion> weights;
};

// Maps the stream region a call to `store` names (shm::kStreamRegionKey);
// null when it names none. shm::Unavailable for a malformed name, a region
// larger than shm::MaxStreamRegionBytes of this shard's chunks, one that
// cannot be mapped, or a shard without shared memory.
absl::StatusOr<std::unique_ptr<SharedRegion>> CallRegion(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy);

// CallRegion for a Pull: the mapping comes from `cache`, which keeps it for
// the worker's next Pull (a worker names the same Pull region each time).
absl::StatusOr<std::shared_ptr<SharedRegion>> PullRegion(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy, RegionCache* cache);

// Every region a PushPull call names: the stream region, its rings, the
// gradient and weight regions (each limited by shm::MaxBufferRegionBytes
// of the model). shm::Unavailable for any refused, as CallRegion, and for
// rings without a region, a malformed place, rings that do not lie in the
// region, or rings on a shard started without them.
absl::StatusOr<StreamRegions> PushPullRegions(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHM_STREAM_H_
