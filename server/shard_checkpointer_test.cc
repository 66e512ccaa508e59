#include "server/shard_checkpointer.h"

#include <stdlib.h>

#include <string>
#include <vector>

#include "common/chunking.h"
#include "common/partitioner.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps::server {
namespace {

std::string TempDir() { return shardps::testing::MakeTempDir("ckptr"); }

v1::DeclareRequest Declaration() {
  v1::DeclareRequest req;
  v1::TensorSpec* t = req.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(40);
  req.mutable_layout()->set_chunk_bytes(16);  // 10 chunks
  req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  req.mutable_optimizer()->set_learning_rate(0.1f);
  return req;
}

// The chunks shard `s` of `n` owns, with values that encode (step, id).
std::vector<ChunkState> ShardChunks(uint32_t s, uint32_t n, int64_t step) {
  std::vector<ChunkSpec> chunks = MakeChunks(Declaration().layout());
  std::vector<uint32_t> owner = PartitionChunks(chunks, n);
  std::vector<ChunkState> out;
  for (const ChunkSpec& c : chunks) {
    if (owner[c.id] != s) continue;
    ChunkState st;
    st.chunk_id = c.id;
    st.version = step;
    st.weights.assign(c.num_elements, step * 100.0f + c.id);
    out.push_back(st);
  }
  return out;
}

TEST(ShardCheckpointerTest, TheLastShardToWriteCommitsAndAnyCountRestores) {
  const std::string dir = TempDir();
  ShardCheckpointer s0(dir, 0, 2, 2), s1(dir, 1, 2, 2);
  absl::StatusOr<std::optional<RestoredShard>> none = s0.LoadLatest();
  SHARDPS_ASSERT_OK(none);
  EXPECT_FALSE(none->has_value());
  for (int64_t step : {5, 10, 15}) {
    absl::StatusOr<CheckpointWrite> w0 =
        s0.Write(step, Declaration(), ShardChunks(0, 2, step));
    SHARDPS_ASSERT_OK(w0);
    EXPECT_FALSE(w0->committed);  // shard 1 has not written yet
    absl::StatusOr<CheckpointWrite> w1 =
        s1.Write(step, Declaration(), ShardChunks(1, 2, step));
    SHARDPS_ASSERT_OK(w1);
    EXPECT_TRUE(w1->committed);
    EXPECT_GT(w1->bytes, 0u);
  }
  // Restore onto 3 shards: every chunk once, from step 15.
  std::vector<bool> seen(10, false);
  for (uint32_t s = 0; s < 3; ++s) {
    absl::StatusOr<std::optional<RestoredShard>> r =
        ShardCheckpointer(dir, s, 3, 2).LoadLatest();
    SHARDPS_ASSERT_OK(r);
    ASSERT_TRUE(r->has_value());
    EXPECT_EQ((*r)->step, 15);
    EXPECT_EQ((*r)->declaration.layout().tensors(0).name(), "w");
    for (const ChunkState& c : (*r)->chunks) {
      EXPECT_FALSE(seen[c.chunk_id]);
      seen[c.chunk_id] = true;
      EXPECT_EQ(c.weights[0], 1500.0f + c.chunk_id);
    }
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), 10);
  // Only the newest 2 are kept.
  EXPECT_NE(access(StepDirectory(dir, 10).c_str(), F_OK), -1);
  EXPECT_EQ(access(StepDirectory(dir, 5).c_str(), F_OK), -1);
}

TEST(ShardCheckpointerTest, AnUnfinishedStepIsNeverLoaded) {
  const std::string dir = TempDir();
  ShardCheckpointer s0(dir, 0, 2, 3), s1(dir, 1, 2, 3);
  SHARDPS_ASSERT_OK(s0.Write(4, Declaration(), ShardChunks(0, 2, 4)));
  SHARDPS_ASSERT_OK(s1.Write(4, Declaration(), ShardChunks(1, 2, 4)));
  // Step 8: only shard 0 wrote before the job died.
  SHARDPS_ASSERT_OK(s0.Write(8, Declaration(), ShardChunks(0, 2, 8)));
  absl::StatusOr<std::optional<RestoredShard>> r = s1.LoadLatest();
  SHARDPS_ASSERT_OK(r);
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->step, 4);
}

}  // namespace
}  // namespace shardps::server
