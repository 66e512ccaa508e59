// The sync step's running sum: every rank's gradient is added in rank order
// as it arrives, a gradient that comes before the ranks below it is kept
// (and its stream held) until they are added, so the weights are bitwise the
// same for every arrival order while the shard keeps one sum per chunk.
#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

// A CollectingSink that counts the flow-control calls of its stream.
class HoldingSink : public CollectingSink {
 public:
  void Hold(int64_t) override { holds_.fetch_add(1); }
  void Release() override { releases_.fetch_add(1); }
  // Holds not released yet.
  int held() const { return holds_.load() - releases_.load(); }
  int holds() const { return holds_.load(); }

 private:
  std::atomic<int> holds_{0};
  std::atomic<int> releases_{0};
};

// Gradients whose float sum depends on the order of the additions.
std::vector<float> Gradient(uint32_t rank) {
  const float big[] = {1e8f, -1e8f, 3.0f, -7e7f, 1e-3f, 2.5e7f};
  return {big[rank % 6], 0.1f * static_cast<float>(rank + 1),
          1.0f / static_cast<float>(rank + 3), -0.3f};
}

class RunningSumTest : public StoreFixture {
 protected:
  absl::Status PushFor(uint32_t rank, int64_t step, std::vector<float> grad,
                       std::shared_ptr<CollectingSink> sink) {
    return Push(rank, step, std::move(grad), std::move(sink));
  }
  // The weights after one step of `order.size()` ranks pushed in `order`.
  std::vector<float> StepInOrder(
      const std::vector<uint32_t>& order,
      std::vector<std::shared_ptr<HoldingSink>>* sinks) {
    sinks->clear();
    for (size_t i = 0; i < order.size(); ++i) {
      sinks->push_back(std::make_shared<HoldingSink>());
    }
    for (uint32_t rank : order) {
      EXPECT_TRUE(PushFor(rank, 0, Gradient(rank), (*sinks)[rank]).ok());
    }
    for (auto& sink : *sinks) EXPECT_EQ(sink->Wait(1).size(), 1u);
    return Weights();
  }
};

TEST_F(RunningSumTest, EveryArrivalOrderGivesTheRankOrderSum) {
  // The reference: ((g0 + g1) + g2) + g3, divided by 4, as Optimizer::Apply
  // sums the contributions of four ranks; SGD with lr 1 from w = 1.
  std::vector<float> want(4);
  for (size_t i = 0; i < want.size(); ++i) {
    float s = Gradient(0)[i];
    for (uint32_t r = 1; r < 4; ++r) s += Gradient(r)[i];
    want[i] = 1.0f - s / 4.0f;
  }
  std::vector<uint32_t> order = {0, 1, 2, 3};
  int orders = 0;
  do {
    Make(4);
    std::vector<std::shared_ptr<HoldingSink>> sinks;
    const std::vector<float> w = StepInOrder(order, &sinks);
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_EQ(w[i], want[i]) << "element " << i << ", order " << order[0]
                               << order[1] << order[2] << order[3];
    }
    // A rank that came before a rank below it held its stream, and every
    // hold was released once its gradient was added.
    for (uint32_t r = 0; r < 4; ++r) {
      const auto at = std::find(order.begin(), order.end(), r);
      const bool early =
          std::any_of(at, order.end(), [r](uint32_t q) { return q < r; });
      EXPECT_EQ(sinks[r]->holds(), early ? 1 : 0) << "rank " << r;
      EXPECT_EQ(sinks[r]->held(), 0) << "rank " << r;
    }
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 24);
}

TEST_F(RunningSumTest, AnEarlyGradientHoldsItsStreamUntilTheRanksBelowArrive) {
  Make(3);
  auto s0 = std::make_shared<HoldingSink>();
  auto s1 = std::make_shared<HoldingSink>();
  auto s2 = std::make_shared<HoldingSink>();
  SHARDPS_ASSERT_OK(PushFor(2, 0, Gradient(2), s2));
  EXPECT_EQ(s2->held(), 1);  // ranks 0 and 1 are missing
  SHARDPS_ASSERT_OK(PushFor(0, 0, Gradient(0), s0));
  EXPECT_EQ(s0->holds(), 0);  // the first rank is added at once
  EXPECT_EQ(s2->held(), 1);   // rank 1 is still missing
  SHARDPS_ASSERT_OK(PushFor(1, 0, Gradient(1), s1));
  EXPECT_EQ(s1->holds(), 0);
  EXPECT_EQ(s2->held(), 0);  // added after rank 1, and released
  EXPECT_EQ(s2->holds(), 1);
  for (auto* s : {s0.get(), s1.get(), s2.get()}) {
    EXPECT_EQ(s->Wait(1).size(), 1u);
  }
}

