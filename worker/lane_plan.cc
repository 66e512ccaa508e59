#include "worker/lane_plan.h"

#include <algorithm>
#include <cstddef>

namespace shardps {
namespace {

// Spreads each shard's chunks over its lanes, largest first (a stable sort:
// equal chunks keep id order), each to the lane with the fewest bytes.
std::vector<std::vector<uint32_t>> AssignLanes(
    absl::Span<const ChunkSpec> chunks, absl::Span<const uint32_t> shard_of,
    uint32_t num_shards, int k) {
  std::vector<int64_t> shard_bytes(num_shards, 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    shard_bytes[shard_of[i]] += chunks[i].bytes();
  }
  std::vector<std::vector<uint32_t>> lanes(static_cast<size_t>(num_shards) * k);
  std::vector<int64_t> lane_bytes(lanes.size(), 0);
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return chunks[a].num_elements > chunks[b].num_elements;
  });
  for (size_t i : order) {
    const size_t first = static_cast<size_t>(shard_of[i]) * k;
    const int used = shard_bytes[shard_of[i]] <= kOneLaneShardBytes ? 1 : k;
    size_t best = first;
    for (size_t l = first; l < first + used; ++l) {
      if (lane_bytes[l] < lane_bytes[best]) best = l;
    }
    lanes[best].push_back(static_cast<uint32_t>(i));
    lane_bytes[best] += chunks[i].bytes();
  }
  for (std::vector<uint32_t>& ids : lanes) std::sort(ids.begin(), ids.end());
  return lanes;
}

}  // namespace

LanePlan PlanLanes(const v1::Layout& layout, absl::Span<const ChunkSpec> chunks,
                   absl::Span<const uint32_t> shard_of, uint32_t num_shards,
                   int lanes_per_shard) {
  LanePlan plan;
  const size_t n = chunks.size();
  plan.lane_chunks = AssignLanes(chunks, shard_of, num_shards, lanes_per_shard);
  plan.lane_of.assign(n, 0);
  plan.gradient_at.assign(n, 0);
  plan.weights_at.assign(n, 0);
  for (size_t l = 0; l < plan.lane_chunks.size(); ++l) {
    const std::vector<uint32_t>& ids = plan.lane_chunks[l];
    std::vector<int64_t> bytes;
    for (uint32_t id : ids) bytes.push_back(chunks[id].bytes());
    plan.stream.push_back(shm::PlanStreamRegion(bytes));
    for (size_t p = 0; p < ids.size(); ++p) {
      plan.lane_of[ids[p]] = static_cast<uint32_t>(l);
      plan.gradient_at[ids[p]] = plan.stream.back().gradient_at[p];
      plan.weights_at[ids[p]] = plan.stream.back().weights_at[p];
    }
  }
  // A shard's Pull region is a buffer region of its chunks, in id order.
  std::vector<std::vector<int64_t>> shard_bytes(num_shards);
  for (size_t id = 0; id < n; ++id) {
    shard_bytes[shard_of[id]].push_back(chunks[id].bytes());
  }
  plan.pull_region_bytes.assign(num_shards, 0);
  plan.pull_at.assign(n, 0);
  std::vector<std::vector<uint64_t>> shard_at(num_shards);
  for (uint32_t s = 0; s < num_shards; ++s) {
    shard_at[s] =
        shm::PlanBufferRegion(shard_bytes[s], &plan.pull_region_bytes[s]);
  }
  std::vector<size_t> next(num_shards, 0);
  for (size_t id = 0; id < n; ++id) {
    plan.pull_at[id] = shard_at[shard_of[id]][next[shard_of[id]]++];
  }
  std::vector<int64_t> tensor_bytes;
  for (const v1::TensorSpec& t : layout.tensors()) {
    tensor_bytes.push_back(NumElements(t) *
                           static_cast<int64_t>(sizeof(float)));
  }
  plan.tensor_at = shm::PlanBufferRegion(tensor_bytes, &plan.buffer_bytes);
  plan.first_chunk.assign(layout.tensors_size() + 1, 0);
  for (const ChunkSpec& c : chunks) ++plan.first_chunk[c.tensor + 1];
  for (int t = 0; t < layout.tensors_size(); ++t) {
    plan.first_chunk[t + 1] += plan.first_chunk[t];
  }
  return plan;
}

}  // namespace shardps
