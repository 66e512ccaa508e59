// A chunk's optimizer state read out and written in (ReadOptimizerState,
// WriteOptimizerState): a store that takes the state and weights of another
// at step k continues bitwise like it; bad states are refused with nothing
// changed; the optimizer's step count leaves out steps without a gradient;
// a checkpoint copy of the step holds a state written at it.
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

constexpr int64_t kElements = 6;

// Two tensors, Adam on "a" (3 elements) and AdamW with decay on "b" (3), in
// chunks of 3 elements; "a" is KIND_PROVIDED when `provided`.
v1::DeclareRequest AdamDeclaration(bool provided) {
  v1::DeclareRequest req;
  for (const char* name : {"a", "b"}) {
    v1::TensorSpec* t = req.mutable_layout()->add_tensors();
    t->set_name(name);
    t->add_shape(3);
    t->mutable_init()->set_kind(provided ? v1::InitSpec::KIND_PROVIDED
                                         : v1::InitSpec::KIND_CONSTANT);
    t->mutable_init()->set_value(0.5f);
  }
  v1::OptimizerSpec* b =
      req.mutable_layout()->mutable_tensors(1)->mutable_optimizer();
  b->set_kind(v1::OptimizerSpec::KIND_ADAMW);
  b->set_learning_rate(0.01f);
  b->set_weight_decay(0.1f);
  req.mutable_layout()->set_chunk_bytes(12);
  req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_ADAM);
  req.mutable_optimizer()->set_learning_rate(0.02f);
  req.set_num_shards(1);
  req.set_shard_index(0);
  return req;
}

// Pushes one sync step of two ranks to both chunks, gradient values seeded
// by `seed` (not the step, so another store can replay them at other
// steps); chunk `no_gradient_chunk` gets no gradient from either rank.
void Step(ParameterStore* store, int64_t step, int seed,
          int no_gradient_chunk = -1) {
  auto sink = std::make_shared<CollectingSink>();
  for (uint32_t rank = 0; rank < 2; ++rank) {
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
      PushFlags flags;
      flags.no_gradient = static_cast<int>(chunk) == no_gradient_chunk;
      std::vector<float> g(flags.no_gradient ? 0 : 3);
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] = std::sin(0.7f * static_cast<float>(seed * 7 + chunk * 3 + i) +
                        static_cast<float>(rank));
      }
      ASSERT_TRUE(PushTo(store, rank, step, chunk, g, sink, flags).ok());
    }
  }
  ASSERT_EQ(sink->Wait(4).size(), 4u);
}

std::unique_ptr<ParameterStore> MakeAdamStore(bool provided) {
  std::unique_ptr<ParameterStore> store = MakeStore(2);
  EXPECT_TRUE(store->Declare(AdamDeclaration(provided)).ok());
  return store;
}

TEST(OptimizerStateTest, AStoreGivenAnothersStateContinuesBitwiseLikeIt) {
  std::unique_ptr<ParameterStore> original = MakeAdamStore(false);
  for (int s = 0; s < 3; ++s) Step(original.get(), s, s);
  // Take weights and state at step 3 into a new store, at its step 0.
  std::unique_ptr<ParameterStore> resumed = MakeAdamStore(true);
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    const std::string values = Bytes(WeightsOf(*original, chunk));
    StringByteSource payload(values);
    PushArgs args;
    args.chunk_id = chunk;
    args.initial_values = true;
    args.payload = &payload;
    SHARDPS_ASSERT_OK(resumed->Push(args, std::make_shared<CollectingSink>()));
    SHARDPS_ASSERT_OK_AND_ASSIGN(v1::ChunkOptimizerState state,
                                 original->ReadOptimizerState(chunk));
    EXPECT_EQ(state.step(), 3);
    EXPECT_EQ(state.optimizer_steps(), 3);
    ASSERT_EQ(state.slots_size(), 2);  // exp_avg, exp_avg_sq
    state.set_step(0);
    SHARDPS_ASSERT_OK(resumed->WriteOptimizerState(state));
    SHARDPS_ASSERT_OK_AND_ASSIGN(v1::ChunkOptimizerState back,
                                 resumed->ReadOptimizerState(chunk));
    EXPECT_EQ(back.optimizer_steps(), 3);
    EXPECT_EQ(back.slots(0), state.slots(0));
  }
  for (int s = 3; s < 6; ++s) Step(original.get(), s, s);
  for (int s = 0; s < 3; ++s) Step(resumed.get(), s, s + 3);
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    EXPECT_EQ(WeightsOf(*resumed, chunk), WeightsOf(*original, chunk))
        << "chunk " << chunk;
  }
}

