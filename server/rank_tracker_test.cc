#include "server/rank_tracker.h"

#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

// WorkersView (store_testing.h), settled or not.
v1::ClusterView SettledView(uint64_t generation,
                            std::vector<uint64_t> incarnations,
                            std::vector<bool> alive) {
  v1::ClusterView view = WorkersView(generation, incarnations, alive);
  view.set_settled(true);
  return view;
}

TEST(RankTrackerTest, StaticJobWaitsForEveryRankAndTakesAnyIncarnation) {
  RankTracker ranks(0, 3);
  EXPECT_EQ(ranks.ActiveRanks(0), (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_FALSE(ranks.Complete({true, true, false}, 0));
  EXPECT_TRUE(ranks.Complete({true, true, true}, 0));
  SHARDPS_EXPECT_OK(ranks.CheckPush(1, 12345, 7));
  EXPECT_EQ(ranks.view_generation(), 0u);
  // Nobody can join a job that follows no coordinator.
  EXPECT_EQ(ranks.BeginJoin(1, 0, 4).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RankTrackerTest, RankThatLeftIsNotWaitedForAndIsFencedOff) {
  RankTracker ranks(0, 2);
  bool released = true;
  EXPECT_TRUE(ranks.ApplyView(WorkersView(1, {11, 22}, {true, true}), &released)
                  .empty());
  EXPECT_FALSE(released);
  const std::vector<std::string> changes =
      ranks.ApplyView(WorkersView(2, {11, 22}, {true, false}), &released);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("rank 1 left the job"), std::string::npos)
      << changes[0];
  EXPECT_TRUE(released);
  EXPECT_TRUE(ranks.Complete({true, false}, 0));
  EXPECT_EQ(ranks.ActiveRanks(0), (std::vector<uint32_t>{0}));
  EXPECT_EQ(ranks.CheckPush(1, 22, 0).code(), absl::StatusCode::kAborted);
  // An older view changes nothing.
  EXPECT_TRUE(ranks.ApplyView(WorkersView(1, {11, 22}, {true, true}), &released)
                  .empty());
  EXPECT_FALSE(released);
  EXPECT_EQ(ranks.view_generation(), 2u);
}

TEST(RankTrackerTest, NewProcessMustJoinAndIsWaitedForFromItsJoinStep) {
  RankTracker ranks(0, 2);
  bool released = false;
  ranks.ApplyView(WorkersView(1, {11, 22}, {true, true}), &released);
  ranks.ApplyView(WorkersView(2, {11, 33}, {true, true}), &released);
  EXPECT_TRUE(released);  // the old process of rank 1 is not waited for
  EXPECT_TRUE(ranks.standing(1).must_join);
  EXPECT_EQ(ranks.CheckPush(1, 33, 0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ranks.CheckPush(1, 22, 0).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ranks.CheckIncarnation(1, 44).code(),
            absl::StatusCode::kUnavailable);
  absl::StatusOr<RankTracker::JoinToken> token = ranks.BeginJoin(1, 33, 4);
  SHARDPS_ASSERT_OK(token.status());
  EXPECT_FALSE(ranks.standing(1).must_join);
  EXPECT_EQ(ranks.standing(1).from_step, 4);
  EXPECT_FALSE(ranks.WaitsFor(1, 3));
  EXPECT_TRUE(ranks.WaitsFor(1, 4));
  EXPECT_TRUE(ranks.Complete({true, false}, 3));
  EXPECT_FALSE(ranks.Complete({true, false}, 4));
  EXPECT_EQ(ranks.CheckPush(1, 33, 3).code(), absl::StatusCode::kOutOfRange);
  SHARDPS_EXPECT_OK(ranks.CheckPush(1, 33, 4));
  ranks.UndoJoin(*token);  // too late after all
  EXPECT_TRUE(ranks.standing(1).must_join);
}

TEST(RankTrackerTest, SlowestClockCountsOnlyRanksInTheJob) {
  RankTracker ranks(0, 3);
  EXPECT_EQ(ranks.SlowestClock({5, 2, 9}), 2);
  bool released = false;
  ranks.ApplyView(WorkersView(1, {1, 2, 3}, {true, true, true}), &released);
  ranks.ApplyView(WorkersView(2, {1, 2, 3}, {true, false, true}), &released);
  EXPECT_EQ(ranks.SlowestClock({5, 2, 9}), 5);
  ranks.ApplyView(WorkersView(3, {1, 2, 3}, {false, false, false}), &released);
  EXPECT_FALSE(ranks.SlowestClock({5, 2, 9}).has_value());
}

TEST(RankTrackerTest,
     FirstWorkersArrivingAreNotGoneUntilTheCoordinatorSettles) {
  RankTracker ranks(0, 2);
  bool released = false;
  // Rank 1 has not joined yet (incarnation 0): still waited for.
  ranks.ApplyView(WorkersView(1, {11, 0}, {true, false}), &released);
  EXPECT_FALSE(released);
  EXPECT_TRUE(ranks.WaitsFor(1, 0));
  ranks.ApplyView(WorkersView(2, {11, 22}, {true, true}), &released);
  // Seen alive, then absent once the coordinator settled: gone.
  ranks.ApplyView(SettledView(3, {11, 0}, {true, false}), &released);
  EXPECT_TRUE(released);
  EXPECT_FALSE(ranks.WaitsFor(1, 0));
}

}  // namespace
}  // namespace shardps::server
