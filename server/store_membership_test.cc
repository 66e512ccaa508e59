// ParameterStore with a coordinator: sync steps that lose a rank complete
// with what arrived, workers join at the step they declare, restarted
// coordinators and rollbacks (ResetTo).
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/store_testing.h"

namespace shardps::server {
namespace {

v1::DeclareRequest JoinDeclaration(uint32_t rank, uint64_t incarnation,
                                   int64_t step) {
  v1::DeclareRequest req = SgdDeclaration(4, 0, 1, 0);
  req.set_rank(rank);
  req.set_incarnation(incarnation);
  req.set_join(true);
  req.set_join_step(step);
  return req;
}

TEST_F(StoreFixture, StepInFlightCompletesWithTheContributionsThatArrived) {
  Make(3);
  store_->ApplyView(WorkersView(5, {11, 22, 33}, {true, true, true}));
  auto sink0 = std::make_shared<CollectingSink>();
  auto sink1 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 2, 3, 4}, sink0, 0, 11));
  SHARDPS_ASSERT_OK(Push(1, 0, {3, 2, 1, 0}, sink1, 0, 22));
  EXPECT_EQ(sink0->count(), 0u);  // rank 2 is missing
  ASSERT_EQ(store_->Stalled(absl::ZeroDuration()).size(), 1u);
  EXPECT_EQ(store_->Stalled(absl::ZeroDuration())[0].missing_ranks,
            std::vector<uint32_t>{2});
  // Rank 2 dies: the step completes with the mean of ranks 0 and 1.
  const std::vector<std::string> changes =
      store_->ApplyView(WorkersView(6, {11, 22, 33}, {true, true, false}));
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("rank 2 left the job"), std::string::npos);
  std::vector<ChunkReply> r0 = sink0->Wait(1);
  ASSERT_EQ(r0.size(), 1u);
  EXPECT_EQ(Floats(r0[0].weights), std::vector<float>(4, -1.0f));
  EXPECT_EQ(sink1->Wait(1).size(), 1u);
  // The next step waits for ranks 0 and 1 only; rank 2's pushes are refused
  // and change nothing.
  auto late = std::make_shared<CollectingSink>();
  const absl::Status refused = Push(2, 1, {9, 9, 9, 9}, late, 0, 33);
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_NE(refused.message().find("left the job"), std::string::npos);
  SHARDPS_ASSERT_OK(Push(0, 1, {2, 2, 2, 2}, sink0, 0, 11));
  SHARDPS_ASSERT_OK(Push(1, 1, {0, 0, 0, 0}, sink1, 0, 22));
  r0 = sink0->Wait(2);
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_EQ(Floats(r0[1].weights), std::vector<float>(4, -2.0f));
  EXPECT_EQ(late->count(), 0u);
  EXPECT_EQ(store_->Report().active_ranks_size(), 2);
}

TEST_F(StoreFixture, NewWorkerJoinsAtTheStepItDeclares) {
  Make(2);
  store_->ApplyView(WorkersView(3, {11, 22}, {true, true}));
  store_->ApplyView(WorkersView(4, {11, 22}, {true, false}));  // rank 1 died
  auto sink0 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink0, 0, 11));
  ASSERT_EQ(sink0->Wait(1).size(), 1u);  // alone: applied at once
  // A new process takes rank 1. Before the shard sees it: retry.
  v1::DeclareRequest join = JoinDeclaration(1, 44, 3);
  EXPECT_EQ(store_->Declare(join).status().code(),
            absl::StatusCode::kUnavailable);
  store_->ApplyView(WorkersView(5, {11, 44}, {true, true}));
  v1::DeclareRequest ask = SgdDeclaration(4, 0, 1, 0);
  ask.set_rank(1);
  ask.set_incarnation(44);
  absl::StatusOr<v1::DeclareResponse> asked = store_->Declare(ask);
  SHARDPS_ASSERT_OK(asked);
  EXPECT_TRUE(asked->must_join());
  EXPECT_EQ(asked->max_version(), 1);
  // Until it declares its join step it is refused and not waited for.
  auto sink1 = std::make_shared<CollectingSink>();
  EXPECT_EQ(Push(1, 1, {5, 5, 5, 5}, sink1, 0, 44).code(),
            absl::StatusCode::kFailedPrecondition);
  SHARDPS_ASSERT_OK(Push(0, 1, {1, 1, 1, 1}, sink0, 0, 11));
  ASSERT_EQ(sink0->Wait(2).size(), 2u);
  // The old process of rank 1 is fenced off.
  EXPECT_EQ(store_->Declare(JoinDeclaration(1, 22, 3)).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(Push(1, 2, {5, 5, 5, 5}, sink1, 0, 22).code(),
            absl::StatusCode::kAborted);
  // Joining at step 3: step 2 goes on without rank 1, step 3 waits for it.
  absl::StatusOr<v1::DeclareResponse> joined = store_->Declare(join);
  SHARDPS_ASSERT_OK(joined);
  EXPECT_FALSE(joined->must_join());
  EXPECT_EQ(joined->join_step(), 3);
  SHARDPS_ASSERT_OK(Push(0, 2, {1, 1, 1, 1}, sink0, 0, 11));
  ASSERT_EQ(sink0->Wait(3).size(), 3u);
  EXPECT_EQ(Weights(), std::vector<float>(4, -2.0f));
  SHARDPS_ASSERT_OK(Push(0, 3, {1, 1, 1, 1}, sink0, 0, 11));
  EXPECT_EQ(sink0->count(), 3u);  // waits for rank 1 now
  SHARDPS_ASSERT_OK(Push(1, 3, {3, 3, 3, 3}, sink1, 0, 44));
  ASSERT_EQ(sink1->Wait(1).size(), 1u);
  EXPECT_EQ(Floats(sink1->Wait(1)[0].weights), std::vector<float>(4, -4.0f));
  // A join step the shard has passed is refused, and changes nothing.
  store_->ApplyView(WorkersView(6, {11, 55}, {true, true}));
  EXPECT_EQ(store_->Declare(JoinDeclaration(1, 55, 2)).status().code(),
            absl::StatusCode::kOutOfRange);
  SHARDPS_ASSERT_OK(Push(0, 4, {1, 1, 1, 1}, sink0, 0, 11));
  EXPECT_EQ(sink0->Wait(5).size(), 5u);  // rank 1 (pending) not waited for
}

