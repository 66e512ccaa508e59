#include "server/shm_stream.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/message_ring.h"

namespace shardps::server {
namespace {

// The text of the call's metadata `key`, or none.
std::optional<absl::string_view> Named(const grpc::CallbackServerContext& ctx,
                                       absl::string_view key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(grpc::string_ref(key.data(), key.size()));
  if (it == md.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

// The region the call's metadata `key` names, of at most `limit` bytes
// (`needs` says whose); none when it names none. Errors as CallRegion's.
absl::StatusOr<std::optional<shm::RegionName>> CheckedName(
    const grpc::CallbackServerContext& ctx, const ShmPolicy& policy,
    absl::string_view key, uint64_t limit, absl::string_view needs) {
  const std::optional<absl::string_view> named = Named(ctx, key);
  if (!named.has_value()) return std::optional<shm::RegionName>();
  if (!policy.shared_memory) {
    return shm::Unavailable(
        "this shard was started with --shared_memory=false");
  }
  absl::StatusOr<shm::RegionName> name = shm::ParseRegion(key, *named);
  if (!name.ok()) return shm::Unavailable(name.status().message());
  if (name->bytes > limit) {
    return shm::Unavailable(
        absl::StrCat("a region of ", name->bytes, " bytes is more than ", needs,
                     " need (", limit, "), named by ", key));
  }
  return std::optional<shm::RegionName>(*std::move(name));
}

// CheckedName, then the region mapped; null when the call names none.
absl::StatusOr<std::unique_ptr<SharedRegion>> NamedRegion(
    const grpc::CallbackServerContext& ctx, const ShmPolicy& policy,
    absl::string_view key, uint64_t limit, absl::string_view needs,
    SharedRegion::Mapping mapping) {
  absl::StatusOr<std::optional<shm::RegionName>> name =
      CheckedName(ctx, policy, key, limit, needs);
  if (!name.ok()) return name.status();
  if (!name->has_value()) return std::unique_ptr<SharedRegion>();
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Open((*name)->path, (*name)->bytes, mapping);
  if (!region.ok()) return shm::Unavailable(region.status().message());
  return region;
}

// The rings the call's metadata places in `region`; none when it names
// none. Errors as PushPullRegions' for rings.
absl::StatusOr<std::optional<shm::RingPlace>> CallRings(
    const grpc::CallbackServerContext& ctx, const SharedRegion* region) {
  const std::optional<absl::string_view> named = Named(ctx, shm::kRingsKey);
  if (!named.has_value()) return std::optional<shm::RingPlace>();
  auto refuse = [&](absl::string_view why) {
    return shm::Unavailable(
        absl::StrCat(shm::kRingsKey, " \"", *named, "\": ", why));
  };
  if (region == nullptr) {
    return refuse(absl::StrCat("the call names no region (",
                               shm::kStreamRegionKey, " metadata)"));
  }
  absl::StatusOr<shm::RingPlace> place = shm::ParseRings(*named);
  if (!place.ok()) return refuse("not \"<offset> <bytes>\"");
  if (place->bytes > region->size() / 2 ||
      !region->Contains(place->offset, 2 * place->bytes)) {
    return refuse(absl::StrCat("two rings there do not lie in the region of ",
                               region->size(), " bytes"));
  }
  for (uint64_t at : {place->offset, place->offset + place->bytes}) {
    const absl::Status ok =
        MessageRing::Check(region->data() + at, place->bytes);
    if (!ok.ok()) return refuse(ok.message());
  }
  return std::optional<shm::RingPlace>(*place);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> CallRegion(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy) {
  const auto [owned_bytes, owned_chunks] = store.OwnedSize();
  return NamedRegion(ctx, policy, shm::kStreamRegionKey,
                     shm::MaxStreamRegionBytes(owned_bytes, owned_chunks),
                     "this shard's chunks", SharedRegion::Mapping::kReadWrite);
}

absl::StatusOr<std::shared_ptr<SharedRegion>> PullRegion(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy, RegionCache* cache) {
  const auto [owned_bytes, owned_chunks] = store.OwnedSize();
  absl::StatusOr<std::optional<shm::RegionName>> name =
      CheckedName(ctx, policy, shm::kStreamRegionKey,
                  shm::MaxStreamRegionBytes(owned_bytes, owned_chunks),
                  "this shard's chunks");
  if (!name.ok()) return name.status();
  if (!name->has_value()) return std::shared_ptr<SharedRegion>();
  absl::StatusOr<std::shared_ptr<SharedRegion>> region =
      cache->Open((*name)->path, (*name)->bytes);
  if (!region.ok()) return shm::Unavailable(region.status().message());
  return region;
}

absl::StatusOr<StreamRegions> PushPullRegions(
    const grpc::CallbackServerContext& ctx, const ParameterStore& store,
    const ShmPolicy& policy) {
  StreamRegions regions;
  absl::StatusOr<std::unique_ptr<SharedRegion>> stream =
      CallRegion(ctx, store, policy);
  if (!stream.ok()) return stream.status();
  regions.stream = *std::move(stream);
  absl::StatusOr<std::optional<shm::RingPlace>> rings =
      CallRings(ctx, regions.stream.get());
  if (!rings.ok()) return rings.status();
  if (rings->has_value() && !policy.rings) {
    return shm::Unavailable(
        "this shard was started with --shared_memory_rings=false");
  }
  regions.rings = *rings;
  // A gradient or weight region holds the whole model, each tensor (or
  // chunk) at a cache line; the shard touches only its own chunks there.
  const auto [model_bytes, model_chunks] = store.ModelSize();
  const uint64_t limit = shm::MaxBufferRegionBytes(model_bytes, model_chunks);
  absl::StatusOr<std::unique_ptr<SharedRegion>> gradients =
      NamedRegion(ctx, policy, shm::kGradientRegionKey, limit,
                  "the model's gradients", SharedRegion::Mapping::kReadOnly);
  if (!gradients.ok()) return gradients.status();
  regions.gradients = *std::move(gradients);
  absl::StatusOr<std::unique_ptr<SharedRegion>> weights =
      NamedRegion(ctx, policy, shm::kWeightRegionKey, limit,
                  "the model's weights", SharedRegion::Mapping::kReadWriteLazy);
  if (!weights.ok()) return weights.status();
  regions.weights = *std::move(weights);
  return regions;
}

}  // namespace shardps::server
