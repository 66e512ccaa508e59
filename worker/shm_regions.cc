#include "worker/shm_regions.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardps {

std::optional<uint64_t> PlaceIn(const SharedRegion* region, const void* p,
                                int64_t bytes) {
  if (region == nullptr) return std::nullopt;
  const auto at = reinterpret_cast<uintptr_t>(p) -
                  reinterpret_cast<uintptr_t>(region->data());
  if (!region->Contains(at, static_cast<uint64_t>(bytes))) return std::nullopt;
  return at;
}

bool PlaceGradient(const CallRegions& regions, const float* gradient,
                   int64_t bytes, uint64_t at, v1::PushPullRequest* header) {
  if (const std::optional<uint64_t> in_buffers =
          PlaceIn(regions.gradients, gradient, bytes)) {
    header->set_shm_in_gradient_region(true);
    header->set_shm_offset(*in_buffers);
    header->set_shm_bytes(bytes);
    return true;
  }
  if (!regions.stream->Contains(at, bytes)) return false;
  std::memcpy(regions.stream->data() + at, gradient, bytes);
  header->set_shm_offset(at);
  header->set_shm_bytes(bytes);
  return true;
}

void ShmRegions::MakeProbe() {
  if (probe_ != nullptr) return;
  // 16 random bytes the shards read back: a shard that can, shares this
  // machine (and its /proc) with this process.
  absl::StatusOr<std::unique_ptr<SharedRegion>> probe =
      SharedRegion::Create(16);
  if (!probe.ok()) return;
  std::random_device random;
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = random();
    std::memcpy((*probe)->data() + 4 * i, &word, 4);
  }
  probe_token_.assign((*probe)->data(), 16);
  probe_ = *std::move(probe);
}

void ShmRegions::SetShards(absl::Span<const v1::DeclareResponse> declared,
                           bool ringable) {
  shm_shards_.assign(declared.size(), 0);
  ring_shards_.assign(declared.size(), 0);
  for (size_t shard = 0; shard < declared.size(); ++shard) {
    shm_shards_[shard] = probe_ != nullptr &&
                         declared[shard].shared_memory_token() == probe_token_;
    ring_shards_[shard] =
        shm_shards_[shard] && ringable && declared[shard].shared_memory_rings();
  }
}

std::string ShmRegions::Describe(
    absl::Span<const v1::DeclareResponse> declared) const {
  std::vector<std::string> shm;
  std::string why;
  for (uint32_t s = 0; s < shm_shards_.size(); ++s) {
    if (shm_shards_[s]) {
      shm.push_back(absl::StrCat(s));
    } else if (why.empty() && s < declared.size()) {
      why = declared[s].shared_memory_error();
      if (why.empty()) why = "no shared memory asked";
      why = absl::StrCat(" (shard ", s, ": ", why, ")");
    }
  }
  if (shm.empty()) return absl::StrCat("payloads over gRPC", why);
  if (shm.size() == shm_shards_.size()) {
    bool all_rings = true;
    for (uint32_t s = 0; s < shm_shards_.size(); ++s) {
      all_rings = all_rings && rings(s);
    }
    return all_rings ? "payloads and headers through shared memory (message "
                       "rings) with every shard"
                     : "payloads through shared memory with every shard";
  }
  return absl::StrCat("payloads through shared memory with shards ",
                      absl::StrJoin(shm, ", "), ", over gRPC to the rest", why);
}

void ShmRegions::DeclareBuffers(std::vector<uint64_t> tensor_at,
                                std::vector<int64_t> tensor_elements,
                                uint64_t bytes) {
  const bool any_shm =
      std::find(shm_shards_.begin(), shm_shards_.end(), 1) != shm_shards_.end();
  // Whatever the shards now say about shared memory, the same layout keeps
  // the buffers the caller holds.
  if (tensor_at != tensor_at_) {
    gradient_region_.reset();
    weight_region_.reset();
    if (any_shm && bytes > 0) NewBufferRegions(bytes, /*keep_weights=*/false);
  }
  tensor_at_ = std::move(tensor_at);
  tensor_elements_ = std::move(tensor_elements);
}

void ShmRegions::NewBufferRegions(uint64_t bytes, bool keep_weights) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> gradients =
      SharedRegion::Create(bytes);
  absl::StatusOr<std::unique_ptr<SharedRegion>> weights =
      SharedRegion::Create(bytes);
  // Without them (out of memory or descriptors) gradients and weights are
  // copied, or, when renewing, the old ones stay.
  if (!gradients.ok() || !weights.ok()) return;
  if (keep_weights && weight_region_ != nullptr) {
    std::memcpy((*weights)->data(), weight_region_->data(), bytes);
  }
  ++buffer_regions_;
  gradient_region_ = *std::move(gradients);
  weight_region_ = *std::move(weights);
}

void ShmRegions::Renew() {
  // A stream that ended without finishing the step may still have a push
  // being read, or a reply being written, by its shard: streams that name
  // the old regions are replaced (Client::Open). The caller may still read
  // what it left there.
  if (gradient_region_ == nullptr) return;
  retired_gradient_region_ = gradient_region_;
  retired_weight_region_ = weight_region_;
  NewBufferRegions(gradient_region_->size(), /*keep_weights=*/true);
}

std::vector<absl::Span<float>> ShmRegions::TensorsIn(
    const SharedRegion* region) const {
  std::vector<absl::Span<float>> buffers;
  if (region == nullptr) return buffers;
  for (size_t t = 0; t < tensor_at_.size(); ++t) {
    buffers.emplace_back(
        reinterpret_cast<float*>(region->data() + tensor_at_[t]),
        tensor_elements_[t]);
  }
  return buffers;
}

void ShmRegions::DeclarePulls(std::vector<uint64_t> bytes) {
  pull_regions_.clear();
  pull_regions_.resize(bytes.size());
  pull_region_bytes_ = std::move(bytes);
}

SharedRegion* ShmRegions::PullRegion(uint32_t shard) {
  std::unique_ptr<SharedRegion>& region = pull_regions_[shard];
  if (shared_memory(shard) && region == nullptr &&
      pull_region_bytes_[shard] > 0) {
    absl::StatusOr<std::unique_ptr<SharedRegion>> created =
        SharedRegion::Create(pull_region_bytes_[shard]);
    // Without one (out of memory or descriptors) the weights come in the
    // messages.
    if (created.ok()) region = *std::move(created);
  }
  return shared_memory(shard) ? region.get() : nullptr;
}

}  // namespace shardps
