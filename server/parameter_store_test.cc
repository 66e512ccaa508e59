#include "server/parameter_store.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/chunking.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

TEST_F(StoreFixture, SyncStepWaitsForEveryWorkerThenAppliesTheMean) {
  Make(2);
  auto sink0 = std::make_shared<CollectingSink>();
  auto sink1 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 2, 3, 4}, sink0));
  EXPECT_EQ(sink0->count(), 0u);  // still waiting for rank 1
  EXPECT_EQ(Weights(), std::vector<float>(4, 1.0f));
  SHARDPS_ASSERT_OK(Push(1, 0, {3, 2, 1, 0}, sink1));
  std::vector<ChunkReply> r0 = sink0->Wait(1), r1 = sink1->Wait(1);
  ASSERT_EQ(r0.size(), 1u);
  ASSERT_EQ(r1.size(), 1u);
  // mean = (2, 2, 2, 2); w = 1 - 2.
  EXPECT_EQ(Floats(r0[0].weights), std::vector<float>(4, -1.0f));
  EXPECT_EQ(r0[0].version, 1);
  EXPECT_EQ(Floats(r1[0].weights), std::vector<float>(4, -1.0f));
}

TEST_F(StoreFixture, RankOrderMakesTheSumIndependentOfArrivalOrder) {
  // Values whose float sum depends on the order: (a + b) + c != a + (b + c).
  const std::vector<float> g0 = {1e8f, 1, 1, 1}, g1 = {-1e8f, 1, 1, 1},
                           g2 = {1.0f, 1, 1, 1};
  std::vector<float> want;
  for (int order = 0; order < 2; ++order) {
    Make(3);
    auto sink = std::make_shared<CollectingSink>();
    if (order == 0) {
      SHARDPS_ASSERT_OK(Push(0, 0, g0, sink));
      SHARDPS_ASSERT_OK(Push(1, 0, g1, sink));
      SHARDPS_ASSERT_OK(Push(2, 0, g2, sink));
    } else {
      SHARDPS_ASSERT_OK(Push(2, 0, g2, sink));
      SHARDPS_ASSERT_OK(Push(1, 0, g1, sink));
      SHARDPS_ASSERT_OK(Push(0, 0, g0, sink));
    }
    sink->Wait(3);
    std::vector<float> w = Weights();
    // Rank order: ((1e8 + -1e8) + 1) / 3 = 1/3, so w[0] = 1 - 1/3.
    EXPECT_EQ(w[0], 1.0f - ((1e8f + -1e8f) + 1.0f) / 3.0f);
    if (order == 0) want = w;
    EXPECT_EQ(w, want);
  }
}

TEST_F(StoreFixture, RetryOfAnAppliedStepIsNotAppliedTwice) {
  Make(1);
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink));
  sink->Wait(1);
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink));  // reply was lost
  std::vector<ChunkReply> replies = sink->Wait(2);
  ASSERT_EQ(replies.size(), 2u);
  EXPECT_EQ(replies[1].version, 1);
  EXPECT_EQ(Floats(replies[1].weights), std::vector<float>(4, 0.0f));
  EXPECT_EQ(Weights(), std::vector<float>(4, 0.0f));
}

TEST_F(StoreFixture, DuplicateOfAPendingPushOnlyAddsAWaiter) {
  Make(2);
  auto first = std::make_shared<CollectingSink>();
  auto retry = std::make_shared<CollectingSink>();
  auto other = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {2, 2, 2, 2}, first));
  SHARDPS_ASSERT_OK(Push(0, 0, {2, 2, 2, 2}, retry));
  SHARDPS_ASSERT_OK(Push(1, 0, {0, 0, 0, 0}, other));
  EXPECT_EQ(retry->Wait(1).size(), 1u);
  EXPECT_EQ(Weights(), std::vector<float>(4, 0.0f));  // 1 - (2 + 0) / 2
}

TEST_F(StoreFixture, AsyncAppliesOnArrival) {
  Make(2, v1::CONSISTENCY_ASYNC);
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink));
  EXPECT_EQ(sink->Wait(1)[0].version, 1);
  SHARDPS_ASSERT_OK(Push(1, 0, {1, 1, 1, 1}, sink));
  EXPECT_EQ(sink->Wait(2)[1].version, 2);
  EXPECT_EQ(Weights(), std::vector<float>(4, -1.0f));
  // Retry of rank 1's step 0: answered, not applied.
  SHARDPS_ASSERT_OK(Push(1, 0, {1, 1, 1, 1}, sink));
  EXPECT_EQ(sink->Wait(3)[2].version, 2);
  EXPECT_EQ(Weights(), std::vector<float>(4, -1.0f));
}

