// A daemon's Prometheus metrics: one registry per process, served as text at
// http://host:port/metrics by a small embedded HTTP server. Components take a
// struct of metric handles made from the registry; values that already live
// elsewhere (a generation, a step) are read by scrape hooks. Thread-safe.
#ifndef SHARDPS_COMMON_METRICS_H_
#define SHARDPS_COMMON_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace shardps {

class MetricsExporter;

// Runs a function before every scrape until destroyed; see
// MetricsExporter::OnScrape.
class ScrapeHook {
 public:
  ~ScrapeHook();
  ScrapeHook(const ScrapeHook&) = delete;
  ScrapeHook& operator=(const ScrapeHook&) = delete;

 private:
  friend class MetricsExporter;
  ScrapeHook(MetricsExporter* exporter, uint64_t id)
      : exporter_(exporter), id_(id) {}
  MetricsExporter* const exporter_;
  const uint64_t id_;
};

class MetricsExporter {
 public:
  // A registry that is not served: for tests and in-process use.
  MetricsExporter();
  // Serves the registry at http://host:port/metrics; port 0 lets the kernel
  // pick a free port (see port()). `host` may be a name, an IPv4 or an IPv6
  // address. Unavailable, naming --metrics_port, when the address cannot be
  // bound (the port is taken, the host is not local).
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Serve(
      const std::string& host, int port);
  ~MetricsExporter();
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  prometheus::Registry& registry() { return *registry_; }
  // The port /metrics is served on; 0 when not serving.
  int port() const { return port_; }

  // Runs `refresh` (which sets gauges from state kept elsewhere) at the start
  // of every scrape, on an HTTP thread, until the returned hook is destroyed.
  // Destroying the hook waits for a refresh in progress, so `refresh` may
  // use objects that outlive the hook. `refresh` must be thread-safe and
  // must not add or destroy hooks.
  std::unique_ptr<ScrapeHook> OnScrape(std::function<void()> refresh)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The exposition a scrape returns now (Prometheus text format 0.0.4).
  std::string Scrape() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class ScrapeHook;
  class Collector;
  void RunHooks() ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveHook(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Collector> collector_;
  absl::Mutex mu_;
  uint64_t next_hook_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
  int port_ = 0;
  // Last: its HTTP threads stop before the rest is destroyed.
  std::unique_ptr<prometheus::Exposer> exposer_;
};

// Histogram buckets (upper bounds) for latencies from 50 us to 60 s, about
// three per decade: step, compute and push times, aggregation, checkpoints.
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// One metric without labels, registered in `r` under `name`.
prometheus::Counter& AddCounter(prometheus::Registry& r,
                                const std::string& name,
                                const std::string& help);
prometheus::Gauge& AddGauge(prometheus::Registry& r, const std::string& name,
                            const std::string& help);
prometheus::Histogram& AddHistogram(
    prometheus::Registry& r, const std::string& name, const std::string& help,
    const prometheus::Histogram::BucketBoundaries& buckets);
// Buckets for small non-negative counts (staleness in steps): 0, 1, 2, 4,
// ... 1024.
prometheus::Histogram::BucketBoundaries CountBuckets();

// Seconds as a double, for Histogram::Observe.
inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace shardps

#endif  // SHARDPS_COMMON_METRICS_H_
