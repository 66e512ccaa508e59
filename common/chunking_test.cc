#include "common/chunking.h"

#include <algorithm>
#include <numeric>

#include "common/partitioner.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

v1::Layout MakeLayout(std::vector<std::vector<int64_t>> shapes,
                      uint64_t chunk_bytes) {
  v1::Layout layout;
  layout.set_chunk_bytes(chunk_bytes);
  for (size_t i = 0; i < shapes.size(); ++i) {
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name("t" + std::to_string(i));
    for (int64_t d : shapes[i]) t->add_shape(d);
  }
  return layout;
}

TEST(ChunkingTest, SplitsTensorsIntoNearlyEqualChunksInLayoutOrder) {
  // 10 elements with at most 4 per chunk: 3 chunks of 4, 3, 3.
  v1::Layout layout = MakeLayout({{2, 5}, {3}}, 16);
  ASSERT_TRUE(ValidateLayout(layout).ok());
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].num_elements, 4);
  EXPECT_EQ(chunks[1].num_elements, 3);
  EXPECT_EQ(chunks[1].offset, 4);
  EXPECT_EQ(chunks[2].num_elements, 3);
  EXPECT_EQ(chunks[2].offset, 7);
  EXPECT_EQ(chunks[3].tensor, 1u);
  EXPECT_EQ(chunks[3].offset, 0);
  EXPECT_EQ(chunks[3].num_elements, 3);
  for (size_t i = 0; i < chunks.size(); ++i) EXPECT_EQ(chunks[i].id, i);
}

TEST(ChunkingTest, ChunksNeverExceedTheLimitAndCoverEveryElement) {
  for (int64_t n : {1, 3, 4, 5, 1000, 1 << 20, (1 << 20) + 1}) {
    SCOPED_TRACE(n);
    v1::Layout layout = MakeLayout({{n}}, 4096);
    int64_t covered = 0;
    for (const ChunkSpec& c : MakeChunks(layout)) {
      EXPECT_LE(c.bytes(), 4096);
      EXPECT_GE(c.num_elements, 1);
      EXPECT_EQ(c.offset, covered);
      covered += c.num_elements;
    }
    EXPECT_EQ(covered, n);
  }
}

TEST(ChunkingTest, DefaultChunkIsFourMiB) {
  v1::Layout layout = MakeLayout({{16 << 20}}, 0);
  EXPECT_EQ(ChunkBytes(layout), 4u << 20);
  EXPECT_EQ(MakeChunks(layout).size(), 16u);
}

TEST(ChunkingTest, AutoChunkIsAPowerOfTwoNearA128thOfTheModel) {
  EXPECT_EQ(AutoChunkBytes(0), kMinAutoChunkBytes);
  EXPECT_EQ(AutoChunkBytes(1000), kMinAutoChunkBytes);
  // The main job's 2 MiB model and the GPT example's 4.4 MiB: the floor.
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20), 64u << 10);
  EXPECT_EQ(AutoChunkBytes((int64_t{16} << 20) - 4), 64u << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{16} << 20), 128u << 10);
  // The wide GPT (12.8 M parameters, 48.8 MiB): 256 KiB (1 MiB at 1/32).
  EXPECT_EQ(AutoChunkBytes(int64_t{51200000}), 256u << 10);
  EXPECT_EQ(AutoChunkBytes((int64_t{128} << 20) - 4), 512u << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{128} << 20), kMaxAutoChunkBytes);
  EXPECT_EQ(AutoChunkBytes(int64_t{1} << 40), kMaxAutoChunkBytes);
}

