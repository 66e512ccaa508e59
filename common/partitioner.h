// Maps chunks to shards deterministically: largest chunk first, each to the
// least-loaded shard by bytes (ties: lower chunk id first, lower shard index).
// Load imbalance is at most one chunk. Pure function; thread-safe.
#ifndef SHARDPS_COMMON_PARTITIONER_H_
#define SHARDPS_COMMON_PARTITIONER_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/chunking.h"

namespace shardps {

// Returns the shard of every chunk, indexed by position in `chunks`.
// REQUIRES: num_shards >= 1.
std::vector<uint32_t> PartitionChunks(absl::Span<const ChunkSpec> chunks,
                                      uint32_t num_shards);

}  // namespace shardps

#endif  // SHARDPS_COMMON_PARTITIONER_H_
