#include "common/metrics.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

namespace shardps {

// What the HTTP server collects: the registry, after the scrape hooks have
// brought its gauges up to date.
class MetricsExporter::Collector : public prometheus::Collectable {
 public:
  explicit Collector(MetricsExporter* exporter) : exporter_(exporter) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    exporter_->RunHooks();
    return exporter_->registry_->Collect();
  }

 private:
  MetricsExporter* const exporter_;
};

namespace {

// civetweb takes numeric addresses only, IPv6 ones in brackets: resolve a
// name ("localhost", a pod's hostname) to its first address.
absl::StatusOr<std::string> NumericAddress(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host=", host, " does not resolve: ", gai_strerror(rc)));
  }
  char text[INET6_ADDRSTRLEN] = {};
  const bool v6 = found->ai_family == AF_INET6;
  const void* addr =
      v6 ? static_cast<const void*>(
               &reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr)
         : static_cast<const void*>(
               &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr);
  inet_ntop(found->ai_family, addr, text, sizeof(text));
  freeaddrinfo(found);
  return v6 ? absl::StrCat("[", text, "]") : std::string(text);
}

}  // namespace

ScrapeHook::~ScrapeHook() { exporter_->RemoveHook(id_); }

MetricsExporter::MetricsExporter()
    : registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<Collector>(this)) {}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Serve(
    const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port=", port, " is outside [0, 65535]"));
  }
  absl::StatusOr<std::string> numeric = NumericAddress(host);
  if (!numeric.ok()) return numeric.status();
  const std::string address = absl::StrCat(*numeric, ":", port);
  auto exporter = std::make_unique<MetricsExporter>();
  try {
    // Two HTTP threads: a scrape and a probe at once.
    exporter->exposer_ = std::make_unique<prometheus::Exposer>(address, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_port=", port, ": cannot serve metrics on ",
                     address, " (is the port in use?): ", e.what()));
  }
  const std::vector<int> ports = exporter->exposer_->GetListeningPorts();
  if (ports.empty() || ports.front() <= 0) {
    return absl::UnavailableError(absl::StrCat(
        "--metrics_port=", port, ": no listening port on ", address));
  }
  exporter->port_ = ports.front();
  exporter->exposer_->RegisterCollectable(exporter->collector_);
  return exporter;
}

MetricsExporter::~MetricsExporter() {
  exposer_.reset();  // no scrape runs past this point
}

std::unique_ptr<ScrapeHook> MetricsExporter::OnScrape(
    std::function<void()> refresh) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_hook_++;
  hooks_.emplace(id, std::move(refresh));
  return std::unique_ptr<ScrapeHook>(new ScrapeHook(this, id));
}

void MetricsExporter::RunHooks() {
  // Held while the hooks run, so that a hook being destroyed waits for them
  // (the hooks only set gauges and take no lock of ours).
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [id, refresh] : hooks_) refresh();
}

void MetricsExporter::RemoveHook(uint64_t id) {
  absl::MutexLock lock(&mu_);
  hooks_.erase(id);
}

std::string MetricsExporter::Scrape() {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

prometheus::Counter& AddCounter(prometheus::Registry& r,
                                const std::string& name,
                                const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}

prometheus::Gauge& AddGauge(prometheus::Registry& r, const std::string& name,
                            const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
}

prometheus::Histogram& AddHistogram(
    prometheus::Registry& r, const std::string& name, const std::string& help,
    const prometheus::Histogram::BucketBoundaries& buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add(
      {}, buckets);
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
          0.01,    0.025,  0.05,    0.1,    0.25,  0.5,    1,
          2.5,     5,      10,      30,     60};
}

prometheus::Histogram::BucketBoundaries CountBuckets() {
  return {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
}

}  // namespace shardps
