#include "common/signal_wait.h"

#include <pthread.h>
#include <signal.h>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

// SIGUSR1 blocked on this (the only) thread waits as pending until taken.
class SignalWaitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &set, &old_), 0);
  }
  void TearDown() override { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

TEST_F(SignalWaitTest, TakesAPendingSignal) {
  ASSERT_EQ(pthread_kill(pthread_self(), SIGUSR1), 0);
  EXPECT_EQ(WaitForSignalFor({SIGUSR1}, absl::Seconds(10)), SIGUSR1);
}

TEST_F(SignalWaitTest, ReturnsZeroWhenNoneCame) {
  EXPECT_EQ(WaitForSignalFor({SIGUSR1}, absl::ZeroDuration()), 0);
  EXPECT_EQ(WaitForSignalFor({SIGUSR1}, absl::Milliseconds(1)), 0);
}

}  // namespace
}  // namespace shardps
