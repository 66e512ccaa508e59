// ParameterStore with momentum and betas pushed per step (as torch's
// OneCycleLR and CyclicLR change them): applied, agreed on by every rank of
// a sync step, checked against the chunk's optimizer.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "common/step_hyperparameters.h"
#include "gtest/gtest.h"
#include "server/optimizer.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

constexpr std::optional<float> kUnset;

// Tensors "w" (the declaration's SGD, momentum 0.9, lr 0.1) and "b" (its
// own Adam), four floats each initialised to 1, one chunk each (ids 0, 1).
v1::DeclareRequest Declaration() {
  v1::DeclareRequest req = SgdDeclaration(4, 16, 1, 0);
  req.mutable_optimizer()->set_momentum(0.9f);
  req.mutable_optimizer()->set_learning_rate(0.1f);
  v1::TensorSpec* b = req.mutable_layout()->add_tensors();
  *b = req.layout().tensors(0);
  b->set_name("b");
  b->mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_ADAM);
  b->mutable_optimizer()->set_learning_rate(0.01f);
  return req;
}

// One chunk updated by Optimizer::Apply directly: the reference.
struct HandChunk {
  explicit HandChunk(const v1::OptimizerSpec& spec)
      : opt(*Optimizer::Create(spec)),
        w(4, 1.0f),
        slots(opt->num_slots(), std::vector<float>(4)) {
    opt->InitSlots(Pointers(), 4);
  }
  std::vector<float*> Pointers() {
    std::vector<float*> p;
    for (std::vector<float>& s : slots) p.push_back(s.data());
    return p;
  }
  void Apply(int64_t update, const std::vector<std::vector<float>>& ranks,
             const StepHyperparameters& h) {
    std::vector<const float*> c;
    for (const std::vector<float>& g : ranks) c.push_back(g.data());
    opt->Apply(update, c, w.data(), Pointers(), 4, h);
  }
  std::unique_ptr<Optimizer> opt;
  std::vector<float> w;
  std::vector<std::vector<float>> slots;
};

std::vector<std::vector<float>> Gradients(int64_t step) {
  return {{0.5f, -0.1f * step, 2.0f, 1.0f}, {-0.25f, 0.75f, 1.0f, 3.0f + step}};
}

TEST(StoreHyperparametersTest, SyncStepsApplyTheirMomentumAndBetas) {
  const v1::DeclareRequest req = Declaration();
  std::unique_ptr<ParameterStore> store = MakeStore(2);
  SHARDPS_ASSERT_OK(store->Declare(req));
  HandChunk want_w(req.optimizer());
  HandChunk want_b(req.layout().tensors(1).optimizer());
  // By step: w's (lr, momentum), b's (lr, beta1, beta2): a cycle, a
  // momentum of 0 (a plain step), the declared values.
  const std::vector<StepHyperparameters> w_steps = {
      {0.2f, 0.95f}, {0.3f, 0.0f}, {}, {0.1f, 0.85f}};
  const std::vector<StepHyperparameters> b_steps = {
      {0.02f, kUnset, 0.95f, 0.99f}, {0.03f, kUnset, 0.85f}, {}, {0.01f}};
  auto sink = std::make_shared<CollectingSink>();
  for (int64_t step = 0; step < 4; ++step) {
    const std::vector<std::vector<float>> g = Gradients(step);
    for (uint32_t rank : {1u, 0u}) {
      SHARDPS_ASSERT_OK(
          PushTo(store.get(), rank, step, 0, g[rank], sink, w_steps[step]));
      SHARDPS_ASSERT_OK(
          PushTo(store.get(), rank, step, 1, g[rank], sink, b_steps[step]));
    }
    ASSERT_EQ(sink->Wait(4 * (step + 1)).size(), 4u * (step + 1));
    want_w.Apply(step, g, w_steps[step]);
    want_b.Apply(step, g, b_steps[step]);
    EXPECT_EQ(WeightsOf(*store, 0), want_w.w) << "step " << step;
    EXPECT_EQ(WeightsOf(*store, 1), want_b.w) << "step " << step;
  }
}

