// Backoff: the delays of a retry loop, doubling from an initial delay up to
// a cap. Thread-compatible.
//
//   Backoff backoff(absl::Milliseconds(100), absl::Seconds(2));
//   while (!(s = Try()).ok() && absl::Now() + backoff.Peek() < deadline) {
//     absl::SleepFor(backoff.Next());
//   }
#ifndef SHARDPS_COMMON_BACKOFF_H_
#define SHARDPS_COMMON_BACKOFF_H_

#include <algorithm>

#include "absl/time/time.h"

namespace shardps {

class Backoff {
 public:
  // REQUIRES: 0 < initial <= max.
  Backoff(absl::Duration initial, absl::Duration max)
      : initial_(initial), max_(max), next_(initial) {}

  // The delay to wait now; the one after is twice it, at most max.
  absl::Duration Next() {
    const absl::Duration now = next_;
    next_ = std::min(next_ * 2, max_);
    return now;
  }

  // What Next() will return, without moving on.
  absl::Duration Peek() const { return next_; }

  // Starts again from the initial delay (after a success).
  void Reset() { next_ = initial_; }

 private:
  absl::Duration initial_;
  absl::Duration max_;
  absl::Duration next_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_BACKOFF_H_
