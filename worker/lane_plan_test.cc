#include "worker/lane_plan.h"

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "common/chunking.h"
#include "common/partitioner.h"
#include "common/shm_protocol.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

using ::testing::ElementsAre;

// A layout of tensors with the given element counts, chunked at
// `chunk_bytes`.
v1::Layout MakeLayout(const std::vector<int64_t>& elements,
                      uint64_t chunk_bytes) {
  v1::Layout layout;
  layout.set_chunk_bytes(chunk_bytes);
  for (size_t t = 0; t < elements.size(); ++t) {
    v1::TensorSpec* spec = layout.add_tensors();
    spec->set_name("t" + std::to_string(t));
    spec->add_shape(elements[t]);
  }
  return layout;
}

TEST(LanePlanTest, SmallShardGetsOneLane) {
  // 3 chunks of 1000 floats, all on shard 0: far below kOneLaneShardBytes.
  const v1::Layout layout = MakeLayout({3000}, 4000);
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  ASSERT_EQ(chunks.size(), 3u);
  const std::vector<uint32_t> shard_of(3, 0);
  const LanePlan plan = PlanLanes(layout, chunks, shard_of, 1, 4);
  ASSERT_EQ(plan.lane_chunks.size(), 4u);
  EXPECT_THAT(plan.lane_chunks[0], ElementsAre(0, 1, 2));
  for (int l = 1; l < 4; ++l) EXPECT_TRUE(plan.lane_chunks[l].empty());
  EXPECT_THAT(plan.lane_of, ElementsAre(0, 0, 0));
}

TEST(LanePlanTest, LargeShardSpreadsLargestChunksFirst) {
  // Shard 0 owns 4 MiB chunks and one small one: over the one-lane bound,
  // so two lanes share them, each chunk to the lighter lane.
  const int64_t mib = 1 << 20;  // floats: 4 MiB
  const v1::Layout layout = MakeLayout({mib, 100, mib, mib}, 4 * mib);
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  ASSERT_EQ(chunks.size(), 4u);
  const std::vector<uint32_t> shard_of(4, 0);
  const LanePlan plan = PlanLanes(layout, chunks, shard_of, 1, 2);
  // Largest first in id order: 0 -> lane 0, 2 -> lane 1, 3 -> lane 0 (tie:
  // lowest), then the small 1 -> lane 1 (lighter).
  EXPECT_THAT(plan.lane_chunks[0], ElementsAre(0, 3));
  EXPECT_THAT(plan.lane_chunks[1], ElementsAre(1, 2));
  EXPECT_THAT(plan.lane_of, ElementsAre(0, 1, 1, 0));
}

TEST(LanePlanTest, StreamRegionsAreTheProtocolsLayout) {
  const v1::Layout layout = MakeLayout({10, 33, 7, 1000}, 400);
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  const std::vector<uint32_t> shard_of = PartitionChunks(chunks, 2);
  const LanePlan plan = PlanLanes(layout, chunks, shard_of, 2, 2);
  ASSERT_EQ(plan.stream.size(), 4u);
  for (size_t l = 0; l < plan.lane_chunks.size(); ++l) {
    SCOPED_TRACE(l);
    std::vector<int64_t> bytes;
    for (uint32_t id : plan.lane_chunks[l]) {
      EXPECT_EQ(plan.lane_of[id], l);
      EXPECT_EQ(shard_of[id], l / 2);
      bytes.push_back(chunks[id].bytes());
    }
    const shm::StreamLayout want = shm::PlanStreamRegion(bytes);
    EXPECT_EQ(plan.stream[l].payload_bytes, want.payload_bytes);
    EXPECT_EQ(plan.stream[l].rings.bytes, want.rings.bytes);
    for (size_t p = 0; p < plan.lane_chunks[l].size(); ++p) {
      const uint32_t id = plan.lane_chunks[l][p];
      EXPECT_EQ(plan.gradient_at[id], want.gradient_at[p]);
      EXPECT_EQ(plan.weights_at[id], want.weights_at[p]);
      EXPECT_EQ(plan.gradient_at[id] % shm::kAlignment, 0u);
      EXPECT_LE(plan.weights_at[id] + chunks[id].bytes(), want.payload_bytes);
    }
    // The shard that owns these chunks accepts the region, rings included.
    int64_t owned = 0;
    uint64_t owned_chunks = 0;
    for (size_t id = 0; id < chunks.size(); ++id) {
      if (shard_of[id] == l / 2) {
        owned += chunks[id].bytes();
        ++owned_chunks;
      }
    }
    EXPECT_LE(want.bytes(/*with_rings=*/true),
              shm::MaxStreamRegionBytes(owned, owned_chunks));
  }
}

TEST(LanePlanTest, PullRegionsHoldEachShardsChunksInIdOrder) {
  const v1::Layout layout = MakeLayout({10, 33, 7, 1000}, 400);
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  const std::vector<uint32_t> shard_of = PartitionChunks(chunks, 2);
  const LanePlan plan = PlanLanes(layout, chunks, shard_of, 2, 1);
  std::vector<uint64_t> end(2, 0);
  for (size_t id = 0; id < chunks.size(); ++id) {
    SCOPED_TRACE(id);
    EXPECT_EQ(plan.pull_at[id], end[shard_of[id]]);
    end[shard_of[id]] += shm::Align(chunks[id].bytes());
  }
  EXPECT_THAT(plan.pull_region_bytes, ElementsAre(end[0], end[1]));
}

TEST(LanePlanTest, BufferRegionsHoldEveryTensorInLayoutOrder) {
  const v1::Layout layout = MakeLayout({10, 33, 7}, 400);
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  const LanePlan plan =
      PlanLanes(layout, chunks, std::vector<uint32_t>(chunks.size(), 0), 1, 1);
  // 40, 132 and 28 bytes, each at a 64-byte boundary.
  EXPECT_THAT(plan.tensor_at, ElementsAre(0, 64, 256));
  EXPECT_EQ(plan.buffer_bytes, 320u);
  EXPECT_LE(plan.buffer_bytes, shm::MaxBufferRegionBytes(200, chunks.size()));
  ASSERT_EQ(plan.first_chunk.size(), 4u);
  for (int t = 0; t < 3; ++t) {
    for (uint32_t id = plan.first_chunk[t]; id < plan.first_chunk[t + 1];
         ++id) {
      EXPECT_EQ(chunks[id].tensor, static_cast<uint32_t>(t));
    }
  }
  EXPECT_EQ(plan.first_chunk[3], chunks.size());
}

}  // namespace
}  // namespace shardps
