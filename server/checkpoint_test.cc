#include "server/checkpoint.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/crc32c.h"
#include "common/partitioner.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps::server {
namespace {

namespace fs = std::filesystem;

// A fresh directory under $TEST_TMPDIR (or /tmp), removed with its contents.
class TempDir {
 public:
  TempDir() : path_(shardps::testing::MakeTempDir("ckpt_test")) {}
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, ec);
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// 16 chunks of at most 100 floats over three tensors; Adam has two slots.
v1::DeclareRequest Declaration(float learning_rate = 0.01f) {
  v1::DeclareRequest d;
  v1::Layout* layout = d.mutable_layout();
  layout->set_chunk_bytes(400);
  for (const auto& [name, shape] :
       std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"fc1.weight", {40, 30}},
           {"fc1.bias", {30}},
           {"fc2.weight", {30, 10}}}) {
    v1::TensorSpec* t = layout->add_tensors();
    t->set_name(name);
    for (const int64_t dim : shape) t->add_shape(dim);
  }
  d.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_ADAM);
  d.mutable_optimizer()->set_learning_rate(learning_rate);
  return d;
}

// Deterministic state of chunk `spec` at `step`.
ChunkState StateOf(const ChunkSpec& spec, int64_t step) {
  ChunkState s{spec.id, step + spec.id % 3, {}, {{}, {}}};
  for (int64_t i = 0; i < spec.num_elements; ++i) {
    s.weights.push_back(0.25f +
                        static_cast<float>(step * 10000 + spec.id * 100 + i));
    s.slots[0].push_back(-0.5f * static_cast<float>(spec.id + i));
    s.slots[1].push_back(1e-3f * static_cast<float>(i + step));
  }
  // Some chunks had steps skipped whole (loss scaling), the others none.
  s.skipped_updates = spec.id % 2 == 0 ? step / 2 : 0;
  return s;
}

std::vector<ChunkState> ShardStates(const v1::DeclareRequest& d, uint32_t shard,
                                    uint32_t num_shards, int64_t step) {
  const std::vector<ChunkSpec> chunks = MakeChunks(d.layout());
  const std::vector<uint32_t> owner = PartitionChunks(chunks, num_shards);
  std::vector<ChunkState> states;
  for (const ChunkSpec& spec : chunks) {
    if (owner[spec.id] == shard) states.push_back(StateOf(spec, step));
  }
  return states;
}

// Every shard writes step `step`, then the step is committed.
absl::Status WriteCheckpoint(const std::string& dir, int64_t step,
                             uint32_t num_shards,
                             const v1::DeclareRequest& d = Declaration()) {
  std::vector<ShardFile> files;
  for (uint32_t s = 0; s < num_shards; ++s) {
    absl::StatusOr<ShardFile> f = WriteShardCheckpoint(
        dir, step, s, num_shards, d, ShardStates(d, s, num_shards, step));
    if (!f.ok()) return f.status();
    files.push_back(*f);
  }
  return CommitCheckpoint(dir, step, num_shards, files);
}

void ExpectEqualStates(const ChunkState& got, const ChunkState& want) {
  SCOPED_TRACE(absl::StrCat("chunk ", want.chunk_id));
  EXPECT_EQ(got.chunk_id, want.chunk_id);
  EXPECT_EQ(got.version, want.version);
  EXPECT_EQ(got.skipped_updates, want.skipped_updates);
  EXPECT_EQ(got.weights, want.weights);
  EXPECT_EQ(got.slots, want.slots);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(CheckpointTest, RoundTripsWeightsSlotsAndVersions) {
  TempDir tmp;
  const v1::DeclareRequest d = Declaration();
  SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 7, 3));
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  EXPECT_EQ(info->step, 7);
  EXPECT_EQ(info->step_dir, StepDirectory(tmp.path(), 7));
  EXPECT_EQ(info->num_shards, 3u);
  EXPECT_EQ(info->fingerprint, Fingerprint(d.layout(), d.optimizer()));
  EXPECT_TRUE(info->skipped.empty());
  ASSERT_EQ(info->files.size(), 3u);
  for (const ShardFile& f : info->files) {
    const std::string bytes = ReadBytes(info->step_dir + "/" + f.name);
    EXPECT_EQ(f.bytes, bytes.size()) << f.name;
    EXPECT_EQ(f.crc32c, Crc32c(0, bytes.data(), bytes.size())) << f.name;
  }
  for (uint32_t s = 0; s < 3; ++s) {
    absl::StatusOr<std::vector<ChunkState>> got =
        LoadChunksForShard(*info, s, 3, d);
    SHARDPS_ASSERT_OK(got);
    const std::vector<ChunkState> want = ShardStates(d, s, 3, 7);
    ASSERT_EQ(got->size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      ExpectEqualStates((*got)[i], want[i]);
  }
}

