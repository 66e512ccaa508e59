// The metrics of a coordinator (shardps_coordinator_*): members by role,
// generation, job progress, heartbeats and membership events. The gauges are
// set from the Membership at every scrape; the service and the daemon's event
// loop count the rest. Thread-safe.
#ifndef SHARDPS_COORDINATOR_COORDINATOR_METRICS_H_
#define SHARDPS_COORDINATOR_COORDINATOR_METRICS_H_

#include <memory>

#include "common/metrics.h"
#include "coordinator/membership.h"

namespace shardps::coordinator {

class CoordinatorMetrics {
 public:
  // Registers the metrics in the exporter's registry and reads `membership`
  // at every scrape. Both must outlive this.
  CoordinatorMetrics(MetricsExporter* exporter, const Membership* membership);

  // A Heartbeat or ReportProgress call (each renews a lease).
  void Heartbeat() { heartbeats_.Increment(); }
  // A membership change the daemon logged.
  void Event(const MembershipEvent& event);

 private:
  void Refresh(const Membership& membership);

  prometheus::Counter& heartbeats_;
  prometheus::Family<prometheus::Counter>& events_;
  prometheus::Family<prometheus::Gauge>& members_;
  prometheus::Gauge& servers_;
  prometheus::Gauge& workers_;
  prometheus::Gauge& finished_workers_;
  prometheus::Gauge& generation_;
  prometheus::Gauge& global_step_;
  prometheus::Gauge& epoch_;
  prometheus::Gauge& job_finished_;
  // Last: removed (waiting for a scrape in progress) before the rest goes.
  std::unique_ptr<ScrapeHook> hook_;
};

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_COORDINATOR_METRICS_H_