TEST_F(RunningSumTest, ARejectedEarlyPushHoldsNothingAndChangesNothing) {
  Make(2);
  auto s1 = std::make_shared<HoldingSink>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const absl::Status refused = PushFor(1, 0, {1, nan, 1, 1}, s1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_EQ(s1->holds(), 0);
  // The step still waits for both ranks and sums them as if nothing came.
  auto s0 = std::make_shared<HoldingSink>();
  SHARDPS_ASSERT_OK(PushFor(0, 0, {1, 2, 3, 4}, s0));
  EXPECT_EQ(s0->count(), 0u);
  SHARDPS_ASSERT_OK(PushFor(1, 0, {3, 2, 1, 0}, s1));
  EXPECT_EQ(Floats(s0->Wait(1)[0].weights), std::vector<float>(4, -1.0f));
}

TEST_F(RunningSumTest, ARankBelowLeavingReleasesTheEarlyGradients) {
  Make(3);
  store_->ApplyView(WorkersView(5, {11, 22, 33}, {true, true, true}));
  auto s0 = std::make_shared<HoldingSink>();
  auto s2 = std::make_shared<HoldingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 2, 3, 4}, s0, 0, 11));
  SHARDPS_ASSERT_OK(Push(2, 0, {3, 2, 1, 0}, s2, 0, 33));
  EXPECT_EQ(s2->held(), 1);  // waits for rank 1
  store_->ApplyView(WorkersView(6, {11, 22, 33}, {true, false, true}));
  // Rank 1 is not waited for any more: rank 2 is added, the step completes
  // with the mean of ranks 0 and 2.
  EXPECT_EQ(s2->held(), 0);
  EXPECT_EQ(Floats(s0->Wait(1)[0].weights), std::vector<float>(4, -1.0f));
  EXPECT_EQ(s2->Wait(1).size(), 1u);
}

TEST_F(RunningSumTest, NoGradientPushesAddZerosInTheirRankPlace) {
  // Rank 1 without a gradient, arriving last and first: (g0 + 0) + g2.
  const std::vector<float> g0 = {-0.0f, 1e8f, 1, 1}, g2 = {0.0f, 1, 1, 1};
  for (int order = 0; order < 2; ++order) {
    Make(3);
    auto sink = std::make_shared<HoldingSink>();
    auto none = [&] {
      PushArgs args;
      args.rank = 1;
      args.step = 0;
      args.no_gradient = true;
      StringByteSource empty("");
      args.payload = &empty;
      return store_->Push(args, sink);
    };
    if (order == 0) {
      SHARDPS_ASSERT_OK(Push(0, 0, g0, sink));
      SHARDPS_ASSERT_OK(Push(2, 0, g2, sink));
      SHARDPS_ASSERT_OK(none());
    } else {
      SHARDPS_ASSERT_OK(none());
      SHARDPS_ASSERT_OK(Push(2, 0, g2, sink));
      SHARDPS_ASSERT_OK(Push(0, 0, g0, sink));
    }
    const std::vector<ChunkReply> r = sink->Wait(3);
    ASSERT_EQ(r.size(), 3u);
    const std::vector<float> w = Floats(r[0].weights);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(w[i], 1.0f - ((g0[i] + 0.0f) + g2[i]) / 3.0f) << i;
    }
    EXPECT_EQ(sink->held(), 0);
  }
}

// update_threads = 0: the update of a chunk too large to run inline by
// default (1 MiB) runs on the thread whose push completed the step, so the
// replies are delivered before that Push returns, and the weights are those
// the update pool computes.
TEST(InlineUpdateTest, ZeroUpdateThreadsUpdateOnThePushingThread) {
  constexpr int64_t n = 1 << 18;  // 1 MiB of floats
  std::vector<float> grad(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = 1e-3f * static_cast<float>(i % 97);
  std::vector<std::vector<float>> weights;
  for (int threads : {0, 2}) {
    SCOPED_TRACE(::testing::Message() << "update_threads " << threads);
    StoreOptions o;
    o.num_workers = 2;
    o.update_threads = threads;
    ParameterStore store(o);
    SHARDPS_ASSERT_OK(store.Declare(SgdDeclaration(n, 4 << 20, 1, 0)));
    const std::string bytes = Bytes(grad);
    StringByteSource payload(bytes);
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    for (uint32_t rank : {0u, 1u}) {
      PushArgs args;
      args.rank = rank;
      args.payload = &payload;
      sinks.push_back(std::make_shared<CollectingSink>());
      SHARDPS_ASSERT_OK(store.Push(args, sinks.back()));
    }
    if (threads == 0) {
      EXPECT_EQ(sinks[0]->count(), 1u);
      EXPECT_EQ(sinks[1]->count(), 1u);
    }
    ASSERT_EQ(sinks[1]->Wait(1).size(), 1u);
    weights.push_back(Floats(sinks[1]->Wait(1)[0].weights));
  }
  ASSERT_EQ(weights[0].size(), static_cast<size_t>(n));
  EXPECT_EQ(weights[0], weights[1]);
  EXPECT_EQ(weights[0][5], 1.0f - 5e-3f);
}

}  // namespace
}  // namespace shardps::server