TEST(CheckpointTest, RestoresOntoADifferentNumberOfShards) {
  TempDir tmp;
  const v1::DeclareRequest d = Declaration();
  SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 3, 3));
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  const std::vector<ChunkSpec> chunks = MakeChunks(d.layout());
  for (const uint32_t n : {1u, 2u, 4u}) {
    SCOPED_TRACE(absl::StrCat(n, " shards"));
    const std::vector<uint32_t> owner = PartitionChunks(chunks, n);
    std::multiset<uint32_t> seen;
    for (uint32_t s = 0; s < n; ++s) {
      absl::StatusOr<std::vector<ChunkState>> got =
          LoadChunksForShard(*info, s, n, d);
      SHARDPS_ASSERT_OK(got);
      for (const ChunkState& c : *got) {
        EXPECT_EQ(owner[c.chunk_id], s) << c.chunk_id;
        ExpectEqualStates(c, StateOf(chunks[c.chunk_id], 3));
        seen.insert(c.chunk_id);
      }
    }
    EXPECT_EQ(seen.size(), chunks.size());
    for (const ChunkSpec& spec : chunks) EXPECT_EQ(seen.count(spec.id), 1u);
  }
}

// A tensor with its own optimizer saves that optimizer's slots.
TEST(CheckpointTest, SavesEachTensorsOwnSlots) {
  TempDir tmp;
  v1::DeclareRequest d = Declaration();
  v1::OptimizerSpec* sgd =
      d.mutable_layout()->mutable_tensors(1)->mutable_optimizer();
  sgd->set_kind(v1::OptimizerSpec::KIND_SGD);  // fc1.bias: no slots
  sgd->set_learning_rate(0.1f);
  std::vector<ChunkState> states = ShardStates(d, 0, 1, 5);
  const std::vector<ChunkSpec> chunks = MakeChunks(d.layout());
  // Adam's two slots do not fit fc1.bias.
  EXPECT_EQ(
      WriteShardCheckpoint(tmp.path(), 5, 0, 1, d, states).status().code(),
      absl::StatusCode::kInvalidArgument);
  for (ChunkState& s : states) {
    if (chunks[s.chunk_id].tensor == 1) s.slots.clear();
  }
  absl::StatusOr<ShardFile> f =
      WriteShardCheckpoint(tmp.path(), 5, 0, 1, d, states);
  SHARDPS_ASSERT_OK(f);
  SHARDPS_ASSERT_OK(CommitCheckpoint(tmp.path(), 5, 1, {*f}));
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  for (const uint32_t n : {1u, 2u}) {
    for (uint32_t shard = 0; shard < n; ++shard) {
      absl::StatusOr<std::vector<ChunkState>> got =
          LoadChunksForShard(*info, shard, n, d);
      SHARDPS_ASSERT_OK(got);
      for (const ChunkState& c : *got) ExpectEqualStates(c, states[c.chunk_id]);
    }
  }
}

TEST(CheckpointTest, ChoosesTheNewestCommittedStep) {
  TempDir tmp;
  for (const int64_t step : {5, 15, 10}) {
    SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), step, 2));
  }
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  EXPECT_EQ(info->step, 15);
  absl::StatusOr<std::vector<ChunkState>> got =
      LoadChunksForShard(*info, 0, 1, Declaration());
  SHARDPS_ASSERT_OK(got);
  ASSERT_FALSE(got->empty());
  EXPECT_EQ((*got)[0].version, 15);
}

