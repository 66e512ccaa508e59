// The metrics of one parameter shard (shardps_server_*, shardps_checkpoint_*):
// handles registered once in the process's registry and passed by pointer
// to the store and the service, where a null pointer means no metrics.
// Thread-safe: every handle is atomic.
#ifndef SHARDPS_SERVER_SERVER_METRICS_H_
#define SHARDPS_SERVER_SERVER_METRICS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace shardps::server {

struct CheckpointWrite;

class ServerMetrics {
 public:
  // Registers the shard's metrics in `registry`, which must outlive this.
  explicit ServerMetrics(prometheus::Registry& registry);

  // An accepted gradient chunk of `bytes` payload bytes, `fp32_bytes` as
  // fp32.
  void Pushed(uint64_t bytes, uint64_t fp32_bytes) {
    pushes_.Increment();
    received_bytes_.Increment(static_cast<double>(bytes));
    received_fp32_bytes_.Increment(static_cast<double>(fp32_bytes));
  }
  // A weights chunk of `bytes` payload bytes (`fp32_bytes` as fp32) handed
  // to the transport (PushPull or Pull).
  void Sent(uint64_t bytes, uint64_t fp32_bytes) {
    sent_bytes_.Increment(static_cast<double>(bytes));
    sent_fp32_bytes_.Increment(static_cast<double>(fp32_bytes));
  }
  // A chunk read by Pull.
  void Pulled() { pulls_.Increment(); }
  // A push or pull refused with `status` (not OK).
  void Rejected(const absl::Status& status);
  // Sync: a chunk's update applied `waited` after its step's first push.
  void StepDone(absl::Duration waited) {
    step_seconds_.Observe(Seconds(waited));
  }
  // A two-phase step's speculative update of a chunk, kept or (the step
  // clipped or skipped) recomputed.
  void Speculated(bool kept) {
    (kept ? speculation_kept_ : speculation_recomputed_).Increment();
  }
  // One reduce plus optimizer update of a chunk.
  void Aggregated(absl::Duration took) {
    aggregation_seconds_.Observe(Seconds(took));
  }
  // Async and ssp: how many steps the pushing worker is behind the most
  // advanced one.
  void Staleness(int64_t steps) {
    staleness_steps_.Observe(static_cast<double>(steps));
  }
  // A checkpoint write finished (or failed, or was skipped).
  void CheckpointDone(const absl::StatusOr<CheckpointWrite>& write);
  // The shard started from the checkpoint of `step`.
  void Restored(int64_t step) { last_committed_step_.Set(step); }

  // Gauges a scrape hook refreshes from the store and the cluster view.
  prometheus::Gauge& step() { return step_; }
  prometheus::Gauge& generation() { return generation_; }
  prometheus::Gauge& live_workers() { return live_workers_; }
  // The receive budget: its bytes, the most it held, the reads that waited.
  prometheus::Gauge& receive_budget() { return receive_budget_; }
  prometheus::Gauge& receive_budget_peak() { return receive_budget_peak_; }
  prometheus::Gauge& receive_budget_waited() { return receive_budget_waited_; }

 private:
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Counter& pushes_;
  prometheus::Counter& pulls_;
  prometheus::Counter& received_bytes_;
  prometheus::Counter& received_fp32_bytes_;
  prometheus::Counter& sent_bytes_;
  prometheus::Counter& sent_fp32_bytes_;
  prometheus::Family<prometheus::Counter>& speculative_;
  prometheus::Counter& speculation_kept_;
  prometheus::Counter& speculation_recomputed_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& aggregation_seconds_;
  prometheus::Histogram& staleness_steps_;
  prometheus::Gauge& step_;
  prometheus::Gauge& generation_;
  prometheus::Gauge& live_workers_;
  prometheus::Gauge& receive_budget_;
  prometheus::Gauge& receive_budget_peak_;
  prometheus::Gauge& receive_budget_waited_;
  prometheus::Histogram& checkpoint_seconds_;
  prometheus::Counter& checkpoint_bytes_;
  prometheus::Family<prometheus::Counter>& checkpoint_failures_;
  prometheus::Gauge& last_written_step_;
  prometheus::Gauge& last_committed_step_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SERVER_METRICS_H_
