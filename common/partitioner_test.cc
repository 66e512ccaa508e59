#include "common/partitioner.h"

#include <algorithm>
#include <random>

#include "gtest/gtest.h"

namespace shardps {
namespace {

std::vector<ChunkSpec> RandomChunks(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<ChunkSpec> chunks(n);
  for (int i = 0; i < n; ++i) {
    chunks[i].id = i;
    chunks[i].num_elements = 1 + rng() % 1000000;
  }
  return chunks;
}

TEST(PartitionerTest, ImbalanceIsAtMostOneChunk) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    for (uint32_t shards : {1u, 2u, 3u, 4u, 7u}) {
      SCOPED_TRACE(seed * 100 + shards);
      std::vector<ChunkSpec> chunks = RandomChunks(1 + seed * 5, seed);
      std::vector<uint32_t> shard_of = PartitionChunks(chunks, shards);
      std::vector<int64_t> load(shards, 0);
      int64_t largest = 0;
      for (size_t i = 0; i < chunks.size(); ++i) {
        ASSERT_LT(shard_of[i], shards);
        load[shard_of[i]] += chunks[i].bytes();
        largest = std::max(largest, chunks[i].bytes());
      }
      auto [lo, hi] = std::minmax_element(load.begin(), load.end());
      EXPECT_LE(*hi - *lo, largest);
    }
  }
}

TEST(PartitionerTest, IsDeterministicAndBreaksTiesByIdThenShard) {
  std::vector<ChunkSpec> chunks(5);
  for (int i = 0; i < 5; ++i) {
    chunks[i].id = i;
    chunks[i].num_elements = 10;
  }
  chunks[3].num_elements = 30;
  // Largest (3) to shard 0; then the equal ones in id order to the
  // least-loaded shard, lowest index on ties.
  std::vector<uint32_t> want = {1, 1, 1, 0, 0};
  EXPECT_EQ(PartitionChunks(chunks, 2), want);
  EXPECT_EQ(PartitionChunks(chunks, 2), PartitionChunks(chunks, 2));
}

TEST(PartitionerTest, EveryShardGetsAChunkWhenThereAreEnough) {
  std::vector<ChunkSpec> chunks = RandomChunks(8, 3);
  std::vector<uint32_t> shard_of = PartitionChunks(chunks, 8);
  std::sort(shard_of.begin(), shard_of.end());
  for (uint32_t s = 0; s < 8; ++s) EXPECT_EQ(shard_of[s], s);
}

}  // namespace
}  // namespace shardps