TEST_F(StoreFixture, RestartedCoordinatorKeepsTheRanksItHasNotSeenYet) {
  Make(2);
  store_->ApplyView(WorkersView(7, {11, 22}, {true, true}, /*coordinator=*/1));
  // A new coordinator: generations start again, rank 1 has not rejoined.
  EXPECT_TRUE(
      store_
          ->ApplyView(WorkersView(2, {11, 0}, {true, false}, /*coordinator=*/2))
          .empty());
  auto sink0 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink0, 0, 11));
  EXPECT_EQ(sink0->count(), 0u);  // still waits for rank 1
  store_->ApplyView(WorkersView(3, {11, 22}, {true, true}, 2));  // it rejoined
  auto sink1 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(1, 0, {1, 1, 1, 1}, sink1, 0, 22));
  EXPECT_EQ(sink0->Wait(1).size(), 1u);
}

TEST_F(StoreFixture,
       FirstWorkersArrivingLateToASettledCoordinatorAreWaitedFor) {
  Make(2);
  // The coordinator has been up for a heartbeat timeout before this shard
  // joined; no worker has joined yet.
  v1::ClusterView early = WorkersView(2, {0, 0}, {false, false});
  early.set_settled(true);
  EXPECT_TRUE(store_->ApplyView(early).empty());
  store_->ApplyView(WorkersView(4, {11, 22}, {true, true}));
  auto sink0 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink0, 0, 11));
  EXPECT_EQ(sink0->count(), 0u);  // waits for rank 1
  // A rank that was seen and never came back to a restarted coordinator
  // is gone once that coordinator settled.
  v1::ClusterView restarted =
      WorkersView(2, {11, 0}, {true, false}, /*coordinator=*/7);
  EXPECT_TRUE(store_->ApplyView(restarted).empty());
  EXPECT_EQ(sink0->count(), 0u);
  restarted.set_generation(3);
  restarted.set_settled(true);
  EXPECT_EQ(store_->ApplyView(restarted).size(), 1u);
  EXPECT_EQ(sink0->Wait(1).size(), 1u);
}

TEST_F(StoreFixture, SspDoesNotWaitForARankThatLeft) {
  Make(2, v1::CONSISTENCY_SSP, /*staleness=*/1);
  store_->ApplyView(WorkersView(2, {11, 22}, {true, true}));
  auto sink0 = std::make_shared<CollectingSink>();
  for (int64_t step = 0; step < 3; ++step) {
    SHARDPS_ASSERT_OK(Push(0, step, {0, 0, 0, 0}, sink0, 0, 11));
  }
  EXPECT_EQ(sink0->count(), 1u);  // held: rank 1 is at clock 0
  store_->ApplyView(WorkersView(3, {11, 22}, {true, false}));
  EXPECT_EQ(sink0->Wait(3).size(), 3u);
}

TEST_F(StoreFixture, ResetToACheckpointFailsTheWaitingPushesAndRewinds) {
  Make(2);
  auto sink0 = std::make_shared<CollectingSink>();
  auto sink1 = std::make_shared<CollectingSink>();
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink0));
  SHARDPS_ASSERT_OK(Push(1, 0, {1, 1, 1, 1}, sink1));
  ASSERT_EQ(sink0->Wait(1).size(), 1u);                // step 0 applied: w = 0
  SHARDPS_ASSERT_OK(Push(0, 1, {5, 5, 5, 5}, sink0));  // waits for rank 1
  ChunkState saved;
  saved.chunk_id = 0;
  saved.version = 0;
  saved.weights = {7, 7, 7, 7};
  // A checkpoint that does not fit changes nothing.
  ChunkState wrong = saved;
  wrong.weights.resize(3);
  EXPECT_EQ(store_->ResetTo({wrong}, absl::AbortedError("x"), 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Weights(), std::vector<float>(4, 0.0f));
  EXPECT_TRUE(sink0->failures().empty());

  SHARDPS_ASSERT_OK(
      store_->ResetTo({saved}, absl::AbortedError("rolled back"), 3));
  ASSERT_EQ(sink0->failures().size(), 1u);
  EXPECT_EQ(sink0->failures()[0].code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Weights(), std::vector<float>(4, 7.0f));
  EXPECT_EQ(store_->Report().max_version(), 0);
  EXPECT_EQ(store_->Report().rollback_id(), 3u);
  // A push from before the rollback is refused and changes nothing.
  EXPECT_EQ(Push(1, 0, {9, 9, 9, 9}, sink1).code(), absl::StatusCode::kAborted);
  // Training goes on from the checkpoint's step; rank 0's dropped push of
  // step 1 is gone.
  SHARDPS_ASSERT_OK(Push(0, 0, {1, 1, 1, 1}, sink0, 0, 0, 3));
  SHARDPS_ASSERT_OK(Push(1, 0, {3, 3, 3, 3}, sink1, 0, 0, 3));
  ASSERT_EQ(sink1->Wait(2).size(), 2u);
  EXPECT_EQ(Weights(), std::vector<float>(4, 5.0f));
}

}  // namespace
}  // namespace shardps::server
