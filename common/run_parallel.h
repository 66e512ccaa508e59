// RunParallel: fn(i) for every i in [0, n), each on a thread of its own (the
// caller's thread takes the last), returning the first error by index.
// For a few blocking calls at once, one per shard: not a thread pool.
#ifndef SHARDPS_COMMON_RUN_PARALLEL_H_
#define SHARDPS_COMMON_RUN_PARALLEL_H_

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace shardps {

inline absl::Status RunParallel(size_t n,
                                const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i + 1 < n; ++i) {
    threads.emplace_back([&, i] { statuses[i] = fn(i); });
  }
  if (n > 0) statuses[n - 1] = fn(n - 1);
  for (std::thread& t : threads) t.join();
  for (absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_RUN_PARALLEL_H_
