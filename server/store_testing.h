// A ReplySink for tests of the ParameterStore: keeps every reply and every
// failure; Wait(n) blocks (up to 30 s) until `n` replies have arrived.
// Test-only.
#ifndef SHARDPS_SERVER_STORE_TESTING_H_
#define SHARDPS_SERVER_STORE_TESTING_H_

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/parameter_store.h"

namespace shardps::server {

class CollectingSink : public ReplySink {
 public:
  void Deliver(ChunkReply reply) override {
    absl::MutexLock lock(&mu_);
    replies_.push_back(std::move(reply));
  }
  void Fail(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    failures_.push_back(status);
  }
  // The replies so far, once there are `n` of them or 30 s passed.
  std::vector<ChunkReply> Wait(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return replies_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return replies_;
  }
  size_t count() {
    absl::MutexLock lock(&mu_);
    return replies_.size();
  }
  std::vector<absl::Status> failures() {
    absl::MutexLock lock(&mu_);
    return failures_;
  }

 private:
  absl::Mutex mu_;
  std::vector<ChunkReply> replies_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> failures_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_STORE_TESTING_H_
