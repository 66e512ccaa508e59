// A one-way queue of small messages in shared memory, with a futex to sleep
// on: how a co-located worker and shard pass a PushPull stream's headers
// once its payloads already go through the stream's region
// (common/shared_memory.h). Handing a header to gRPC costs a trip through
// its HTTP/2 stack and a wake-up of one of its threads on each side; a
// ring costs a copy of the header and, only when the other side sleeps,
// one futex call.
//
// A ring lies inside a region: a 192-byte control block (the producer's
// and the consumer's positions, a wake-up counter, a sleeping flag, each
// on its own cache line), then `capacity` bytes of data (a power of two).
// Each message is a 4-byte length and its bytes, padded to 8; one that
// does not fit before the end of the data starts at its beginning, after
// a wrap marker. One producer and one consumer per ring, each keeping its
// own position in its own memory: what the other process writes into the
// region is only ever read, checked, and never trusted as an index.
#ifndef SHARDPS_COMMON_MESSAGE_RING_H_
#define SHARDPS_COMMON_MESSAGE_RING_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shardps {

class MessageRing {
 public:
  static constexpr uint64_t kControlBytes = 192;
  static constexpr uint64_t kMinCapacity = 4096;
  static constexpr uint64_t kMaxCapacity = uint64_t{1} << 24;
  // Bytes of ring (control and data) for at least `messages` messages of
  // up to `message_bytes` each in flight at once: a power of two of data.
  static uint64_t BytesFor(uint64_t messages, uint64_t message_bytes);

  // The ring at `base` (cache-line aligned, `bytes` long: kControlBytes
  // and a power of two from kMinCapacity to kMaxCapacity, as BytesFor
  // gives). InvalidArgument otherwise. A new region is zero-filled, which
  // is an empty ring.
  static absl::Status Check(const void* base, uint64_t bytes);
  // `base` and `bytes` as Check accepts them.
  MessageRing(char* base, uint64_t bytes);
  MessageRing(const MessageRing&) = delete;
  MessageRing& operator=(const MessageRing&) = delete;

  // Producer. Appends `message` (not yet visible: Publish shows it).
  // ResourceExhausted when it does not fit now, DataLoss when the
  // consumer's position is impossible (the other process scribbled on
  // the ring).
  absl::Status Append(absl::string_view message);
  // Makes what was appended visible and wakes the consumer if it sleeps.
  void Publish();

  // Consumer. Copies the next message into `out`: true when there was
  // one, false when the ring is empty; DataLoss when the ring holds no
  // valid message where one must be.
  absl::StatusOr<bool> Pop(std::string* out);
  // Sleeps until something was published, `Interrupt` was called, or
  // `timeout` has passed (at most; it may return early).
  void Wait(absl::Duration timeout) { WaitSince(wakeups(), timeout); }
  // Wait, but returns at once if a Publish or Interrupt came since
  // wakeups() returned `seen`: a consumer that checks a condition of its
  // own (set before an Interrupt) reads wakeups() first, then the
  // condition, and misses no Interrupt.
  uint32_t wakeups() const;
  void WaitSince(uint32_t seen, absl::Duration timeout);
  // Wakes the consumer's Wait from any thread of any process (for a
  // reason of the caller's own, such as the stream ending).
  void Interrupt();

  uint64_t capacity() const { return capacity_; }

 private:
  struct Control;
  bool Empty() const;

  Control* const control_;
  char* const data_;
  const uint64_t capacity_;
  // This side's own position: the producer's head, the consumer's tail.
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_MESSAGE_RING_H_