TEST_F(StoreFixture, SyncWaitsAsyncDoesNotSspBoundsTheGap) {
  constexpr int64_t kSteps = 6;
  struct Case {
    const char* what;
    v1::Consistency mode;
    int64_t staleness;
    size_t completed;  // of rank 0's steps, while rank 1 is stalled
  };
  for (const Case& c : {Case{"sync", v1::CONSISTENCY_SYNC, 0, 0},
                        Case{"async", v1::CONSISTENCY_ASYNC, 0, kSteps},
                        Case{"ssp:0", v1::CONSISTENCY_SSP, 0, 0},
                        Case{"ssp:2", v1::CONSISTENCY_SSP, 2, 2},
                        Case{"ssp:4", v1::CONSISTENCY_SSP, 4, 4}}) {
    SCOPED_TRACE(c.what);
    Make(2, c.mode, c.staleness);
    auto fast = std::make_shared<CollectingSink>();
    int64_t pushed = 0;
    // Rank 0 pushes its next step as soon as its previous one completed.
    auto run_fast = [&] {
      while (pushed < kSteps && fast->count() == static_cast<size_t>(pushed)) {
        ASSERT_TRUE(Push(0, pushed++, {1, 1, 1, 1}, fast).ok());
      }
    };
    run_fast();
    EXPECT_EQ(fast->count(), c.completed);
    if (c.mode != v1::CONSISTENCY_SSP) continue;
    // The stalled worker catches up one step at a time; each time rank 0
    // gets exactly `staleness` steps ahead of it, never more.
    auto slow = std::make_shared<CollectingSink>();
    for (int64_t step = 0; step < kSteps; ++step) {
      SHARDPS_ASSERT_OK(Push(1, step, {1, 1, 1, 1}, slow));
      run_fast();
      const size_t want = std::min<size_t>(kSteps, step + 1 + c.staleness);
      EXPECT_EQ(fast->count(), want) << "after rank 1's step " << step;
    }
    EXPECT_EQ(slow->Wait(kSteps).size(), static_cast<size_t>(kSteps));
  }
}

// Every rejected push gets its code and leaves weights, version and pending
// contributions unchanged.
TEST_F(StoreFixture, RejectedPushesChangeNothing) {
  Make(2);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* what;
    uint32_t rank;
    int64_t step;
    std::vector<float> grad;
    uint32_t chunk;
    absl::StatusCode code;
  };
  std::vector<Case> cases = {
      {"unknown chunk", 0, 0, {1, 1, 1, 1}, 7, absl::StatusCode::kNotFound},
      {"short payload", 0, 0, {1, 1, 1}, 0, absl::StatusCode::kInvalidArgument},
      {"long payload",
       0,
       0,
       {1, 1, 1, 1, 1},
       0,
       absl::StatusCode::kInvalidArgument},
      {"nan gradient",
       0,
       0,
       {1, nan, 1, 1},
       0,
       absl::StatusCode::kInvalidArgument},
      {"rank out of range",
       2,
       0,
       {1, 1, 1, 1},
       0,
       absl::StatusCode::kInvalidArgument},
      {"future step", 0, 5, {1, 1, 1, 1}, 0, absl::StatusCode::kOutOfRange},
      {"negative step",
       0,
       -1,
       {1, 1, 1, 1},
       0,
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto sink = std::make_shared<CollectingSink>();
    absl::Status s = Push(c.rank, c.step, c.grad, sink, c.chunk);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_EQ(sink->count(), 0u);
  }
  EXPECT_EQ(Weights(), std::vector<float>(4, 1.0f));
  // The step is still open for both ranks: a valid step completes normally.
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {4, 4, 4, 4}, sink));
  SHARDPS_ASSERT_OK(Push(1, 0, {0, 0, 0, 0}, sink));
  sink->Wait(2);
  EXPECT_EQ(Weights(), std::vector<float>(4, -1.0f));
  EXPECT_EQ(store_->Report().rejected_total(), cases.size());
}

