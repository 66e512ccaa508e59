// shardps-coordinator: membership, generations and the cluster view of one
// job (proto/shardps/v1/coordinator.proto).
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/daemon_flags.h"
#include "common/grpc_server.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security_flags.h"
#include "common/signal_wait.h"
#include "common/status.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/membership.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"

ABSL_FLAG(std::string, job_id, "shardps",
          "Job this coordinator runs; joins naming another job are refused.");
ABSL_FLAG(uint32_t, num_servers, 1,
          "Parameter shards the job expects (shard indices 0..n-1).");
ABSL_FLAG(uint32_t, num_workers, 1, "Workers the job expects (ranks 0..n-1).");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 5000,
          "A member without a heartbeat for this long is expired.");
ABSL_FLAG(bool, exit_when_finished, true,
          "Exit 0 once every worker has finished (and the servers have left, "
          "or --finish_grace_ms passed), so a supervisor sees the job "
          "complete.");
ABSL_FLAG(int64_t, finish_grace_ms, 5000,
          "After the job finished: how long to wait for the servers to see it "
          "and leave before exiting anyway.");

namespace shardps::coordinator {
namespace {

constexpr char kServiceName[] = "shardps.v1.Coordinator";

absl::StatusOr<MembershipOptions> OptionsFromFlags() {
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  MembershipOptions o;
  o.job_id = absl::GetFlag(FLAGS_job_id);
  o.num_servers = absl::GetFlag(FLAGS_num_servers);
  o.num_workers = absl::GetFlag(FLAGS_num_workers);
  o.heartbeat_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  if (absl::GetFlag(FLAGS_finish_grace_ms) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--finish_grace_ms=", absl::GetFlag(FLAGS_finish_grace_ms),
                     " is negative"));
  }
  std::random_device random;
  o.incarnation = (uint64_t{random()} << 32) | random();
  return o;
}

// Logs (and counts, when `metrics` is not null) membership events and
// expires silent members, on its own thread, until destroyed.
class MembershipTicker {
 public:
  MembershipTicker(Membership* membership, absl::Duration timeout,
                   CoordinatorMetrics* metrics)
      : membership_(membership),
        metrics_(metrics),
        // Expiry lags the timeout by at most a tenth of it (and 250 ms).
        tick_(std::clamp(timeout / 10, absl::Milliseconds(10),
                         absl::Milliseconds(250))),
        thread_([this] { Loop(); }) {}
  ~MembershipTicker() {
    stop_.Notify();
    thread_.join();
    LogEvents(absl::Now());  // the last ones
  }

 private:
  void Loop() {
    while (!stop_.HasBeenNotified()) {
      LogEvents(absl::Now() + tick_);
      membership_->Expire();
    }
  }
  void LogEvents(absl::Time deadline) {
    for (const MembershipEvent& e : membership_->AwaitEvents(deadline)) {
      if (metrics_ != nullptr) metrics_->Event(e);
      if (e.kind == MembershipEvent::Kind::kRejected) {
        LogWarning("%s", DescribeEvent(e));
      } else {
        LogInfo("%s", DescribeEvent(e));
      }
    }
  }

  Membership* const membership_;
  CoordinatorMetrics* const metrics_;
  const absl::Duration tick_;
  absl::Notification stop_;
  std::thread thread_;  // last: starts once the rest is built
};

// How often the main thread looks at the job while it waits for a signal.
constexpr absl::Duration kJobCheckInterval = absl::Milliseconds(100);

bool AnyServerAlive(const Membership& membership) {
  const v1::ClusterView view = membership.View();
  return std::any_of(view.servers().begin(), view.servers().end(),
                     [](const v1::ServerSlot& s) { return s.alive(); });
}

// Returns on SIGINT or SIGTERM, or (--exit_when_finished) once the job has
// finished and every server has left or the grace has passed: servers learn
// the end from this process, so it stays up until they had the chance.
void WaitForEnd(const Membership& membership) {
  const bool exit_when_finished = absl::GetFlag(FLAGS_exit_when_finished);
  while (true) {
    const int sig = WaitForTerminationSignalFor(kJobCheckInterval);
    if (sig != 0) {
      LogInfo("signal %d: shutting down", sig);
      return;
    }
    if (exit_when_finished && membership.job_finished()) break;
  }
  const absl::Duration grace =
      absl::Milliseconds(absl::GetFlag(FLAGS_finish_grace_ms));
  LogInfo(
      "every worker finished: exiting once the servers have left (at most "
      "%s)",
      absl::FormatDuration(grace));
  const absl::Time deadline = absl::Now() + grace;
  while (AnyServerAlive(membership) && absl::Now() < deadline) {
    const int sig = WaitForTerminationSignalFor(
        std::min(kJobCheckInterval, deadline - absl::Now()));
    if (sig != 0) {
      LogInfo("signal %d: shutting down", sig);
      return;
    }
  }
  if (AnyServerAlive(membership)) {
    LogWarning("servers still joined after %s: exiting anyway",
               absl::FormatDuration(grace));
  }
  LogInfo("job finished: shutting down");
}

absl::Status Run() {
  SHARDPS_ASSIGN_OR_RETURN(MembershipOptions options, OptionsFromFlags());
  SHARDPS_ASSIGN_OR_RETURN(SecurityOptions security,
                           ServerSecurityOptionsFromFlags());
  InitLog("coordinator", -1, absl::GetFlag(FLAGS_log_format) == "json");
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Membership> membership,
                           Membership::Create(options));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsExporter> exporter,
                           ServeMetricsFromFlags());
  std::unique_ptr<CoordinatorMetrics> metrics;
  if (exporter != nullptr) {
    metrics =
        std::make_unique<CoordinatorMetrics>(exporter.get(), membership.get());
  }
  // Declared before the server: it must outlive it.
  CoordinatorService service(membership.get(), metrics.get());
  GrpcServerOptions grpc_options;
  grpc_options.host = absl::GetFlag(FLAGS_host);
  grpc_options.port = absl::GetFlag(FLAGS_port);
  grpc_options.security = security;
  int port = 0;
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> server,
                           StartGrpcServer(grpc_options, {&service}, &port));
  server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  MembershipTicker ticker(membership.get(), options.heartbeat_timeout,
                          metrics.get());
  LogInfo(
      "job %s: coordinator listening on %s:%d (servers=%d, workers=%d, "
      "heartbeat timeout %d ms)",
      options.job_id, absl::GetFlag(FLAGS_host), port, options.num_servers,
      options.num_workers,
      absl::ToInt64Milliseconds(options.heartbeat_timeout));
  LogInfo("security: %s", DescribeServerSecurity(security));
  absl::Status status = WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  if (status.ok()) WaitForEnd(*membership);
  // Probes see NOT_SERVING from here on; watch streams end with UNAVAILABLE,
  // so the server need not wait for them.
  server->GetHealthCheckService()->Shutdown();
  service.Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->Wait();
  const v1::ClusterView view = membership->View();
  LogInfo("stopped at generation %d, global step %d, epoch %d",
          view.generation(), view.global_step(), view.epoch());
  return status;
}

}  // namespace
}  // namespace shardps::coordinator

int main(int argc, char** argv) {
  shardps::BlockTerminationSignals();
  shardps::ParseDaemonFlags(
      argc, argv,
      "tracks the membership of a shardps job: servers and workers join, "
      "heartbeat and watch the cluster view.\n"
      "  shardps-coordinator --job_id=mnist --num_servers=2 --num_workers=2 "
      "--port=0 --port_file=/tmp/coordinator.port");
  return shardps::ExitCode(shardps::coordinator::Run());
}