TEST(CheckpointTest, NeverLoadsATornCheckpoint) {
  const std::string shard1 = "/shard-1-of-3.safetensors";
  const std::vector<std::pair<std::string, std::function<void(std::string)>>>
      cases = {
          {"no COMMITTED", [](std::string d) { fs::remove(d + "/COMMITTED"); }},
          {"truncated file",
           [&](std::string d) { fs::resize_file(d + shard1, 1000); }},
          {"flipped data byte",
           [&](std::string d) {
             std::string b = ReadBytes(d + shard1);
             b[b.size() - 5] ^= 0x10;
             WriteBytes(d + shard1, b);
           }},
          {"flipped header byte",
           [&](std::string d) {
             std::string b = ReadBytes(d + shard1);
             b[b.find("versions") + 1] ^= 0x01;
             WriteBytes(d + shard1, b);
           }},
          {"missing file", [&](std::string d) { fs::remove(d + shard1); }},
          {"garbage manifest",
           [](std::string d) { WriteBytes(d + "/COMMITTED", "{not: it}\n"); }},
      };
  for (const auto& [name, tear] : cases) {
    SCOPED_TRACE(name);
    TempDir tmp;
    SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 10, 3));
    SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 20, 3));
    tear(StepDirectory(tmp.path(), 20));
    absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
    SHARDPS_ASSERT_OK(info);
    EXPECT_EQ(info->step, 10);
    ASSERT_EQ(info->skipped.size(), 1u);
    EXPECT_EQ(info->skipped[0].rfind("step-000000000020: ", 0), 0u)
        << info->skipped[0];

    fs::remove_all(StepDirectory(tmp.path(), 10));
    EXPECT_TRUE(absl::IsNotFound(LatestCommitted(tmp.path()).status()));
  }
}

TEST(CheckpointTest, RewritingAStepUncommitsIt) {
  TempDir tmp;
  const v1::DeclareRequest d = Declaration();
  SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 10, 1));
  SHARDPS_ASSERT_OK(
      WriteShardCheckpoint(tmp.path(), 10, 0, 1, d, ShardStates(d, 0, 1, 11)));
  EXPECT_TRUE(absl::IsNotFound(LatestCommitted(tmp.path()).status()));
}

TEST(CheckpointTest, RejectsADifferentModel) {
  TempDir tmp;
  SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), 1, 2));
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  absl::StatusOr<std::vector<ChunkState>> got =
      LoadChunksForShard(*info, 0, 2, Declaration(/*learning_rate=*/0.5f));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(got.status().message().find("different model"), std::string::npos)
      << got.status();
}

