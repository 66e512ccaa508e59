#include "common/message_ring.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/shared_memory.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

// A ring of `capacity` data bytes at the start of a new region; both ends
// of it, as the two processes of a stream hold them.
struct Ends {
  explicit Ends(uint64_t capacity = MessageRing::kMinCapacity) {
    region = *SharedRegion::Create(MessageRing::kControlBytes + capacity);
    opened = *SharedRegion::Open(region->path(), region->size());
    producer = std::make_unique<MessageRing>(region->data(), region->size());
    consumer = std::make_unique<MessageRing>(opened->data(), opened->size());
  }
  std::unique_ptr<SharedRegion> region, opened;
  std::unique_ptr<MessageRing> producer, consumer;
};

std::string Message(int i) {
  // 1 to 300 bytes, so that messages end at every offset and wrap.
  return std::string(1 + (i * 37) % 300, static_cast<char>('a' + i % 26));
}

TEST(MessageRingTest, MessagesArriveInOrderAcrossManyWraps) {
  Ends ends;
  int sent = 0, taken = 0;
  std::string got;
  while (taken < 5000) {
    // A few at a time, as a step's pushes come.
    for (int k = 0; k < 1 + sent % 7 && sent < 5000; ++k) {
      SHARDPS_ASSERT_OK(ends.producer->Append(Message(sent)));
      ++sent;
    }
    ends.producer->Publish();
    for (;;) {
      SHARDPS_ASSERT_OK_AND_ASSIGN(bool popped, ends.consumer->Pop(&got));
      if (!popped) break;
      ASSERT_EQ(got, Message(taken)) << "message " << taken;
      ++taken;
    }
    ASSERT_EQ(taken, sent);
  }
}

TEST(MessageRingTest, NothingIsVisibleBeforePublish) {
  Ends ends;
  SHARDPS_ASSERT_OK(ends.producer->Append("header"));
  std::string got;
  SHARDPS_ASSERT_OK_AND_ASSIGN(bool popped, ends.consumer->Pop(&got));
  EXPECT_FALSE(popped);
  ends.producer->Publish();
  SHARDPS_ASSERT_OK_AND_ASSIGN(popped, ends.consumer->Pop(&got));
  EXPECT_TRUE(popped);
  EXPECT_EQ(got, "header");
}

TEST(MessageRingTest, AFullRingRefusesAndTakesAgainOnceRead) {
  Ends ends;
  const std::string m(500, 'x');  // 504 bytes a message
  int appended = 0;
  absl::Status s;
  while ((s = ends.producer->Append(m)).ok()) ++appended;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(appended, 8);  // 4096 / 504
  ends.producer->Publish();
  std::string got;
  SHARDPS_ASSERT_OK_AND_ASSIGN(bool popped, ends.consumer->Pop(&got));
  ASSERT_TRUE(popped);
  SHARDPS_EXPECT_OK(ends.producer->Append(m));
  // Too large for any ring of this size.
  EXPECT_EQ(ends.producer->Append(std::string(3000, 'y')).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MessageRingTest, ScribbledPositionsAndLengthsAreRefused) {
  {
    Ends ends;  // the consumer claims to have taken more than was sent
    const uint64_t tail = 1 << 20;
    std::memcpy(ends.region->data() + 64, &tail, 8);
    EXPECT_EQ(ends.producer->Append("x").code(), absl::StatusCode::kDataLoss);
  }
  {
    Ends ends;  // the producer claims more than the ring holds
    const uint64_t head = 1 << 20;
    std::memcpy(ends.region->data(), &head, 8);
    std::string got;
    EXPECT_EQ(ends.consumer->Pop(&got).status().code(),
              absl::StatusCode::kDataLoss);
  }
  {
    Ends ends;  // a message's length runs past what was published
    SHARDPS_ASSERT_OK(ends.producer->Append("header"));
    ends.producer->Publish();
    const uint32_t length = 4000;
    std::memcpy(ends.region->data() + MessageRing::kControlBytes, &length, 4);
    std::string got;
    EXPECT_EQ(ends.consumer->Pop(&got).status().code(),
              absl::StatusCode::kDataLoss);
  }
}

TEST(MessageRingTest, OnlyWellFormedRingsAreAccepted) {
  Ends ends;
  SHARDPS_EXPECT_OK(
      MessageRing::Check(ends.region->data(), ends.region->size()));
  EXPECT_FALSE(MessageRing::Check(ends.region->data() + 8, 4096 + 192).ok());
  EXPECT_FALSE(MessageRing::Check(ends.region->data(), 5000 + 192).ok());
  EXPECT_FALSE(MessageRing::Check(ends.region->data(), 2048 + 192).ok());
  EXPECT_EQ(MessageRing::BytesFor(1, 100), 192u + 4096);
  EXPECT_EQ(MessageRing::BytesFor(100, 100), 192u + 32768);
}

TEST(MessageRingTest, WaitReturnsOnPublishOnInterruptAndOnTimeout) {
  Ends ends;
  absl::Time start = absl::Now();
  ends.consumer->Wait(absl::Milliseconds(50));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));

  std::thread producer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(ends.producer->Append("late").ok());
    ends.producer->Publish();
  });
  start = absl::Now();
  std::string got;
  bool popped = false;
  while (!popped && absl::Now() - start < absl::Seconds(30)) {
    ends.consumer->Wait(absl::Seconds(30));
    popped = *ends.consumer->Pop(&got);
  }
  producer.join();
  EXPECT_TRUE(popped);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  std::thread interrupter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ends.consumer->Interrupt();
  });
  start = absl::Now();
  ends.consumer->Wait(absl::Seconds(30));
  interrupter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(MessageRingTest, AnotherProcessWakesTheConsumer) {
  Ends ends;
  constexpr int kMessages = 20000;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The producer, in bursts, sleeping now and then so that the consumer
    // sleeps too.
    for (int i = 0; i < kMessages; ++i) {
      while (!ends.producer->Append(Message(i)).ok()) {
        ends.producer->Publish();
        ::usleep(100);
      }
      if (i % 5 == 4) ends.producer->Publish();
      if (i % 1000 == 999) ::usleep(2000);
    }
    ends.producer->Publish();
    ::_exit(0);
  }
  std::string got;
  int taken = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (taken < kMessages && absl::Now() < deadline) {
    absl::StatusOr<bool> popped = ends.consumer->Pop(&got);
    ASSERT_TRUE(popped.ok()) << popped.status();
    if (!*popped) {
      ends.consumer->Wait(absl::Seconds(5));
      continue;
    }
    ASSERT_EQ(got, Message(taken));
    ++taken;
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(taken, kMessages);
}

}  // namespace
}  // namespace shardps
