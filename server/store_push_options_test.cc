// ParameterStore with what a worker-side optimizer needs: per-tensor
// optimizers, a learning rate per push, pushes without a gradient and
// initial values the workers provide.
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/optimizer.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

PushFlags LearningRate(float lr) {
  PushFlags f;
  f.hyperparameters.learning_rate = lr;
  return f;
}
PushFlags NoGradient() {
  PushFlags f;
  f.no_gradient = true;
  return f;
}
PushFlags BothFlags() {
  PushFlags f = NoGradient();
  f.initial_values = true;
  return f;
}
PushFlags InitialValues(bool push_only = false) {
  PushFlags f;
  f.initial_values = true;
  f.push_only = push_only;
  return f;
}

// One chunk as Optimizer::Apply sees it, for reference values.
struct HandChunk {
  HandChunk(const Optimizer& opt, std::vector<float> weights)
      : w(std::move(weights)),
        slots(opt.num_slots(), std::vector<float>(w.size())) {
    opt.InitSlots(SlotPointers(), w.size());
  }
  std::vector<float*> SlotPointers() {
    std::vector<float*> p;
    for (std::vector<float>& s : slots) p.push_back(s.data());
    return p;
  }
  void Apply(const Optimizer& opt, int64_t update,
             const std::vector<std::vector<float>>& ranks,
             std::optional<float> lr = std::nullopt) {
    std::vector<const float*> c;
    for (const std::vector<float>& g : ranks) c.push_back(g.data());
    opt.Apply(update, c, w.data(), SlotPointers(), w.size(),
              StepHyperparameters{lr});
  }
  std::vector<float> w;
  std::vector<std::vector<float>> slots;
};

// Tensors "a" (declaration's SGD, lr 1) and "b" (its own Adam), four floats
// each, one chunk each (ids 0 and 1), both initialised to 1.
v1::DeclareRequest TwoOptimizerDeclaration() {
  v1::DeclareRequest req = SgdDeclaration(4, 16, 1, 0);
  v1::TensorSpec* b = req.mutable_layout()->add_tensors();
  *b = req.layout().tensors(0);
  b->set_name("b");
  b->mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_ADAM);
  b->mutable_optimizer()->set_learning_rate(0.01f);
  b->mutable_optimizer()->set_weight_decay(0.1f);
  return req;
}

TEST(StorePushOptionsTest, EachTensorIsUpdatedWithItsOwnOptimizer) {
  const v1::DeclareRequest req = TwoOptimizerDeclaration();
  std::unique_ptr<ParameterStore> store = MakeStore(2);
  SHARDPS_ASSERT_OK(store->Declare(req));
  absl::StatusOr<std::unique_ptr<Optimizer>> sgd =
      Optimizer::Create(req.optimizer());
  absl::StatusOr<std::unique_ptr<Optimizer>> adam =
      Optimizer::Create(req.layout().tensors(1).optimizer());
  SHARDPS_ASSERT_OK(sgd);
  SHARDPS_ASSERT_OK(adam);
  HandChunk want_a(**sgd, std::vector<float>(4, 1.0f));
  HandChunk want_b(**adam, std::vector<float>(4, 1.0f));
  auto sink = std::make_shared<CollectingSink>();
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> grads;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      grads.push_back({0.5f * rank - 0.1f * step, 0.25f, -1.5f, 2.0f + step});
    }
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
      for (uint32_t rank = 0; rank < 2; ++rank) {
        SHARDPS_ASSERT_OK(
            PushTo(store.get(), rank, step, chunk, grads[rank], sink));
      }
    }
    ASSERT_EQ(sink->Wait(4 * (step + 1)).size(), 4u * (step + 1));
    want_a.Apply(**sgd, step, grads);
    want_b.Apply(**adam, step, grads);
    EXPECT_EQ(WeightsOf(*store, 0), want_a.w) << "step " << step;
    EXPECT_EQ(WeightsOf(*store, 1), want_b.w) << "step " << step;
  }
  EXPECT_NE(want_a.w, want_b.w);
}

