#include "server/receive_budget.h"

#include <vector>

#include "gtest/gtest.h"

namespace shardps::server {
namespace {

ReceiveBudget::Fold F(int64_t step, uint32_t rank) { return {step, rank}; }

TEST(ReceiveBudgetTest, WithoutALimitEveryReadGoesAndNothingIsCounted) {
  ReceiveBudget budget(0);
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(budget.TryRead(7, 1 << 20, [] { FAIL() << "parked"; }));
  }
  budget.Take(1 << 20);
  EXPECT_EQ(budget.usage().in_use, 0);
}

TEST(ReceiveBudgetTest, AReadOverTheBudgetWaitsUntilBytesAreFreed) {
  ReceiveBudget budget(100);
  EXPECT_TRUE(budget.TryRead(1, 60, nullptr));
  int woken = 0;
  EXPECT_FALSE(budget.TryRead(2, 60, [&] { ++woken; }));
  EXPECT_EQ(budget.usage().in_use, 60);
  budget.Take(30);  // an early gradient: always taken
  EXPECT_EQ(budget.usage().in_use, 90);
  budget.Free(60);  // 30 + 60 fit: the parked read is admitted and woken
  EXPECT_EQ(woken, 1);
  EXPECT_EQ(budget.usage().in_use, 90);
  EXPECT_EQ(budget.usage().peak, 90);
}

TEST(ReceiveBudgetTest, ARankASumNeedsNextIsNeverParked) {
  ReceiveBudget budget(100);
  EXPECT_TRUE(budget.TryRead(0, 100, nullptr));
  int woken_3 = 0;
  int woken_5 = 0;
  EXPECT_FALSE(budget.TryRead(3, 50, [&] { ++woken_3; }));
  EXPECT_FALSE(budget.TryRead(5, 50, [&] { ++woken_5; }));
  // A chunk's sum now waits for rank 3: its read is admitted, over budget,
  // and wakes at RunAdmitted (not under the caller's locks).
  budget.MoveFold(std::nullopt, F(0, 3));
  EXPECT_EQ(woken_3, 0);
  budget.RunAdmitted();
  EXPECT_EQ(woken_3, 1);
  EXPECT_EQ(woken_5, 0);
  EXPECT_EQ(budget.usage().in_use, 150);
  // While the fold is at 3, rank 3 reads at once; rank 5 does not.
  EXPECT_TRUE(budget.TryRead(3, 50, nullptr));
  budget.MoveFold(F(0, 3), std::nullopt);  // the sum is complete
  EXPECT_FALSE(budget.TryRead(3, 50, [] {}));
  budget.Free(200);
  EXPECT_EQ(woken_5, 1);
}

TEST(ReceiveBudgetTest, OnlyTheLeastRankASumNeedsReadsPastTheBudget) {
  ReceiveBudget budget(100);
  EXPECT_TRUE(budget.TryRead(0, 100, nullptr));
  budget.MoveFold(std::nullopt, F(7, 4));  // one chunk waits for rank 4
  budget.MoveFold(std::nullopt, F(7, 2));  // another for rank 2
  // A chunk already at the next step waits for rank 0, whose push of it
  // cannot come before step 7 is done: it does not count.
  budget.MoveFold(std::nullopt, F(8, 0));
  EXPECT_TRUE(budget.TryRead(2, 10, nullptr));
  int woken_4 = 0;
  EXPECT_FALSE(budget.TryRead(4, 10, [&] { ++woken_4; }));
  EXPECT_FALSE(budget.TryRead(0, 10, [] {}));
  budget.MoveFold(F(7, 2), F(7, 3));  // rank 2 summed: the least is 3 now
  budget.RunAdmitted();
  EXPECT_EQ(woken_4, 0);
  budget.MoveFold(F(7, 3), std::nullopt);  // complete: 4 is least
  budget.RunAdmitted();
  EXPECT_EQ(woken_4, 1);
}

TEST(ReceiveBudgetTest, AStreamOfUnknownRankAndAnIdleBudgetAlwaysRead) {
  ReceiveBudget budget(10);
  EXPECT_TRUE(budget.TryRead(1, 1000, nullptr));  // nothing else in use
  EXPECT_TRUE(budget.TryRead(std::nullopt, 5, nullptr));
  EXPECT_FALSE(budget.TryRead(1, 5, [] {}));
}

// A stream whose last push said last_of_step has nothing more of that
// step: its rank being least does not let it read past the budget (what it
// would read is the next step's push, early), until the least sum is of
// the step its next push may be of.
TEST(ReceiveBudgetTest, AStreamDoneWithTheStepDoesNotReadPastTheBudget) {
  ReceiveBudget budget(100);
  EXPECT_TRUE(budget.TryRead(0, 100, nullptr));
  budget.MoveFold(std::nullopt, F(7, 4));  // a chunk of step 7 waits for 4
  // Rank 4's stream that still pushes in step 7 (or cannot tell) reads.
  EXPECT_TRUE(budget.TryRead(4, 10, nullptr, /*next_step=*/7));
  EXPECT_TRUE(budget.TryRead(4, 10, nullptr, std::nullopt));
  // Its stream that is done with step 7 waits.
  int woken = 0;
  EXPECT_FALSE(budget.TryRead(
      4, 10, [&] { ++woken; }, /*next_step=*/8));
  budget.MoveFold(F(7, 4), F(8, 2));  // the chunk moves to step 8, rank 2
  budget.RunAdmitted();
  EXPECT_EQ(woken, 0);
  budget.MoveFold(F(8, 2), F(8, 4));  // step 8 now waits for rank 4
  budget.RunAdmitted();
  EXPECT_EQ(woken, 1);
  EXPECT_EQ(budget.usage().in_use, 130);
}

}  // namespace
}  // namespace shardps::server
