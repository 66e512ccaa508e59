// ParameterStore::RequestCheckpoint: a checkpoint at a step asked for while
// training runs, besides the periodic ones.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

// The checkpoints a store hands over, in the order they came.
class Handovers {
 public:
  void Take(int64_t step, std::vector<ChunkState> chunks) {
    absl::MutexLock lock(&mu_);
    std::sort(chunks.begin(), chunks.end(),
              [](const ChunkState& a, const ChunkState& b) {
                return a.chunk_id < b.chunk_id;
              });
    taken_.emplace_back(step, std::move(chunks));
  }
  std::vector<std::pair<int64_t, std::vector<ChunkState>>> Wait(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return taken_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return taken_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<int64_t, std::vector<ChunkState>>> taken_
      ABSL_GUARDED_BY(mu_);
};

constexpr uint32_t kWorkers = 2;
constexpr uint32_t kChunks = 10;

// One tensor of 40 elements in 10 chunks of 4, SGD with momentum (so the
// optimizer slots are saved too).
v1::DeclareRequest Declaration() {
  v1::DeclareRequest req;
  v1::TensorSpec* t = req.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(40);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_UNIFORM);
  t->mutable_init()->set_value(0.5f);
  t->mutable_init()->set_seed(7);
  req.mutable_layout()->set_chunk_bytes(16);
  req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  req.mutable_optimizer()->set_learning_rate(0.1f);
  req.mutable_optimizer()->set_momentum(0.9f);
  req.set_num_shards(1);
  return req;
}

StoreOptions Options(Handovers* handovers, int64_t every) {
  StoreOptions o;
  o.num_workers = kWorkers;
  o.checkpoint_every = every;
  if (handovers != nullptr) {
    o.on_checkpoint = [handovers](int64_t step, std::vector<ChunkState> c) {
      handovers->Take(step, std::move(c));
    };
  }
  return o;
}

std::unique_ptr<ParameterStore> Declared(const StoreOptions& options) {
  auto store = std::make_unique<ParameterStore>(options);
  EXPECT_TRUE(store->Declare(Declaration()).ok());
  return store;
}

// Every worker pushes `step` for chunks [first, last); returns once all of
// them are applied.
void PushStep(ParameterStore* store, int64_t step, uint32_t first = 0,
              uint32_t last = kChunks) {
  PushSyncStep(store, step, kWorkers, first, last, /*chunk_stride=*/1);
}

void Train(ParameterStore* store, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) PushStep(store, step);
}

std::vector<std::vector<float>> AllWeights(const ParameterStore& store) {
  std::vector<std::vector<float>> out;
  for (uint32_t chunk = 0; chunk < kChunks; ++chunk) {
    absl::StatusOr<ChunkReply> r = store.Read(chunk);
    EXPECT_TRUE(r.ok()) << r.status();
    out.push_back(r.ok() ? *r->weights : std::vector<float>());
  }
  return out;
}

TEST(RequestedCheckpointTest, CopiesEveryChunkAtTheStepAndChangesNothing) {
  Handovers handovers;
  std::unique_ptr<ParameterStore> store =
      Declared(Options(&handovers, /*every=*/0));
  Train(store.get(), 0, 2);
  SHARDPS_ASSERT_OK(store->RequestCheckpoint(5));
  SHARDPS_ASSERT_OK(store->RequestCheckpoint(5));  // asked twice: one copy
  Train(store.get(), 2, 8);
  const auto taken = handovers.Wait(1);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].first, 5);

  // The copy is the state of a run stopped at step 5, and the run goes on
  // exactly as one without the request.
  std::unique_ptr<ParameterStore> plain = Declared(Options(nullptr, 0));
  Train(plain.get(), 0, 5);
  const std::vector<std::vector<float>> at_5 = AllWeights(*plain);
  ASSERT_EQ(taken[0].second.size(), kChunks);
  for (uint32_t chunk = 0; chunk < kChunks; ++chunk) {
    const ChunkState& c = taken[0].second[chunk];
    EXPECT_EQ(c.chunk_id, chunk);
    EXPECT_EQ(c.version, 5);
    EXPECT_EQ(c.weights, at_5[chunk]) << chunk;
    EXPECT_EQ(c.slots.size(), 1u);  // momentum
  }
  Train(plain.get(), 5, 8);
  EXPECT_EQ(AllWeights(*store), AllWeights(*plain));
  store.reset();  // runs whatever is queued
  EXPECT_EQ(handovers.Wait(1).size(), 1u);
}

TEST(RequestedCheckpointTest, AddsToThePeriodicCheckpoints) {
  Handovers handovers;
  std::unique_ptr<ParameterStore> store =
      Declared(Options(&handovers, /*every=*/4));
  SHARDPS_ASSERT_OK(store->RequestCheckpoint(6));
  SHARDPS_ASSERT_OK(store->RequestCheckpoint(8));  // periodic anyway
  Train(store.get(), 0, 9);
  store.reset();
  auto taken = handovers.Wait(3);
  std::vector<int64_t> steps;
  for (const auto& [step, chunks] : taken) {
    steps.push_back(step);
    EXPECT_EQ(chunks.size(), kChunks) << step;
  }
  std::sort(steps.begin(), steps.end());
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 6, 8}));
}

TEST(RequestedCheckpointTest, RefusesWhatCannotBeCheckpointed) {
  Handovers handovers;
  ParameterStore undeclared(Options(&handovers, 0));
  EXPECT_EQ(undeclared.RequestCheckpoint(3).code(),
            absl::StatusCode::kFailedPrecondition);

  std::unique_ptr<ParameterStore> off = Declared(Options(nullptr, 0));
  EXPECT_EQ(off->RequestCheckpoint(3).code(),
            absl::StatusCode::kFailedPrecondition);

  std::unique_ptr<ParameterStore> store = Declared(Options(&handovers, 0));
  EXPECT_EQ(store->RequestCheckpoint(-1).code(),
            absl::StatusCode::kInvalidArgument);
  Train(store.get(), 0, 3);
  // Reached (3) or passed (2): too late.
  const absl::Status reached = store->RequestCheckpoint(3);
  EXPECT_EQ(reached.code(), absl::StatusCode::kOutOfRange) << reached;
  EXPECT_NE(reached.message().find("already reached step 3"), std::string::npos)
      << reached;
  EXPECT_EQ(store->RequestCheckpoint(2).code(), absl::StatusCode::kOutOfRange);
  Train(store.get(), 3, 6);
  store.reset();
  EXPECT_TRUE(handovers.Wait(0).empty());
}

TEST(RequestedCheckpointTest, ARefusedRequestLeavesNoPartialCheckpoint) {
  Handovers handovers;
  std::unique_ptr<ParameterStore> store = Declared(Options(&handovers, 0));
  Train(store.get(), 0, 2);
  // Chunks 5..9 finish step 2 before 0..4: the request for step 3 marks
  // 0..4, then finds chunk 5 there already and takes the marks back.
  PushStep(store.get(), 2, 5, kChunks);
  EXPECT_EQ(store->RequestCheckpoint(3).code(), absl::StatusCode::kOutOfRange);
  PushStep(store.get(), 2, 0, 5);
  Train(store.get(), 3, 5);
  // A later request still gets every chunk, and only its own step.
  SHARDPS_ASSERT_OK(store->RequestCheckpoint(6));
  Train(store.get(), 5, 7);
  store.reset();
  const auto taken = handovers.Wait(1);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].first, 6);
  EXPECT_EQ(taken[0].second.size(), kChunks);
}

}  // namespace
}  // namespace shardps::server