TEST(StoreHyperparametersTest, SyncStepRefusesADifferentMomentumOrBeta) {
  const v1::DeclareRequest req = Declaration();
  std::unique_ptr<ParameterStore> store = MakeStore(2);
  SHARDPS_ASSERT_OK(store->Declare(req));
  auto sink0 = std::make_shared<CollectingSink>();
  auto sink1 = std::make_shared<CollectingSink>();
  const std::vector<std::vector<float>> g = Gradients(0);
  const StepHyperparameters w_step = {0.1f, 0.9f};
  const StepHyperparameters b_step = {0.01f, kUnset, 0.9f, 0.99f};
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 0, g[0], sink0, w_step));
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 1, g[0], sink0, b_step));
  struct Case {
    uint32_t chunk;
    StepHyperparameters h;
    std::string want;
  };
  // Bitwise: the closest floats count as different, and so does unset.
  const std::vector<Case> cases = {
      {0,
       {0.1f, std::nextafter(0.9f, 1.0f)},
       "rank 1 pushes chunk 0 (w) of step 0 with momentum 0.900000036, but "
       "the step's first push used 0.899999976: every worker of a step must "
       "use the same momentum"},
      {0,
       {0.1f},
       "with momentum the declared one, but the step's first "
       "push used 0.899999976"},
      {1,
       {0.01f, kUnset, 0.9f, std::nextafter(0.99f, 0.0f)},
       "rank 1 pushes chunk 1 (b) of step 0 with beta2"},
      {1, {0.01f, kUnset, kUnset, 0.99f}, "with beta1 the declared one"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    const absl::Status s = PushTo(store.get(), 1, 0, c.chunk, g[1], sink1, c.h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.want)) << s;
  }
  // Nothing changed: the step still waits for rank 1, and completes with
  // rank 0's values.
  EXPECT_EQ(sink0->count(), 0u);
  EXPECT_EQ(WeightsOf(*store, 0), std::vector<float>(4, 1.0f));
  EXPECT_EQ(store->Report().rejected_total(), cases.size());
  SHARDPS_ASSERT_OK(PushTo(store.get(), 1, 0, 0, g[1], sink1, w_step));
  SHARDPS_ASSERT_OK(PushTo(store.get(), 1, 0, 1, g[1], sink1, b_step));
  ASSERT_EQ(sink0->Wait(2).size(), 2u);
  HandChunk want_w(req.optimizer());
  HandChunk want_b(req.layout().tensors(1).optimizer());
  want_w.Apply(0, g, w_step);
  want_b.Apply(0, g, b_step);
  EXPECT_EQ(WeightsOf(*store, 0), want_w.w);
  EXPECT_EQ(WeightsOf(*store, 1), want_b.w);
}

TEST(StoreHyperparametersTest, ValuesTheOptimizerCannotTakeAreRefused) {
  v1::DeclareRequest req = Declaration();
  // A third tensor "p": plain SGD (momentum 0), no momentum buffer.
  v1::TensorSpec* p = req.mutable_layout()->add_tensors();
  *p = req.layout().tensors(0);
  p->set_name("p");
  p->mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  p->mutable_optimizer()->set_learning_rate(0.1f);
  std::unique_ptr<ParameterStore> store = MakeStore(1);
  SHARDPS_ASSERT_OK(store->Declare(req));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    uint32_t chunk;
    StepHyperparameters h;
    std::string want;
  };
  const std::vector<Case> cases = {
      {0, {kUnset, 1.0f}, "chunk 0 (w): momentum must be in [0, 1), got 1"},
      {0, {kUnset, nan}, "chunk 0 (w): momentum must be in [0, 1)"},
      {0,
       {kUnset, 0.9f, 0.9f},
       "chunk 0 (w): beta1 is set, but the chunk's "
       "optimizer is KIND_SGD"},
      {1,
       {kUnset, 0.9f},
       "chunk 1 (b): momentum is set, but the chunk's "
       "optimizer is KIND_ADAM"},
      {1, {kUnset, kUnset, 0.9f, -0.5f}, "chunk 1 (b): beta2 must be in"},
      {1, {kUnset, kUnset, 1.0f}, "chunk 1 (b): beta1 must be in [0, 1)"},
      {2,
       {kUnset, 0.5f},
       "chunk 2 (p): momentum is set, but the chunk's SGD "
       "was declared with momentum 0"},
  };
  auto sink = std::make_shared<CollectingSink>();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    const absl::Status s =
        PushTo(store.get(), 0, 0, c.chunk, {1, 2, 3, 4}, sink, c.h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 0's push of " + c.want))
        << s;
  }
  EXPECT_EQ(sink->count(), 0u);
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    EXPECT_EQ(WeightsOf(*store, chunk), std::vector<float>(4, 1.0f));
  }
  // The slots were not touched either: a good step is the first update.
  const StepHyperparameters good = {kUnset, 0.5f};
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 0, {1, 2, 3, 4}, sink, good));
  HandChunk want(req.optimizer());
  want.Apply(0, {{1, 2, 3, 4}}, good);
  ASSERT_EQ(sink->Wait(1).size(), 1u);
  EXPECT_EQ(WeightsOf(*store, 0), want.w);
}

TEST(StoreHyperparametersTest, AsyncPushesEachUseTheirOwnMomentum) {
  const v1::DeclareRequest req = Declaration();
  std::unique_ptr<ParameterStore> store = MakeStore(2, v1::CONSISTENCY_ASYNC);
  SHARDPS_ASSERT_OK(store->Declare(req));
  auto sink = std::make_shared<CollectingSink>();
  const std::vector<std::vector<float>> g = Gradients(0);
  const StepHyperparameters first = {0.1f, 0.5f}, second = {0.2f, 0.8f};
  SHARDPS_ASSERT_OK(PushTo(store.get(), 0, 0, 0, g[0], sink, first));
  SHARDPS_ASSERT_OK(PushTo(store.get(), 1, 0, 0, g[1], sink, second));
  ASSERT_EQ(sink->Wait(2).size(), 2u);
  HandChunk want(req.optimizer());
  want.Apply(0, {g[0]}, first);
  want.Apply(1, {g[1]}, second);
  EXPECT_EQ(WeightsOf(*store, 0), want.w);
}

}  // namespace
}  // namespace shardps::server
