// ShmRegions: the shared memory a Client keeps (common/shm_protocol.h): the
// probe Declare names and which shards read it back (so use shared memory,
// and message rings), the gradient and weight regions behind
// GradientBuffers() and WeightBuffers() with the ones they replaced, and
// each shard's Pull region; and how a push places its payloads in the
// regions its call named (PlaceIn, PlaceGradient). Thread-compatible, used
// by the caller's thread, except that a Pull thread may touch its own
// shard's entries (PullRegion, DropPullRegion, Fallback) while the others
// touch theirs.
#ifndef SHARDPS_WORKER_SHM_REGIONS_H_
#define SHARDPS_WORKER_SHM_REGIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/shared_memory.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

// The regions a PushPull call named (null: none): its own, for payloads and
// rings, and the client's gradient and weight regions.
struct CallRegions {
  SharedRegion* stream = nullptr;
  const SharedRegion* gradients = nullptr;
  const SharedRegion* weights = nullptr;
};

// Where `bytes` at `p` lie in `region` (none: not all of them, or no
// region).
std::optional<uint64_t> PlaceIn(const SharedRegion* region, const void* p,
                                int64_t bytes);
// A push's fp32 `gradient` of `bytes` through a call with a stream region:
// named in `header` where it lies in the gradient region (computed there:
// the shard reads it without a copy), or else copied to `at` in the stream
// region. False when it fits neither: the message carries it.
bool PlaceGradient(const CallRegions& regions, const float* gradient,
                   int64_t bytes, uint64_t at, v1::PushPullRequest* header);

class ShmRegions {
 public:
  // Makes the probe (16 random bytes in a region of its own) unless there
  // is one; without one (out of memory or descriptors) no shard uses
  // shared memory. The path a DeclareRequest names (empty: none).
  void MakeProbe();
  std::string probe_path() const { return probe_ ? probe_->path() : ""; }

  // After the shards answered a Declare (by shard index): those that read
  // the probe back use shared memory, and rings too where `ringable` and
  // they take them.
  void SetShards(absl::Span<const v1::DeclareResponse> declared, bool ringable);
  bool shared_memory(uint32_t shard) const {
    return shard < shm_shards_.size() && shm_shards_[shard];
  }
  bool rings(uint32_t shard) const {
    return shared_memory(shard) && ring_shards_[shard];
  }
  // The shard refused a region (shm::IsFallback): its calls go over gRPC.
  void Fallback(uint32_t shard) { shm_shards_[shard] = 0; }
  // Client::DescribeTransport, `declared` telling why a shard does not.
  std::string Describe(absl::Span<const v1::DeclareResponse> declared) const;

  // After a Declare: the gradient and weight regions hold every tensor
  // (elements by tensor) at tensor_at, each region `bytes` long. Decided
  // once per layout: the same offsets again (a worker that recovers) keep
  // the regions and what they hold; others drop them and, when a shard uses
  // shared memory, make new ones.
  void DeclareBuffers(std::vector<uint64_t> tensor_at,
                      std::vector<int64_t> tensor_elements, uint64_t bytes);
  // The current regions (null: none); a stream that names them holds them.
  const std::shared_ptr<const SharedRegion>& gradient_region() const {
    return gradient_region_;
  }
  const std::shared_ptr<const SharedRegion>& weight_region() const {
    return weight_region_;
  }
  // Views of every tensor in the gradient or weight region (none without).
  std::vector<absl::Span<float>> GradientBuffers() const {
    return TensorsIn(gradient_region_.get());
  }
  std::vector<absl::Span<float>> WeightBuffers() const {
    return TensorsIn(weight_region_.get());
  }
  // After a step that a stream ended before it finished: fresh regions
  // (the weights carried over), so nothing a shard may still read or
  // write there is touched again; the replaced ones stay mapped until the
  // next renewal.
  void Renew();
  int64_t buffer_regions() const { return buffer_regions_; }

  // After a Declare: by shard, the bytes of its Pull region (none made
  // yet).
  void DeclarePulls(std::vector<uint64_t> bytes);
  // The region shard `shard`'s Pulls reuse, made at the first (null: the
  // shard does not use shared memory, has nothing, or it cannot be made).
  SharedRegion* PullRegion(uint32_t shard);
  // After a failed Pull: the shard may still be writing into its region.
  void DropPullRegion(uint32_t shard) { pull_regions_[shard].reset(); }

 private:
  std::vector<absl::Span<float>> TensorsIn(const SharedRegion* region) const;
  // Gradient and weight regions of `bytes` each (none when they cannot be
  // made: the current ones stay); `keep_weights`: the weights carried over.
  void NewBufferRegions(uint64_t bytes, bool keep_weights);

  std::unique_ptr<SharedRegion> probe_;
  std::string probe_token_;
  // By shard, a byte each (Pull threads clear their own shard's).
  std::vector<char> shm_shards_;
  std::vector<char> ring_shards_;
  std::shared_ptr<const SharedRegion> gradient_region_;
  std::shared_ptr<const SharedRegion> retired_gradient_region_;
  std::shared_ptr<const SharedRegion> weight_region_;
  std::shared_ptr<const SharedRegion> retired_weight_region_;
  int64_t buffer_regions_ = 0;
  std::vector<uint64_t> tensor_at_;
  std::vector<int64_t> tensor_elements_;
  std::vector<std::unique_ptr<SharedRegion>> pull_regions_;  // null: none yet
  std::vector<uint64_t> pull_region_bytes_;
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_SHM_REGIONS_H_