TEST(StorePushOptionsTest, TensorOptimizersAreCheckedAndNamed) {
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  v1::DeclareRequest bad = TwoOptimizerDeclaration();
  bad.mutable_layout()->mutable_tensors(1)->mutable_optimizer()->set_beta1(2);
  const absl::Status s = store->Declare(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "tensor 1 (b)")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "beta1")) << s;
  EXPECT_FALSE(store->Report().declared());
  // When every tensor has its own, the declaration needs none.
  v1::DeclareRequest own = TwoOptimizerDeclaration();
  *own.mutable_layout()->mutable_tensors(0)->mutable_optimizer() =
      own.optimizer();
  own.clear_optimizer();
  SHARDPS_EXPECT_OK(store->Declare(own));
}

// Checkpoint copies hold each chunk's own slots; a store restored from them
// goes on exactly like the original.
TEST(StorePushOptionsTest, PerTensorSlotsSurviveACheckpoint) {
  const v1::DeclareRequest req = TwoOptimizerDeclaration();
  absl::Mutex mu;
  std::vector<ChunkState> at_2;
  StoreOptions o;
  o.num_workers = 2;
  o.checkpoint_every = 2;
  o.on_checkpoint = [&](int64_t step, std::vector<ChunkState> chunks) {
    absl::MutexLock lock(&mu);
    if (step == 2) at_2 = std::move(chunks);
  };
  ParameterStore original(o);
  SHARDPS_ASSERT_OK(original.Declare(req));
  for (int64_t step = 0; step < 4; ++step) {
    PushSyncStep(&original, step, 2, 0, 2, 4);
  }
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::vector<ChunkState>* v) { return !v->empty(); }, &at_2),
        absl::Seconds(30));
    ASSERT_EQ(at_2.size(), 2u);
  }
  for (const ChunkState& c : at_2) {
    EXPECT_EQ(c.slots.size(), c.chunk_id == 0 ? 0u : 2u) << c.chunk_id;
  }
  std::unique_ptr<ParameterStore> restored = MakeStore(2);
  SHARDPS_ASSERT_OK(restored->Restore(req, at_2));
  for (int64_t step = 2; step < 4; ++step) {
    PushSyncStep(restored.get(), step, 2, 0, 2, 4);
  }
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    EXPECT_EQ(WeightsOf(*restored, chunk), WeightsOf(original, chunk));
  }
  // Slots of the other tensor's optimizer do not fit.
  std::vector<ChunkState> swapped = at_2;
  std::swap(swapped[0].slots, swapped[1].slots);
  std::unique_ptr<ParameterStore> wrong = MakeStore(2);
  EXPECT_EQ(wrong->Restore(req, swapped).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(StorePushOptionsTest, PushedLearningRateReplacesTheSchedule) {
  // lr 1 halved every update: 1, 0.5, 0.25, ...
  v1::DeclareRequest req = SgdDeclaration(4, 0, 1, 0);
  v1::LrSchedule* schedule = req.mutable_optimizer()->mutable_schedule();
  schedule->set_kind(v1::LrSchedule::KIND_STEP);
  schedule->set_step_size(1);
  schedule->set_gamma(0.5f);
  for (const v1::Consistency mode :
       {v1::CONSISTENCY_SYNC, v1::CONSISTENCY_ASYNC}) {
    SCOPED_TRACE(v1::Consistency_Name(mode));
    std::unique_ptr<ParameterStore> store = MakeStore(1, mode);
    SHARDPS_ASSERT_OK(store->Declare(req));
    auto sink = std::make_shared<CollectingSink>();
    const std::vector<float> g = {1, 2, 4, 8};
    // Update 0 at 0.125 instead of 1, update 1 at the schedule's 0.5,
    // update 2 at 0.0625 instead of 0.25.
    SHARDPS_ASSERT_OK(
        PushTo(store.get(), 0, 0, 0, g, sink, LearningRate(0.125f)));
    SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 1, 0, g, sink));
    SHARDPS_ASSERT_OK(
        PushTo(store.get(), 0, 2, 0, g, sink, LearningRate(0.0625f)));
    // A learning rate of 0 is a rate (a warmup's first step), not "unset".
    SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 3, 0, g, sink, LearningRate(0)));
    ASSERT_EQ(sink->Wait(4).size(), 4u);
    std::vector<float> want(4, 1.0f);
    for (const float lr : {0.125f, 0.5f, 0.0625f}) {
      for (size_t i = 0; i < want.size(); ++i) want[i] -= lr * g[i];
    }
    EXPECT_EQ(WeightsOf(*store, 0), want);
  }
}

