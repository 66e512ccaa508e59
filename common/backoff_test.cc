#include "common/backoff.h"

#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(BackoffTest, DoublesUpToTheCap) {
  Backoff backoff(absl::Milliseconds(100), absl::Milliseconds(500));
  EXPECT_EQ(backoff.Peek(), absl::Milliseconds(100));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(100));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(200));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(400));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(500));
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(500));
  EXPECT_EQ(backoff.Peek(), absl::Milliseconds(500));
}

TEST(BackoffTest, ResetStartsAgain) {
  Backoff backoff(absl::Milliseconds(10), absl::Seconds(1));
  backoff.Next();
  backoff.Next();
  backoff.Reset();
  EXPECT_EQ(backoff.Next(), absl::Milliseconds(10));
}

TEST(BackoffTest, InitialEqualToTheCapStays) {
  Backoff backoff(absl::Seconds(1), absl::Seconds(1));
  EXPECT_EQ(backoff.Next(), absl::Seconds(1));
  EXPECT_EQ(backoff.Next(), absl::Seconds(1));
}

}  // namespace
}  // namespace shardps