TEST(CheckpointTest, RejectsChunksTheShardDoesNotOwnExactly) {
  TempDir tmp;
  const v1::DeclareRequest d = Declaration();
  std::vector<ChunkState> states = ShardStates(d, 0, 2, 1);
  std::vector<ChunkState> missing(states.begin() + 1, states.end());
  EXPECT_EQ(
      WriteShardCheckpoint(tmp.path(), 1, 0, 2, d, missing).status().code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<ChunkState> foreign = states;
  foreign.push_back(ShardStates(d, 1, 2, 1)[0]);
  EXPECT_EQ(
      WriteShardCheckpoint(tmp.path(), 1, 0, 2, d, foreign).status().code(),
      absl::StatusCode::kInvalidArgument);
  states[0].slots.pop_back();
  EXPECT_EQ(
      WriteShardCheckpoint(tmp.path(), 1, 0, 2, d, states).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, CommitNeedsEveryShardFile) {
  TempDir tmp;
  const v1::DeclareRequest d = Declaration();
  absl::StatusOr<ShardFile> f =
      WriteShardCheckpoint(tmp.path(), 4, 0, 2, d, ShardStates(d, 0, 2, 4));
  SHARDPS_ASSERT_OK(f);
  EXPECT_EQ(CommitCheckpoint(tmp.path(), 4, 2, {*f}).code(),
            absl::StatusCode::kInvalidArgument);
  ShardFile ghost = *f;
  ghost.shard_index = 1;
  ghost.name = "shard-1-of-2.safetensors";
  EXPECT_EQ(CommitCheckpoint(tmp.path(), 4, 2, {*f, ghost}).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CheckpointTest, UnwritableDirectoryIsAFailedPrecondition) {
  TempDir tmp;
  ASSERT_EQ(chmod(tmp.path().c_str(), 0500), 0);
  if (access(tmp.path().c_str(), W_OK) == 0) {
    GTEST_SKIP() << "chmod 0500 does not stop this user (root?) from writing";
  }
  const v1::DeclareRequest d = Declaration();
  const std::string dir = tmp.path() + "/ckpt";
  absl::StatusOr<ShardFile> f =
      WriteShardCheckpoint(dir, 1, 0, 1, d, ShardStates(d, 0, 1, 1));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(f.status().message().find(dir), std::string::npos) << f.status();
}

TEST(CheckpointTest, DirectoryThroughAFileIsAFailedPrecondition) {
  TempDir tmp;
  const std::string file = tmp.path() + "/plain";
  WriteBytes(file, "x");
  const v1::DeclareRequest d = Declaration();
  absl::StatusOr<ShardFile> f =
      WriteShardCheckpoint(file + "/ckpt", 1, 0, 1, d, ShardStates(d, 0, 1, 1));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(f.status().message().find(file), std::string::npos) << f.status();
}

TEST(CheckpointTest, PruneKeepsTheNewestCommittedAndWhatIsInProgress) {
  TempDir tmp;
  for (const int64_t step : {1, 2, 3, 4, 5, 6}) {
    SHARDPS_ASSERT_OK(WriteCheckpoint(tmp.path(), step, 2));
  }
  fs::remove(StepDirectory(tmp.path(), 3) + "/COMMITTED");  // torn
  fs::remove(StepDirectory(tmp.path(), 6) + "/COMMITTED");  // in progress
  EXPECT_EQ(PruneCheckpoints(tmp.path(), 0).code(),
            absl::StatusCode::kInvalidArgument);
  SHARDPS_ASSERT_OK(PruneCheckpoints(tmp.path(), 2));
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    left.insert(e.path().filename().string());
  }
  EXPECT_EQ(left,
            (std::set<std::string>{"step-000000000004", "step-000000000005",
                                   "step-000000000006"}));
  absl::StatusOr<CheckpointInfo> info = LatestCommitted(tmp.path());
  SHARDPS_ASSERT_OK(info);
  EXPECT_EQ(info->step, 5);
}

TEST(CheckpointTest, ReportsWriteTimeForA64MiBShard) {
  TempDir tmp;
  v1::DeclareRequest d;
  v1::TensorSpec* t = d.mutable_layout()->add_tensors();
  t->set_name("big");
  t->add_shape(int64_t{16} << 20);  // 64 MiB of fp32 in 16 chunks of 4 MiB
  d.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  d.mutable_optimizer()->set_learning_rate(0.1f);
  std::vector<ChunkState> states;
  for (const ChunkSpec& spec : MakeChunks(d.layout())) {
    states.push_back(
        {spec.id, 1, std::vector<float>(spec.num_elements, 0.5f), {}});
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<ShardFile> f =
      WriteShardCheckpoint(tmp.path(), 1, 0, 1, d, states);
  const absl::Duration write = absl::Now() - start;
  SHARDPS_ASSERT_OK(f);
  SHARDPS_ASSERT_OK(CommitCheckpoint(tmp.path(), 1, 1, {*f}));
  const absl::Time verify_start = absl::Now();
  SHARDPS_ASSERT_OK(LatestCommitted(tmp.path()));
  const absl::Duration verify = absl::Now() - verify_start;
  const double mib = static_cast<double>(f->bytes) / (1 << 20);
  std::printf("checkpoint write: %.1f ms/MiB (%.0f MiB in %.0f ms)\n",
              absl::ToDoubleMilliseconds(write) / mib, mib,
              absl::ToDoubleMilliseconds(write));
  std::printf("checkpoint verify: %.1f ms/MiB\n",
              absl::ToDoubleMilliseconds(verify) / mib);
}

}  // namespace
}  // namespace shardps::server