TEST(ChunkingTest, AutoChunkOnASlowLinkIsWhatItCarriesInHalfAMillisecond) {
  // Not known, or 1 Gbit/s and more: 64 KiB.
  EXPECT_EQ(MinAutoChunkBytes(0), kMinAutoChunkBytes);
  EXPECT_EQ(MinAutoChunkBytes(1000000000), 64u << 10);
  EXPECT_EQ(MinAutoChunkBytes(int64_t{400} * 1000000000), 64u << 10);
  // 62.5 KB in 0.5 ms at 1 Gbit/s, 31.25 KB at 500 Mbit/s.
  EXPECT_EQ(MinAutoChunkBytes(900000000), 64u << 10);
  EXPECT_EQ(MinAutoChunkBytes(500000000), 32u << 10);
  EXPECT_EQ(MinAutoChunkBytes(200000000), 16u << 10);
  EXPECT_EQ(MinAutoChunkBytes(100000000), kMinSlowLinkChunkBytes);
  EXPECT_EQ(MinAutoChunkBytes(1000000), kMinSlowLinkChunkBytes);
  // The main job at 100 Mbit/s: 16 KiB; at 1 Gbit/s as without a rate.
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 100000000), 16u << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 1000000000), 64u << 10);
  // A model large enough keeps its 1/128 whatever the link.
  EXPECT_EQ(AutoChunkBytes(int64_t{51200000}, 100000000), 256u << 10);
  v1::Layout layout = MakeLayout({{512 << 10}}, 0);
  ChooseChunkBytes(layout, 100000000);
  EXPECT_EQ(layout.chunk_bytes(), 16u << 10);
  EXPECT_EQ(layout.chunk_count_multiple(), kAutoChunkCountMultiple);
}

TEST(ChunkingTest, AutoChunkRulesHoldForTheBytesOnTheWire) {
  // bf16 both ways: the main job's chunks carry 64 KiB on the wire, 128 KiB
  // of fp32; 1 byte an element, 256 KiB.
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 0, 2), 128u << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 1000000000, 2), 128u << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 0, 1), 256u << 10);
  // 16 KiB on the wire at 100 Mbit/s.
  EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 100000000, 2), 32u << 10);
  // A 1/128 of the wire bytes: the wide GPT keeps its 256 KiB of fp32.
  EXPECT_EQ(AutoChunkBytes(int64_t{51200000}, 0, 2), 256u << 10);
  // At most kMaxAutoChunkBytes on the wire.
  EXPECT_EQ(AutoChunkBytes(int64_t{1} << 40, 0, 2), 2 * kMaxAutoChunkBytes);
  // fp32, and anything that is not 1 or 2 bytes: as before.
  for (const int bytes : {4, 0, 3, 8, -2}) {
    EXPECT_EQ(AutoChunkBytes(int64_t{2} << 20, 0, bytes), 64u << 10) << bytes;
  }
  v1::Layout layout = MakeLayout({{512 << 10}}, 0);
  ChooseChunkBytes(layout, 1000000000, 2);
  EXPECT_EQ(layout.chunk_bytes(), 128u << 10);
  EXPECT_EQ(layout.chunk_count_multiple(), kAutoChunkCountMultiple);
  // A size given is left alone.
  layout.set_chunk_bytes(4096);
  ChooseChunkBytes(layout, 1000000000, 2);
  EXPECT_EQ(layout.chunk_bytes(), 4096u);
}

TEST(ChunkingTest, ATensorOfManyChunksSplitsIntoAMultipleOfTheMultiple) {
  EXPECT_EQ(ChunkCount(100, 10, 0), 10);
  EXPECT_EQ(ChunkCount(101, 10, 0), 11);
  EXPECT_EQ(ChunkCount(101, 10, 1), 11);
  EXPECT_EQ(ChunkCount(101, 10, 8), 16);
  EXPECT_EQ(ChunkCount(80, 10, 8), 8);
  EXPECT_EQ(ChunkCount(70, 10, 8), 7);  // fewer than 8: left as it is
  EXPECT_EQ(ChunkCount(9, 1, 8), 9);    // never more chunks than elements
  EXPECT_EQ(ChunkCount(1, 4096, 8), 1);

  v1::Layout layout = MakeLayout({{101}, {70}}, 40);
  layout.set_chunk_count_multiple(8);
  ASSERT_TRUE(ValidateLayout(layout).ok());
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  ASSERT_EQ(chunks.size(), 16u + 7u);
  int64_t covered = 0;
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(chunks[i].offset, covered);
    EXPECT_GE(chunks[i].num_elements, 6);  // 101 = 5 x 7 + 11 x 6
    EXPECT_LE(chunks[i].num_elements, 7);
    covered += chunks[i].num_elements;
  }
  EXPECT_EQ(covered, 101);
  EXPECT_EQ(chunks[16].tensor, 1u);
}

