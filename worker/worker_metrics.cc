#include "worker/worker_metrics.h"

#include <algorithm>
#include <string>

namespace shardps::worker {

WorkerMetrics::WorkerMetrics(prometheus::Registry& r)
    : steps_(AddCounter(r, "shardps_worker_steps_total",
                        "Training steps completed.")),
      samples_(AddCounter(r, "shardps_worker_samples_total",
                          "Training samples this worker computed gradients "
                          "on.")),
      retries_(AddCounter(r, "shardps_worker_push_retries_total",
                          "Push attempts that failed and were retried.")),
      pushed_bytes_(AddCounter(r, "shardps_worker_pushed_bytes_total",
                               "Gradient bytes pushed (once per step, retries "
                               "not counted again).")),
      pulled_bytes_(AddCounter(r, "shardps_worker_pulled_bytes_total",
                               "Weight bytes received in step replies.")),
      step_seconds_(AddHistogram(r, "shardps_worker_step_seconds",
                                 "One training step: compute, push and wait.",
                                 LatencyBuckets())),
      compute_seconds_(AddHistogram(r, "shardps_worker_compute_seconds",
                                    "Forward and backward of one step.",
                                    LatencyBuckets())),
      push_seconds_(AddHistogram(r, "shardps_worker_push_seconds",
                                 "Sending one step's gradient chunks.",
                                 LatencyBuckets())),
      wait_seconds_(AddHistogram(r, "shardps_worker_wait_seconds",
                                 "Waiting for the updated weights after the "
                                 "push.",
                                 LatencyBuckets())),
      step_(
          AddGauge(r, "shardps_worker_step", "Steps this job has completed.")),
      loss_(AddGauge(r, "shardps_worker_loss",
                     "Training loss of the last step (this worker's slice).")) {
}

void WorkerMetrics::StepDone(const StepReport& r) {
  steps_.Increment();
  samples_.Increment(static_cast<double>(r.samples));
  pushed_bytes_.Increment(static_cast<double>(r.pushed_bytes));
  pulled_bytes_.Increment(static_cast<double>(r.pulled_bytes));
  if (r.retries > retries_seen_) {
    retries_.Increment(static_cast<double>(r.retries - retries_seen_));
    retries_seen_ = r.retries;
  }
  const absl::Duration push = std::min(r.push, r.exchange);
  step_seconds_.Observe(Seconds(r.compute + r.exchange));
  compute_seconds_.Observe(Seconds(r.compute));
  push_seconds_.Observe(Seconds(push));
  wait_seconds_.Observe(Seconds(r.exchange - push));
  step_.Set(static_cast<double>(r.step + 1));
  loss_.Set(r.loss);
}

}  // namespace shardps::worker