TEST(StorePushOptionsTest, BadLearningRatesAreRefused) {
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  SHARDPS_ASSERT_OK(store->Declare(SgdDeclaration(4, 0, 1, 0)));
  auto sink = std::make_shared<CollectingSink>();
  for (const float lr : {-0.5f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(lr);
    const absl::Status s =
        PushTo(store.get(), 0, 0, 0, {1, 1, 1, 1}, sink, LearningRate(lr));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "chunk 0 (w)")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 0")) << s;
  }
  EXPECT_EQ(sink->count(), 0u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, 1.0f));
}

TEST(StorePushOptionsTest, SyncStepRefusesADifferentLearningRate) {
  std::unique_ptr<ParameterStore> store = MakeStore(2);
  SHARDPS_ASSERT_OK(store->Declare(SgdDeclaration(4, 0, 1, 0)));
  auto sink0 = std::make_shared<CollectingSink>();
  auto sink1 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 0, 0, 0, {2, 2, 2, 2}, sink0, LearningRate(0.5f)));
  // The closest float above 0.5: differs bitwise only.
  const float nearly = std::nextafter(0.5f, 1.0f);
  for (const float lr : {nearly, 0.0f}) {
    const absl::Status s =
        PushTo(store.get(), 1, 0, 0, {4, 4, 4, 4}, sink1, LearningRate(lr));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(
        s.message(), "rank 1 pushes chunk 0 (w) of step 0 with learning rate"))
        << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "first push used 0.5:")) << s;
  }
  // Nothing changed: the step still waits for rank 1, and completes with
  // rank 0's rate.
  EXPECT_EQ(sink0->count(), 0u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, 1.0f));
  EXPECT_EQ(store->Report().rejected_total(), 2u);
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 1, 0, 0, {4, 4, 4, 4}, sink1, LearningRate(0.5f)));
  ASSERT_EQ(sink0->Wait(1).size(), 1u);
  EXPECT_EQ(Floats(sink0->Wait(1)[0].weights),
            std::vector<float>(4, 1.0f - 0.5f * 3.0f));
  // The next step starts afresh: rank 1 first, with another rate.
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 1, 1, 0, {1, 1, 1, 1}, sink1, LearningRate(1.0f)));
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 0, 1, 0, {1, 1, 1, 1}, sink0, LearningRate(1.0f)));
  ASSERT_EQ(sink0->Wait(2).size(), 2u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, -1.5f));
}

TEST(StorePushOptionsTest, AsyncPushesEachUseTheirOwnLearningRate) {
  std::unique_ptr<ParameterStore> store = MakeStore(2, v1::CONSISTENCY_ASYNC);
  SHARDPS_ASSERT_OK(store->Declare(SgdDeclaration(4, 0, 1, 0)));
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 0, 0, 0, {1, 1, 1, 1}, sink, LearningRate(0.5f)));
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 1, 0, 0, {1, 1, 1, 1}, sink, LearningRate(0.25f)));
  ASSERT_EQ(sink->Wait(2).size(), 2u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, 0.25f));
}