TEST(ParameterStoreTest, PushBeforeDeclareIsFailedPrecondition) {
  ParameterStore store{StoreOptions()};
  std::string bytes(16, '\0');
  StringByteSource payload(bytes);
  PushArgs args;
  args.payload = &payload;
  EXPECT_EQ(store.Push(args, std::make_shared<CollectingSink>()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.Read(0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ParameterStoreTest, DeclareIsIdempotentAndRejectsADifferentLayout) {
  ParameterStore store{StoreOptions()};
  absl::StatusOr<v1::DeclareResponse> first =
      store.Declare(SgdDeclaration(10, 0, 1, 0));
  SHARDPS_ASSERT_OK(first);
  EXPECT_TRUE(first->created());
  absl::StatusOr<v1::DeclareResponse> again =
      store.Declare(SgdDeclaration(10, 0, 1, 0));
  SHARDPS_ASSERT_OK(again);
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->fingerprint(), first->fingerprint());
  EXPECT_EQ(store.Declare(SgdDeclaration(11, 0, 1, 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.Declare(SgdDeclaration(10, 0, 2, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Chunks chosen differently (a worker with other encodings or link rate)
  // are named.
  const absl::Status chunks =
      store.Declare(SgdDeclaration(10, 16, 1, 0)).status();
  EXPECT_EQ(chunks.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(
      chunks.message(),
      absl::StrCat("its chunks are of at most ", kDefaultChunkBytes,
                   " bytes, this declaration's of 16")))
      << chunks;
  EXPECT_TRUE(absl::StrContains(chunks.message(), "--chunk_kib")) << chunks;
}

TEST(ParameterStoreTest, OwnsExactlyItsPartitionOfTheChunks) {
  StoreOptions o;
  o.num_shards = 2;
  o.shard_index = 1;
  ParameterStore store(o);
  // 10 chunks of 4 floats.
  SHARDPS_ASSERT_OK(store.Declare(SgdDeclaration(40, 16, 2, 1)));
  std::vector<uint32_t> owned = store.OwnedChunks();
  EXPECT_EQ(owned.size(), 5u);
  for (uint32_t id = 0; id < 10; ++id) {
    bool mine = std::find(owned.begin(), owned.end(), id) != owned.end();
    EXPECT_EQ(store.Read(id).ok(), mine) << id;
    if (!mine) {
      EXPECT_EQ(store.Read(id).status().code(), absl::StatusCode::kNotFound);
    }
  }
}

TEST(ParameterStoreTest, NextStepIsPerRankInAsyncMode) {
  StoreOptions o;
  o.num_workers = 2;
  o.mode = v1::CONSISTENCY_ASYNC;
  ParameterStore store(o);
  SHARDPS_ASSERT_OK(store.Declare(SgdDeclaration(4, 0, 1, 0)));
  auto sink = std::make_shared<CollectingSink>();
  for (int64_t step = 0; step < 3; ++step) {
    std::string bytes = Bytes({1, 1, 1, 1});
    StringByteSource payload(bytes);
    PushArgs args;
    args.rank = 0;
    args.step = step;
    args.payload = &payload;
    SHARDPS_ASSERT_OK(store.Push(args, sink));
  }
  v1::DeclareRequest late = SgdDeclaration(4, 0, 1, 0);
  late.set_rank(1);
  absl::StatusOr<v1::DeclareResponse> r1 = store.Declare(late);
  SHARDPS_ASSERT_OK(r1);
  EXPECT_EQ(r1->next_step(), 0);  // rank 1 has pushed nothing
  late.set_rank(0);
  absl::StatusOr<v1::DeclareResponse> r0 = store.Declare(late);
  SHARDPS_ASSERT_OK(r0);
  EXPECT_EQ(r0->next_step(), 3);
}

TEST(ParameterStoreTest, LayoutsWithTooManyChunksAreRefused) {
  ParameterStore store{StoreOptions()};
  // 2^22 floats in 4-byte chunks: 4M chunks, over the limit.
  v1::DeclareRequest req = SgdDeclaration(int64_t{1} << 22, 4, 1, 0);
  absl::Status s = store.Declare(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("chunks"), absl::string_view::npos) << s;
}

TEST(ParameterStoreTest, BadDeclarationsAreInvalidArgument) {
  ParameterStore store{StoreOptions()};
  v1::DeclareRequest no_optimizer = SgdDeclaration(4, 0, 1, 0);
  no_optimizer.mutable_optimizer()->set_kind(
      v1::OptimizerSpec::KIND_UNSPECIFIED);
  EXPECT_EQ(store.Declare(no_optimizer).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::DeclareRequest bad_shape = SgdDeclaration(4, 0, 1, 0);
  bad_shape.mutable_layout()->mutable_tensors(0)->set_shape(0, 0);
  EXPECT_EQ(store.Declare(bad_shape).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(store.Report().declared());
}

}  // namespace
}  // namespace shardps::server

namespace shardps::server {
namespace {

// Trains a 2-worker sync store for `steps` steps of deterministic gradients.
void TrainSync(ParameterStore* store, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) {
    PushSyncStep(store, step, /*workers=*/2, /*first=*/0, /*last=*/10,
                 /*chunk_stride=*/4);
  }
}

v1::DeclareRequest MomentumDeclaration() {
  v1::DeclareRequest req = SgdDeclaration(40, 16, 1, 0);  // 10 chunks
  req.mutable_optimizer()->set_momentum(0.9f);
  req.mutable_optimizer()->set_learning_rate(0.1f);
  return req;
}

TEST(ParameterStoreCheckpointTest, HandsOverEveryChunkAtEachMultipleOfK) {
  absl::Mutex mu;
  std::vector<std::pair<int64_t, std::vector<ChunkState>>> taken;
  StoreOptions o;
  o.num_workers = 2;
  o.checkpoint_every = 3;
  o.on_checkpoint = [&](int64_t step, std::vector<ChunkState> chunks) {
    absl::MutexLock lock(&mu);
    taken.emplace_back(step, std::move(chunks));
  };
  ParameterStore store(o);
  SHARDPS_ASSERT_OK(store.Declare(MomentumDeclaration()));
  TrainSync(&store, 0, 7);
  absl::MutexLock lock(&mu);
  mu.AwaitWithTimeout(
      absl::Condition(
          +[](decltype(taken)* t) { return t->size() >= 2; }, &taken),
      absl::Seconds(30));
  ASSERT_EQ(taken.size(), 2u);
  std::sort(taken.begin(), taken.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  EXPECT_EQ(taken[0].first, 3);
  EXPECT_EQ(taken[1].first, 6);
  for (const auto& [step, chunks] : taken) {
    EXPECT_EQ(chunks.size(), 10u);
    for (const ChunkState& c : chunks) {
      EXPECT_EQ(c.version, step);
      EXPECT_EQ(c.weights.size(), 4u);
      EXPECT_EQ(c.slots.size(), 1u);  // momentum
    }
  }
}

TEST(ParameterStoreCheckpointTest,
     RestoredStoreContinuesBitwiseLikeTheOriginal) {
  absl::Mutex mu;
  std::vector<ChunkState> at_step_4;
  StoreOptions o;
  o.num_workers = 2;
  o.checkpoint_every = 4;
  o.on_checkpoint = [&](int64_t step, std::vector<ChunkState> chunks) {
    absl::MutexLock lock(&mu);
    if (step == 4) at_step_4 = std::move(chunks);
  };
  ParameterStore original(o);
  SHARDPS_ASSERT_OK(original.Declare(MomentumDeclaration()));
  TrainSync(&original, 0, 7);
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::vector<ChunkState>* v) { return !v->empty(); },
            &at_step_4),
        absl::Seconds(30));
    ASSERT_EQ(at_step_4.size(), 10u);
  }
  StoreOptions plain;
  plain.num_workers = 2;
  ParameterStore restored(plain);
  SHARDPS_ASSERT_OK(restored.Restore(MomentumDeclaration(), at_step_4));
  absl::StatusOr<v1::DeclareResponse> again =
      restored.Declare(MomentumDeclaration());
  SHARDPS_ASSERT_OK(again);
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->version(), 4);
  TrainSync(&restored, 4, 7);
  for (uint32_t chunk = 0; chunk < 10; ++chunk) {
    EXPECT_EQ(*restored.Read(chunk)->weights, *original.Read(chunk)->weights)
        << chunk;
  }
  // Restoring over a declared store, or with missing chunks, is refused.
  EXPECT_EQ(restored.Restore(MomentumDeclaration(), at_step_4).code(),
            absl::StatusCode::kFailedPrecondition);
  ParameterStore partial(plain);
  std::vector<ChunkState> some(at_step_4.begin(), at_step_4.begin() + 3);
  EXPECT_EQ(partial.Restore(MomentumDeclaration(), some).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A coordinator view of `workers` ranks: rank r alive with incarnation
// incarnations[r] (0: not alive, never held).
}  // namespace
}  // namespace shardps::server