// The main job's model (784-512-256-10, 2.04 MiB) at its automatic chunk
// size: fc1.weight's 401408 elements, 24.5 chunks' worth, split into 32
// chunks, so 2, 4 and 8 servers own equal shares of it and differ only by
// the small tensors (within 2 %, 2 %, 4 % of the mean bytes), 3 within 10 %.
// Without the multiple, 25 chunks left one of 4 servers 8.4 % over the mean.
TEST(ChunkingTest, AutoChunksBalanceTheMainJobsModelOverTwoFourAndEight) {
  v1::Layout layout =
      MakeLayout({{784, 512}, {512}, {512, 256}, {256}, {256, 10}, {10}}, 0);
  const int64_t model_bytes = ModelBytes(layout);
  EXPECT_EQ(model_bytes, 2143272);  // 535818 floats
  ChooseChunkBytes(layout);
  EXPECT_EQ(layout.chunk_bytes(), 64u << 10);
  EXPECT_EQ(layout.chunk_count_multiple(), kAutoChunkCountMultiple);
  ASSERT_TRUE(ValidateLayout(layout).ok());
  const std::vector<ChunkSpec> chunks = MakeChunks(layout);
  EXPECT_EQ(chunks.size(), 32u + 1 + 8 + 1 + 1 + 1);
  for (uint32_t shards : {2u, 3u, 4u, 8u}) {
    SCOPED_TRACE(shards);
    const std::vector<uint32_t> shard_of = PartitionChunks(chunks, shards);
    std::vector<int64_t> load(shards, 0);
    for (size_t i = 0; i < chunks.size(); ++i) {
      load[shard_of[i]] += chunks[i].bytes();
    }
    const double mean = static_cast<double>(model_bytes) / shards;
    const double within = shards == 3 ? 0.10 : shards == 8 ? 0.04 : 0.02;
    EXPECT_LE(*std::max_element(load.begin(), load.end()), (1 + within) * mean);
    EXPECT_GE(*std::min_element(load.begin(), load.end()), (1 - within) * mean);
  }
}

TEST(ChunkingTest, AGivenChunkSizeKeepsItsCount) {
  v1::Layout layout = MakeLayout({{784, 512}}, 64 << 10);
  ChooseChunkBytes(layout);
  EXPECT_EQ(layout.chunk_count_multiple(), 0u);
  EXPECT_EQ(MakeChunks(layout).size(), 25u);
}

TEST(ChunkingTest, RejectsBadLayouts) {
  struct Case {
    const char* what;
    v1::Layout layout;
  };
  std::vector<Case> cases;
  cases.push_back({"no tensors", v1::Layout()});
  cases.push_back({"zero dim", MakeLayout({{3, 0}}, 0)});
  cases.push_back({"no shape", MakeLayout({{}}, 0)});
  cases.push_back({"odd chunk bytes", MakeLayout({{3}}, 6)});
  cases.push_back({"huge chunk", MakeLayout({{3}}, uint64_t{1} << 30)});
  v1::Layout multiple = MakeLayout({{3}}, 0);
  multiple.set_chunk_count_multiple(kMaxChunkCountMultiple + 1);
  cases.push_back({"chunk count multiple over the most", multiple});
  v1::Layout dup = MakeLayout({{3}, {4}}, 0);
  dup.mutable_tensors(1)->set_name("t0");
  cases.push_back({"duplicate name", dup});
  v1::Layout unnamed = MakeLayout({{3}}, 0);
  unnamed.mutable_tensors(0)->clear_name();
  cases.push_back({"empty name", unnamed});
  v1::Layout huge = MakeLayout({{int64_t{1} << 30, int64_t{1} << 30}}, 0);
  cases.push_back({"too many elements", huge});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::Status s = ValidateLayout(c.layout);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
}

TEST(ChunkingTest, FingerprintChangesWithLayoutAndOptimizer) {
  v1::Layout a = MakeLayout({{3}}, 0);
  v1::Layout b = MakeLayout({{4}}, 0);
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OptimizerSpec::KIND_SGD);
  v1::OptimizerSpec adam;
  adam.set_kind(v1::OptimizerSpec::KIND_ADAM);
  EXPECT_EQ(Fingerprint(a, sgd), Fingerprint(a, sgd));
  EXPECT_NE(Fingerprint(a, sgd), Fingerprint(b, sgd));
  EXPECT_NE(Fingerprint(a, sgd), Fingerprint(a, adam));
}

}  // namespace
}  // namespace shardps
