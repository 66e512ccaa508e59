// A fixed-size pool of threads running queued tasks in FIFO order. Used for
// the per-chunk optimizer updates on the servers. Thread-safe; the destructor
// runs every queued task, then joins the threads.
#ifndef SHARDPS_COMMON_THREAD_POOL_H_
#define SHARDPS_COMMON_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardps {

class ThreadPool {
 public:
  // REQUIRES: num_threads >= 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);
  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_THREAD_POOL_H_
