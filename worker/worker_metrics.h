// The metrics of one worker (shardps_worker_*): steps, samples, step time and
// its compute and push parts, loss, retries and bytes exchanged. Updated once
// per step by the Trainer, on the training thread; scraped from any thread.
#ifndef SHARDPS_WORKER_WORKER_METRICS_H_
#define SHARDPS_WORKER_WORKER_METRICS_H_

#include <cstdint>

#include "absl/time/time.h"
#include "common/metrics.h"

namespace shardps::worker {

// What one training step did.
struct StepReport {
  int64_t step = 0;     // the step's number; step + 1 steps are complete
  int64_t samples = 0;  // this worker's slice of the batch
  double loss = 0;
  absl::Duration compute;  // forward and backward (pushing as it goes)
  // After compute: the part of the exchange until every gradient chunk was
  // sent, and all of it (the rest of the step, waiting for the shards).
  absl::Duration push;
  absl::Duration exchange;
  uint64_t pushed_bytes = 0;
  uint64_t pulled_bytes = 0;
  int64_t retries = 0;  // the client's retries so far (a running total)
};

class WorkerMetrics {
 public:
  // Registers the worker's metrics in `registry`, which must outlive this.
  explicit WorkerMetrics(prometheus::Registry& registry);

  // REQUIRES: one thread at a time (the training thread).
  void StepDone(const StepReport& r);

 private:
  prometheus::Counter& steps_;
  prometheus::Counter& samples_;
  prometheus::Counter& retries_;
  prometheus::Counter& pushed_bytes_;
  prometheus::Counter& pulled_bytes_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& compute_seconds_;
  prometheus::Histogram& push_seconds_;
  prometheus::Histogram& wait_seconds_;
  prometheus::Gauge& step_;
  prometheus::Gauge& loss_;
  int64_t retries_seen_ = 0;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_WORKER_METRICS_H_