// Momentum SGD, one 4-float chunk, checkpoint copies after every update:
// the copies show the slots.
struct SkipFixture {
  explicit SkipFixture(uint32_t workers) {
    StoreOptions o;
    o.num_workers = workers;
    o.checkpoint_every = 1;
    o.on_checkpoint = [this](int64_t step, std::vector<ChunkState> chunks) {
      absl::MutexLock lock(&mu);
      copies[step] = std::move(chunks[0]);
    };
    store = std::make_unique<ParameterStore>(o);
    v1::DeclareRequest req = SgdDeclaration(4, 0, 1, 0);
    req.mutable_optimizer()->set_momentum(0.9f);
    req.mutable_optimizer()->set_learning_rate(0.1f);
    EXPECT_TRUE(store->Declare(req).ok());
  }
  ChunkState CopyAt(int64_t step) {
    absl::MutexLock lock(&mu);
    auto has = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return copies.count(step) > 0;
    };
    mu.AwaitWithTimeout(absl::Condition(&has), absl::Seconds(30));
    return copies.count(step) > 0 ? copies[step] : ChunkState();
  }
  absl::Mutex mu;
  std::map<int64_t, ChunkState> copies ABSL_GUARDED_BY(mu);
  std::unique_ptr<ParameterStore> store;
};

TEST(StorePushOptionsTest, StepWithoutAnyGradientSkipsTheUpdate) {
  SkipFixture f(2);
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 0, 0, 0, {1, 2, 3, 4}, sink));
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 1, 0, 0, {3, 2, 1, 0}, sink));
  ASSERT_EQ(sink->Wait(2).size(), 2u);
  const ChunkState after_0 = f.CopyAt(1);
  ASSERT_EQ(after_0.slots.size(), 1u);
  EXPECT_NE(after_0.slots[0], std::vector<float>(4, 0.0f));
  const uint64_t updates = f.store->Report().updates_total();
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 0, 1, 0, {}, sink, NoGradient()));
  EXPECT_EQ(sink->count(), 2u);  // still waits for rank 1
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 1, 1, 0, {}, sink, NoGradient()));
  std::vector<ChunkReply> replies = sink->Wait(4);
  ASSERT_EQ(replies.size(), 4u);
  EXPECT_EQ(replies[3].version, 2);
  EXPECT_EQ(Floats(replies[3].weights), after_0.weights);
  // Weights and momentum as they were, one version later, and the copy a
  // checkpoint at the new version makes.
  const ChunkState after_skip = f.CopyAt(2);
  EXPECT_EQ(after_skip.version, 2);
  EXPECT_EQ(after_skip.weights, after_0.weights);
  EXPECT_EQ(after_skip.slots, after_0.slots);
  EXPECT_EQ(f.store->Report().updates_total(), updates + 1);
  EXPECT_EQ(f.store->Report().min_version(), 2);
}

TEST(StorePushOptionsTest, RankWithoutAGradientCountsAsZeroInTheMean) {
  SkipFixture f(3);
  auto sink = std::make_shared<CollectingSink>();
  const std::vector<float> g0 = {1, 2, 3, 4}, g2 = {0.5f, -1, 7, 0.25f};
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 2, 0, 0, g2, sink));
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 1, 0, 0, {}, sink, NoGradient()));
  SHARDPS_ASSERT_OK(PushTo(f.store.get(), 0, 0, 0, g0, sink));
  ASSERT_EQ(sink->Wait(3).size(), 3u);
  absl::StatusOr<std::unique_ptr<Optimizer>> opt =
      Optimizer::Create(f.store->declaration()->optimizer());
  SHARDPS_ASSERT_OK(opt);
  HandChunk want(**opt, std::vector<float>(4, 1.0f));
  want.Apply(**opt, 0, {g0, std::vector<float>(4, 0.0f), g2});
  EXPECT_EQ(WeightsOf(*f.store, 0), want.w);
  EXPECT_EQ(f.CopyAt(1).slots, want.slots);
}

