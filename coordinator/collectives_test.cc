#include "coordinator/collectives.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::coordinator {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000000);

// A view whose workers `alive` hold their ranks with incarnation 100 + rank.
v1::ClusterView View(uint64_t generation, int workers,
                     const std::vector<uint32_t>& alive) {
  v1::ClusterView view;
  view.set_generation(generation);
  view.set_num_workers(workers);
  for (int r = 0; r < workers; ++r) {
    v1::WorkerSlot* w = view.add_workers();
    w->set_rank(r);
    w->set_incarnation(100 + r);
    w->set_alive(std::find(alive.begin(), alive.end(), r) != alive.end());
  }
  return view;
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::vector<float> FloatsOf(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

v1::CollectiveRequest Sum(uint32_t rank, uint64_t sequence,
                          const std::vector<float>& values) {
  v1::CollectiveRequest r;
  r.set_rank(rank);
  r.set_incarnation(100 + rank);
  r.set_sequence(sequence);
  r.set_op(v1::COLLECTIVE_OP_SUM);
  r.set_dtype(v1::COLLECTIVE_DTYPE_FLOAT32);
  r.add_shape(static_cast<int64_t>(values.size()));
  r.set_values(Floats(values));
  r.set_timeout_ms(10000);
  return r;
}

// Records each call's answer by rank.
class CollectivesTest : public ::testing::Test {
 protected:
  void Call(const v1::CollectiveRequest& r, const v1::ClusterView& view,
            absl::Time now = kStart) {
    answers_.erase(r.rank());
    collectives_.Call(
        r, view, now,
        [this, rank = r.rank()](absl::StatusOr<v1::CollectiveResponse> result) {
          ASSERT_FALSE(answers_.count(rank)) << "answered twice";
          answers_.emplace(rank, std::move(result));
        });
  }
  const absl::StatusOr<v1::CollectiveResponse>* Answer(uint32_t rank) {
    auto it = answers_.find(rank);
    return it == answers_.end() ? nullptr : &it->second;
  }

  Collectives collectives_;
  std::map<uint32_t, absl::StatusOr<v1::CollectiveResponse>> answers_;
};

TEST_F(CollectivesTest, AnswersEveryRankWithTheRankOrderSumInAnyArrivalOrder) {
  const v1::ClusterView view = View(1, 3, {0, 1, 2});
  const std::vector<std::vector<float>> values = {
      {1e8f, 0.5f}, {1.0f, 0.25f}, {-1e8f, 0.125f}};
  std::vector<uint32_t> order = {0, 1, 2};
  uint64_t sequence = 0;
  do {
    SCOPED_TRACE(order[0] * 100 + order[1] * 10 + order[2]);
    ++sequence;
    answers_.clear();
    for (uint32_t rank : order) {
      EXPECT_EQ(Answer(order[0]), nullptr);  // nobody before the last
      Call(Sum(rank, sequence, values[rank]), view);
    }
    for (uint32_t rank : order) {
      ASSERT_NE(Answer(rank), nullptr);
      SHARDPS_ASSERT_OK(*Answer(rank));
      EXPECT_EQ(FloatsOf((*Answer(rank))->values()),
                (std::vector<float>{0.0f, 0.875f}));
      EXPECT_EQ((*Answer(rank))->ranks_size(), 3);
    }
    EXPECT_EQ(collectives_.open(), 0u);  // forgotten once answered
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST_F(CollectivesTest, BroadcastsFromSrcAndBarrierWaitsForAll) {
  const v1::ClusterView view = View(1, 2, {0, 1});
  for (uint32_t rank : {0u, 1u}) {
    v1::CollectiveRequest r = Sum(rank, 1, {});
    r.set_op(v1::COLLECTIVE_OP_BROADCAST);
    r.set_src(1);
    r.set_dtype(v1::COLLECTIVE_DTYPE_FLOAT32);
    r.clear_shape();
    r.add_shape(2);
    r.set_values(rank == 1 ? Floats({3.0f, 4.0f}) : "");
    Call(r, view);
  }
  for (uint32_t rank : {0u, 1u}) {
    SHARDPS_ASSERT_OK(*Answer(rank));
    EXPECT_EQ(FloatsOf((*Answer(rank))->values()),
              (std::vector<float>{3.0f, 4.0f}));
  }
  answers_.clear();
  v1::CollectiveRequest barrier;
  barrier.set_op(v1::COLLECTIVE_OP_BARRIER);
  barrier.set_sequence(2);
  barrier.set_timeout_ms(1000);
  barrier.set_incarnation(100);
  Call(barrier, view);
  EXPECT_EQ(Answer(0), nullptr);
  barrier.set_rank(1);
  barrier.set_incarnation(101);
  Call(barrier, view);
  SHARDPS_EXPECT_OK(*Answer(0));
  SHARDPS_EXPECT_OK(*Answer(1));
}

TEST_F(CollectivesTest, AMismatchIsRefusedAndChangesNothing) {
  const v1::ClusterView view = View(1, 2, {0, 1});
  Call(Sum(0, 1, {1.0f, 2.0f}), view);
  v1::CollectiveRequest other = Sum(1, 1, {1.0f, 2.0f});
  other.set_op(v1::COLLECTIVE_OP_MAX);
  Call(other, view);
  ASSERT_NE(Answer(1), nullptr);
  EXPECT_EQ(Answer(1)->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(Answer(1)->status().message(),
                                "rank 1 calls all_reduce(max) float32 [2] but "
                                "rank 0 called all_reduce(sum) float32 [2]"))
      << Answer(1)->status();
  EXPECT_EQ(Answer(0), nullptr);
  // The same rank then calls the right one: the collective completes.
  Call(Sum(1, 1, {3.0f, 4.0f}), view);
  SHARDPS_ASSERT_OK(*Answer(0));
  EXPECT_EQ(FloatsOf((*Answer(0))->values()), (std::vector<float>{4.0f, 6.0f}));
}

TEST_F(CollectivesTest, ARankThatLeftFailsTheCollectiveForTheOthers) {
  Call(Sum(0, 1, {1.0f}), View(1, 3, {0, 1, 2}));
  Call(Sum(2, 1, {1.0f}), View(1, 3, {0, 1, 2}));
  collectives_.DropDeparted(View(2, 3, {0, 2}));
  for (uint32_t rank : {0u, 2u}) {
    ASSERT_NE(Answer(rank), nullptr);
    EXPECT_EQ(Answer(rank)->status().code(), absl::StatusCode::kAborted);
    EXPECT_EQ(Answer(rank)->status().message(),
              "collective 1 (all_reduce(sum) float32 [1]) cannot complete: "
              "rank 1 left the job before calling it (ranks 0, 2 called it)");
  }
  EXPECT_EQ(collectives_.open(), 0u);
  // A call made with a view older than the departure sees it.
  Call(Sum(0, 2, {1.0f}), View(1, 3, {0, 1, 2}));
  Call(Sum(2, 2, {1.0f}), View(1, 3, {0, 1, 2}));
  SHARDPS_ASSERT_OK(*Answer(2));
  EXPECT_EQ((*Answer(2))->ranks_size(), 2);
}

TEST_F(CollectivesTest, ARestartedRankIsAnotherProcess) {
  Call(Sum(0, 1, {1.0f}), View(1, 2, {0, 1}));
  v1::ClusterView restarted = View(3, 2, {0, 1});
  restarted.mutable_workers(1)->set_incarnation(999);
  collectives_.DropDeparted(restarted);
  ASSERT_NE(Answer(0), nullptr);
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kAborted);
  // Its old incarnation's calls are refused.
  Call(Sum(1, 2, {1.0f}), restarted);
  EXPECT_EQ(Answer(1)->status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CollectivesTest, ATimeoutNamesTheRanksMissingAndLateCallersGetIt) {
  const v1::ClusterView view = View(1, 3, {0, 1, 2});
  Call(Sum(0, 1, {1.0f}), view);
  collectives_.ExpireWaits(kStart + absl::Seconds(9));
  EXPECT_EQ(Answer(0), nullptr);
  collectives_.ExpireWaits(kStart + absl::Seconds(11));
  ASSERT_NE(Answer(0), nullptr);
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Answer(0)->status().message(),
            "collective 1 (all_reduce(sum) float32 [1]) timed out: ranks 1, 2 "
            "did not call it (rank 0 did)");
  Call(Sum(1, 1, {1.0f}), view, kStart + absl::Seconds(12));
  EXPECT_EQ(Answer(1)->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(Answer(1)->status().message(), "too late"));
  EXPECT_EQ(collectives_.open(), 0u);
}

TEST_F(CollectivesTest, RefusedCallsOpenNothing) {
  const v1::ClusterView view = View(1, 2, {0, 1});
  v1::CollectiveRequest big = Sum(0, 1, {});
  big.clear_shape();
  big.add_shape(1 << 19);
  big.set_values(std::string(size_t{1} << 21, '\0'));
  Call(big, view);
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kResourceExhausted);
  v1::CollectiveRequest stranger = Sum(1, 1, {1.0f});
  stranger.set_incarnation(7);
  Call(stranger, view);
  EXPECT_EQ(Answer(1)->status().code(), absl::StatusCode::kFailedPrecondition);
  v1::CollectiveRequest bad_src = Sum(0, 1, {1.0f});
  bad_src.set_op(v1::COLLECTIVE_OP_BROADCAST);
  bad_src.set_src(5);
  Call(bad_src, view);
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(collectives_.open(), 0u);
  // Twice the same sequence from one rank.
  Call(Sum(0, 1, {1.0f}), view);
  Call(Sum(0, 1, {1.0f}), view);
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kAlreadyExists);
  answers_.clear();
  collectives_.Shutdown();
  EXPECT_EQ(Answer(0)->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(collectives_.open(), 0u);
}

}  // namespace
}  // namespace shardps::coordinator
