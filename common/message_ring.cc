#include "common/message_ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"

namespace shardps {

struct MessageRing::Control {
  alignas(64) std::atomic<uint64_t> head;  // bytes the producer published
  alignas(64) std::atomic<uint64_t> tail;  // bytes the consumer took
  // Bumped by every Publish and Interrupt: the futex word.
  alignas(64) std::atomic<uint32_t> wakeups;
  std::atomic<uint32_t> sleeping;  // the consumer is in (or entering) Wait
};

namespace {

static_assert(sizeof(std::atomic<uint64_t>) == 8 &&
              std::atomic<uint64_t>::is_always_lock_free &&
              std::atomic<uint32_t>::is_always_lock_free);
constexpr uint32_t kWrap = 0xffffffffu;  // the rest of the data is skipped

uint64_t Round8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

// Between processes: not FUTEX_PRIVATE_FLAG.
void Futex(std::atomic<uint32_t>* word, int op, uint32_t value,
           const timespec* timeout) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout,
            nullptr, 0);
}

}  // namespace

uint64_t MessageRing::BytesFor(uint64_t messages, uint64_t message_bytes) {
  // Each message can also cost a wrap's skip of up to its own size.
  const uint64_t want = 2 * messages * Round8(4 + message_bytes);
  uint64_t capacity = kMinCapacity;
  while (capacity < want && capacity < kMaxCapacity) capacity *= 2;
  return kControlBytes + capacity;
}

absl::Status MessageRing::Check(const void* base, uint64_t bytes) {
  if (reinterpret_cast<uintptr_t>(base) % 64 != 0) {
    return absl::InvalidArgumentError(
        "a message ring must start at a cache "
        "line");
  }
  const uint64_t capacity = bytes < kControlBytes ? 0 : bytes - kControlBytes;
  if (!IsPowerOfTwo(capacity) || capacity < kMinCapacity ||
      capacity > kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a message ring of ", bytes, " bytes is not ", kControlBytes,
        " bytes of control and a power of two from ", kMinCapacity, " to ",
        kMaxCapacity, " bytes of data"));
  }
  return absl::OkStatus();
}

MessageRing::MessageRing(char* base, uint64_t bytes)
    : control_(reinterpret_cast<Control*>(base)),
      data_(base + kControlBytes),
      capacity_(bytes - kControlBytes) {
  static_assert(sizeof(Control) <= kControlBytes);
}

absl::Status MessageRing::Append(absl::string_view message) {
  const uint64_t need = Round8(4 + message.size());
  if (need > capacity_ / 2) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a message of ", message.size(),
                     " bytes is too large for a ring of ", capacity_));
  }
  const uint64_t tail = control_->tail.load(std::memory_order_acquire);
  if (tail > head_ || head_ - tail > capacity_ || tail % 8 != 0) {
    return absl::DataLossError(absl::StrCat("the ring's consumer says it took ",
                                            tail, " bytes of the ", head_,
                                            " published"));
  }
  uint64_t pos = head_ & (capacity_ - 1);
  const uint64_t contiguous = capacity_ - pos;
  const uint64_t skip = need > contiguous ? contiguous : 0;
  if (head_ + skip + need - tail > capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the ring is full (", head_ - tail, " of ", capacity_,
                     " bytes not taken yet)"));
  }
  if (skip > 0) {
    std::memcpy(data_ + pos, &kWrap, 4);
    head_ += skip;
    pos = 0;
  }
  const uint32_t length = static_cast<uint32_t>(message.size());
  std::memcpy(data_ + pos, &length, 4);
  std::memcpy(data_ + pos + 4, message.data(), message.size());
  head_ += need;
  return absl::OkStatus();
}

void MessageRing::Publish() {
  control_->head.store(head_, std::memory_order_release);
  // Either the consumer sees the new head (or count) before it sleeps, or
  // this sees it sleeping (the futex then finds the count changed or is
  // woken).
  control_->wakeups.fetch_add(1, std::memory_order_seq_cst);
  if (control_->sleeping.load(std::memory_order_seq_cst) != 0) {
    Futex(&control_->wakeups, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void MessageRing::Interrupt() {
  control_->wakeups.fetch_add(1, std::memory_order_seq_cst);
  Futex(&control_->wakeups, FUTEX_WAKE, INT_MAX, nullptr);
}

bool MessageRing::Empty() const {
  return control_->head.load(std::memory_order_seq_cst) == tail_;
}

absl::StatusOr<bool> MessageRing::Pop(std::string* out) {
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  auto corrupt = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("message ring at ", tail_, " of ",
                                            head, " published bytes: ", what));
  };
  while (head != tail_) {
    if (head < tail_ || head - tail_ > capacity_) {
      return corrupt("the producer's position is impossible");
    }
    const uint64_t pos = tail_ & (capacity_ - 1);
    uint32_t length;
    std::memcpy(&length, data_ + pos, 4);
    if (length == kWrap) {
      tail_ += capacity_ - pos;
      continue;
    }
    const uint64_t need = Round8(4 + uint64_t{length});
    if (need > capacity_ - pos || need > head - tail_) {
      return corrupt(absl::StrCat("a message of ", length,
                                  " bytes does not fit what was published"));
    }
    out->assign(data_ + pos + 4, length);
    tail_ += need;
    control_->tail.store(tail_, std::memory_order_release);
    return true;
  }
  // Skipped a wrap marker at the end: that space is free again.
  control_->tail.store(tail_, std::memory_order_release);
  return false;
}

uint32_t MessageRing::wakeups() const {
  return control_->wakeups.load(std::memory_order_seq_cst);
}

void MessageRing::WaitSince(uint32_t seen, absl::Duration timeout) {
  if (!Empty()) return;
  control_->sleeping.store(1, std::memory_order_seq_cst);
  if (Empty()) {
    const timespec ts = absl::ToTimespec(timeout);
    Futex(&control_->wakeups, FUTEX_WAIT, seen, &ts);
  }
  control_->sleeping.store(0, std::memory_order_relaxed);
}

}  // namespace shardps