TEST(StorePushOptionsTest, NoGradientNeedsAnEmptyPayloadAndViceVersa) {
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  SHARDPS_ASSERT_OK(store->Declare(SgdDeclaration(4, 0, 1, 0)));
  auto sink = std::make_shared<CollectingSink>();
  const absl::Status with_payload =
      PushTo(store.get(), 0, 0, 0, {1, 1, 1, 1}, sink, NoGradient());
  EXPECT_EQ(with_payload.code(), absl::StatusCode::kInvalidArgument)
      << with_payload;
  EXPECT_TRUE(absl::StrContains(with_payload.message(), "no_gradient"));
  EXPECT_EQ(PushTo(store.get(), 0, 0, 0, {}, sink).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sink->count(), 0u);
  EXPECT_EQ(store->Report().rejected_total(), 2u);
}

TEST(StorePushOptionsTest, AsyncPushWithoutAGradientOnlyAdvancesTheClock) {
  for (const v1::Consistency mode :
       {v1::CONSISTENCY_ASYNC, v1::CONSISTENCY_SSP}) {
    SCOPED_TRACE(v1::Consistency_Name(mode));
    std::unique_ptr<ParameterStore> store = MakeStore(1, mode);
    SHARDPS_ASSERT_OK(store->Declare(SgdDeclaration(4, 0, 1, 0)));
    auto sink = std::make_shared<CollectingSink>();
    SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 0, {}, sink, NoGradient()));
    std::vector<ChunkReply> replies = sink->Wait(1);
    ASSERT_EQ(replies.size(), 1u);
    EXPECT_EQ(replies[0].version, 0);
    EXPECT_EQ(Floats(replies[0].weights), std::vector<float>(4, 1.0f));
    absl::StatusOr<v1::DeclareResponse> again =
        store->Declare(SgdDeclaration(4, 0, 1, 0));
    SHARDPS_ASSERT_OK(again);
    EXPECT_EQ(again->next_step(), 1);
    // Step 1 is next: applied as usual.
    SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 1, 0, {1, 1, 1, 1}, sink));
    ASSERT_EQ(sink->Wait(2).size(), 2u);
    EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, 0.0f));
    EXPECT_EQ(store->Report().updates_total(), 1u);
  }
}

// Tensor "w" of 8 floats provided by the workers, in two chunks of 4; a
// "bias" of 4 floats initialised by the server (chunk 2).
v1::DeclareRequest ProvidedDeclaration() {
  v1::DeclareRequest req = SgdDeclaration(8, 16, 1, 0);
  v1::TensorSpec* bias = req.mutable_layout()->add_tensors();
  *bias = req.layout().tensors(0);
  bias->set_name("bias");
  bias->set_shape(0, 4);
  req.mutable_layout()->mutable_tensors(0)->mutable_init()->set_kind(
      v1::InitSpec::KIND_PROVIDED);
  return req;
}

bool Awaiting(ParameterStore* store) {
  absl::StatusOr<v1::DeclareResponse> r = store->Declare(ProvidedDeclaration());
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() && r->awaiting_values();
}

