#include "common/partitioner.h"

#include <algorithm>
#include <numeric>

namespace shardps {

std::vector<uint32_t> PartitionChunks(absl::Span<const ChunkSpec> chunks,
                                      uint32_t num_shards) {
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return chunks[a].num_elements > chunks[b].num_elements;
  });
  std::vector<int64_t> load(num_shards, 0);
  std::vector<uint32_t> shard_of(chunks.size(), 0);
  for (size_t i : order) {
    // min_element returns the first minimum: the lowest shard index on ties.
    auto least = std::min_element(load.begin(), load.end());
    shard_of[i] = static_cast<uint32_t>(least - load.begin());
    *least += chunks[i].bytes();
  }
  return shard_of;
}

}  // namespace shardps
