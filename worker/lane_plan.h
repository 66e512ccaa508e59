// LanePlan: where a declared model's chunks travel from this worker, computed
// once per Declare from the chunk map alone (pure; no I/O, no threads): which
// of a shard's lanes carries each chunk, where each chunk lies in its lane's
// stream region and in its shard's Pull region, and where each tensor lies in
// the gradient and weight regions. Every layout is common/shm_protocol.h's,
// so the limits a shard derives from it bound every region planned here.
#ifndef SHARDPS_WORKER_LANE_PLAN_H_
#define SHARDPS_WORKER_LANE_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/chunking.h"
#include "common/shm_protocol.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

// A shard that owns at most this many bytes is pushed to on one lane: it
// gains nothing from parallel streams but their threads' wake-ups.
inline constexpr int64_t kOneLaneShardBytes = 4 << 20;

struct LanePlan {
  // By lane (shard-major: lane l belongs to shard l / lanes_per_shard): the
  // chunk ids it carries, ascending, and its stream region's layout (by
  // position in that list).
  std::vector<std::vector<uint32_t>> lane_chunks;
  std::vector<shm::StreamLayout> stream;
  // By chunk id: its lane, and where its gradient and its weights lie in
  // that lane's stream region.
  std::vector<uint32_t> lane_of;
  std::vector<uint64_t> gradient_at;
  std::vector<uint64_t> weights_at;
  // By shard: its Pull region's size (the weights of its chunks, in id
  // order); by chunk id, where its weights lie there.
  std::vector<uint64_t> pull_region_bytes;
  std::vector<uint64_t> pull_at;
  // By tensor: where it lies in the gradient and weight regions (each
  // buffer_bytes long, every tensor in layout order).
  std::vector<uint64_t> tensor_at;
  uint64_t buffer_bytes = 0;
  // By tensor, and one past the last: its first chunk id (a tensor's chunks
  // are numbered consecutively).
  std::vector<uint32_t> first_chunk;
};

// The plan for `chunks` (MakeChunks(layout)) owned by shard_of[id] of
// `num_shards`, each shard with `lanes_per_shard` lanes. Each shard's chunks
// go to its lanes largest first, each to the lane with the fewest bytes so
// far (the lowest index on a tie); a shard owning at most kOneLaneShardBytes
// uses its first lane only.
// REQUIRES: shard_of[id] < num_shards for every chunk; lanes_per_shard >= 1.
LanePlan PlanLanes(const v1::Layout& layout, absl::Span<const ChunkSpec> chunks,
                   absl::Span<const uint32_t> shard_of, uint32_t num_shards,
                   int lanes_per_shard);

}  // namespace shardps

#endif  // SHARDPS_WORKER_LANE_PLAN_H_