TEST(StorePushOptionsTest, ProvidedChunksWaitForTheirValues) {
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  absl::StatusOr<v1::DeclareResponse> declared =
      store->Declare(ProvidedDeclaration());
  SHARDPS_ASSERT_OK(declared);
  EXPECT_TRUE(declared->awaiting_values());
  auto sink = std::make_shared<CollectingSink>();
  // Reads and gradients are refused until the values come.
  const absl::Status read = store->Read(1).status();
  EXPECT_EQ(read.code(), absl::StatusCode::kUnavailable) << read;
  EXPECT_EQ(read.message(),
            "chunk 1 (w) waits for its initial values: the declaring worker "
            "sends them");
  EXPECT_EQ(store->CheckReadable(0).code(), absl::StatusCode::kUnavailable);
  SHARDPS_EXPECT_OK(store->CheckReadable(2));
  EXPECT_EQ(PushTo(store.get(), 0, 0, 0, {1, 1, 1, 1}, sink).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(PushTo(store.get(), 0, 0, 0, {}, sink, NoGradient()).code(),
            absl::StatusCode::kUnavailable);
  // The server-initialised tensor is usable meanwhile.
  EXPECT_EQ(WeightsOf(*store, 2), std::vector<float>(4, 1.0f));
  // Chunk 0's values, from any step: answered at once with them.
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 0, 5, 0, {1, 2, 3, 4}, sink, InitialValues()));
  ASSERT_EQ(sink->count(), 1u);
  EXPECT_EQ(Floats(sink->Wait(1)[0].weights), std::vector<float>({1, 2, 3, 4}));
  EXPECT_EQ(sink->Wait(1)[0].version, 0);
  EXPECT_TRUE(Awaiting(store.get()));  // chunk 1 still does
  // Later values are ignored; the reply has the first ones.
  SHARDPS_ASSERT_OK(
      PushTo(store.get(), 0, 0, 0, {9, 9, 9, 9}, sink, InitialValues()));
  ASSERT_EQ(sink->count(), 2u);
  EXPECT_EQ(Floats(sink->Wait(2)[1].weights), std::vector<float>({1, 2, 3, 4}));
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 1, {5, 6, 7, 8}, sink,
                           InitialValues(/*push_only=*/true)));
  ASSERT_EQ(sink->count(), 3u);
  EXPECT_EQ(sink->Wait(3)[2].weights, nullptr);
  EXPECT_FALSE(Awaiting(store.get()));
  EXPECT_EQ(WeightsOf(*store, 1), std::vector<float>({5, 6, 7, 8}));
  // Training starts from the provided values.
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 0, {1, 1, 1, 1}, sink));
  ASSERT_EQ(sink->Wait(4).size(), 4u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>({0, 1, 2, 3}));
  EXPECT_EQ(store->Report().pushes_total(), 4u);
}

TEST(StorePushOptionsTest, BadInitialValuesAreRefused) {
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  SHARDPS_ASSERT_OK(store->Declare(ProvidedDeclaration()));
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* what;
    std::vector<float> values;
    PushFlags flags;
  };
  const std::vector<Case> cases = {
      {"short", {1, 2, 3}, InitialValues()},
      {"long", {1, 2, 3, 4, 5}, InitialValues()},
      {"infinite", {1, inf, 3, 4}, InitialValues()},
      {"nan",
       {1, 2, std::numeric_limits<float>::quiet_NaN(), 4},
       InitialValues()},
      {"with no_gradient", {1, 2, 3, 4}, BothFlags()},
  };
  auto sink = std::make_shared<CollectingSink>();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status s =
        PushTo(store.get(), 0, 0, 1, c.values, sink, c.flags);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  EXPECT_EQ(sink->count(), 0u);
  EXPECT_EQ(store->Read(1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Awaiting(store.get()));
}

std::vector<ChunkState> ProvidedStates(int64_t version) {
  std::vector<ChunkState> states;
  for (uint32_t id = 0; id < 3; ++id) {
    states.push_back({id, version, std::vector<float>(4, 0.5f + id), {}});
  }
  return states;
}

TEST(StorePushOptionsTest, RestoreAndResetToEndTheWait) {
  std::unique_ptr<ParameterStore> restored = MakeStore(1);
  SHARDPS_ASSERT_OK(
      restored->Restore(ProvidedDeclaration(), ProvidedStates(3)));
  EXPECT_FALSE(Awaiting(restored.get()));
  EXPECT_EQ(WeightsOf(*restored, 0), std::vector<float>(4, 0.5f));

  std::unique_ptr<ParameterStore> reset = MakeStore(1);
  EXPECT_TRUE(Awaiting(reset.get()));
  SHARDPS_ASSERT_OK(
      reset->ResetTo(ProvidedStates(2), absl::AbortedError("rollback"), 1));
  EXPECT_FALSE(Awaiting(reset.get()));
  EXPECT_EQ(WeightsOf(*reset, 1), std::vector<float>(4, 1.5f));
  // Values sent after the reset are ignored.
  auto sink = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(
      PushTo(reset.get(), 0, 0, 1, {9, 9, 9, 9}, sink, InitialValues()));
  EXPECT_EQ(Floats(sink->Wait(1)[0].weights), std::vector<float>(4, 1.5f));
}

}  // namespace
}  // namespace shardps::server