TEST(OptimizerStateTest, BadStatesAreRefusedWithNothingChanged) {
  std::unique_ptr<ParameterStore> store = MakeAdamStore(false);
  Step(store.get(), 0, 0);
  SHARDPS_ASSERT_OK_AND_ASSIGN(const v1::ChunkOptimizerState before,
                               store->ReadOptimizerState(0));
  const float nan = std::nanf("");
  struct Bad {
    const char* what;
    absl::StatusCode code;
    std::function<void(v1::ChunkOptimizerState*)> change;
  };
  const std::vector<Bad> bad = {
      {"step", absl::StatusCode::kFailedPrecondition,
       [](v1::ChunkOptimizerState* s) { s->set_step(0); }},
      {"negative optimizer_steps", absl::StatusCode::kInvalidArgument,
       [](v1::ChunkOptimizerState* s) { s->set_optimizer_steps(-1); }},
      {"one slot", absl::StatusCode::kInvalidArgument,
       [](v1::ChunkOptimizerState* s) { s->mutable_slots()->RemoveLast(); }},
      {"short slot", absl::StatusCode::kInvalidArgument,
       [](v1::ChunkOptimizerState* s) { s->mutable_slots(0)->resize(8); }},
      {"NaN", absl::StatusCode::kInvalidArgument,
       [nan](v1::ChunkOptimizerState* s) {
         *s->mutable_slots(0) = Bytes({0, nan, 0});
       }},
      {"negative exp_avg_sq", absl::StatusCode::kInvalidArgument,
       [](v1::ChunkOptimizerState* s) {
         *s->mutable_slots(1) = Bytes({0, -1e-9f, 0});
       }},
      {"unknown chunk", absl::StatusCode::kNotFound,
       [](v1::ChunkOptimizerState* s) { s->set_chunk_id(7); }},
  };
  for (const Bad& b : bad) {
    v1::ChunkOptimizerState state = before;
    state.set_optimizer_steps(5);
    *state.mutable_slots(0) = Bytes({1, 2, 3});
    b.change(&state);
    EXPECT_EQ(store->WriteOptimizerState(state).code(), b.code) << b.what;
    SHARDPS_ASSERT_OK_AND_ASSIGN(const v1::ChunkOptimizerState now,
                                 store->ReadOptimizerState(0));
    EXPECT_EQ(now.SerializeAsString(), before.SerializeAsString()) << b.what;
  }
}

TEST(OptimizerStateTest, StepsWithoutAGradientDoNotStepTheOptimizer) {
  // As torch's state["step"] of a parameter whose grad was None.
  std::unique_ptr<ParameterStore> store = MakeAdamStore(false);
  Step(store.get(), 0, 0, /*no_gradient_chunk=*/1);
  Step(store.get(), 1, 1);
  Step(store.get(), 2, 2, /*no_gradient_chunk=*/1);
  SHARDPS_ASSERT_OK_AND_ASSIGN(const v1::ChunkOptimizerState a,
                               store->ReadOptimizerState(0));
  SHARDPS_ASSERT_OK_AND_ASSIGN(const v1::ChunkOptimizerState b,
                               store->ReadOptimizerState(1));
  EXPECT_EQ(a.step(), 3);
  EXPECT_EQ(a.optimizer_steps(), 3);
  EXPECT_EQ(b.step(), 3);
  EXPECT_EQ(b.optimizer_steps(), 1);
}

TEST(OptimizerStateTest, ACheckpointOfTheStepHoldsTheStateWrittenAtIt) {
  absl::Mutex mu;
  std::vector<std::pair<int64_t, std::vector<ChunkState>>> taken;
  StoreOptions o;
  o.num_workers = 1;
  o.checkpoint_every = 1;
  o.on_checkpoint = [&](int64_t step, std::vector<ChunkState> chunks) {
    absl::MutexLock lock(&mu);
    taken.emplace_back(step, std::move(chunks));
  };
  ParameterStore store(o);
  SHARDPS_ASSERT_OK(store.Declare(AdamDeclaration(false)));
  // Chunk 0 reaches step 1 (its copy waits for chunk 1's), then gets a
  // new state at step 1.
  auto sink = std::make_shared<CollectingSink>();
  const std::string bytes = Bytes({0.1f, 0.2f, 0.3f});
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    StringByteSource payload(bytes);
    PushArgs args;
    args.chunk_id = chunk;
    args.payload = &payload;
    SHARDPS_ASSERT_OK(store.Push(args, sink));
    ASSERT_EQ(sink->Wait(chunk + 1).size(), chunk + 1);
    if (chunk == 1) break;
    SHARDPS_ASSERT_OK_AND_ASSIGN(v1::ChunkOptimizerState state,
                                 store.ReadOptimizerState(0));
    state.set_optimizer_steps(9);
    *state.mutable_slots(0) = Bytes({4, 5, 6});
    SHARDPS_ASSERT_OK(store.WriteOptimizerState(state));
  }
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(
        absl::Condition(
            +[](decltype(taken)* t) { return !t->empty(); }, &taken),
        absl::Seconds(30));
    ASSERT_EQ(taken.size(), 1u);
    ASSERT_EQ(taken[0].first, 1);
    for (const ChunkState& c : taken[0].second) {
      if (c.chunk_id != 0) continue;
      EXPECT_EQ(c.slots[0], std::vector<float>({4, 5, 6}));
      EXPECT_EQ(c.version - c.skipped_updates, 9);
    }
  }
  // Step 1's checkpoint is handed over: a state written at step 1 now
  // would be missing from it.
  SHARDPS_ASSERT_OK_AND_ASSIGN(v1::ChunkOptimizerState state,
                               store.ReadOptimizerState(1));
  EXPECT_EQ(store.WriteOptimizerState(state).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shardps::server
