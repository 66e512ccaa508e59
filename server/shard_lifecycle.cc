#include "server/shard_lifecycle.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/security.h"
#include "common/status.h"
#include "coordinator/client/cluster_view.h"
#include "coordinator/client/join_job.h"
#include "server/aggregator.h"
#include "server/checkpoint.h"

namespace shardps::server {
namespace {

using Logger = std::function<void(LogLevel, const std::string&)>;

// How long a stopping shard lets RPCs in flight finish.
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);
// The same when it stops before it ever served.
constexpr absl::Duration kUnservedShutdownGrace = absl::Seconds(1);

void Emit(const Logger& log, LogLevel level, const std::string& line) {
  if (log) log(level, line);
}

// Sends the checkpoint writes and stall reports to the log (and to the
// shard's metrics when there are any); stalls also to `note_stall`.
void ReportTo(const Logger& log, ServerMetrics* metrics,
              std::function<void(const std::string&)> note_stall,
              ShardServerOptions* options) {
  options->on_checkpoint = [log,
                            metrics](const absl::StatusOr<CheckpointWrite>& w) {
    if (metrics != nullptr) metrics->CheckpointDone(w);
    if (!w.ok()) {
      Emit(log, LogLevel::kWarning,
           absl::StrCat("checkpoint: ", w.status().ToString()));
      return;
    }
    Emit(log, LogLevel::kInfo,
         absl::StrFormat(
             "checkpoint of step %d written: %.1f MiB in %.3f s (%.2f "
             "ms/MiB)%s",
             w->step, w->bytes / 1048576.0, w->seconds,
             1000 * w->seconds / std::max(1e-9, w->bytes / 1048576.0),
             w->committed ? "; committed (all shards written)" : ""));
  };
  options->on_stall = [log,
                       note = std::move(note_stall)](const std::string& what) {
    if (!what.empty()) Emit(log, LogLevel::kWarning, what);
    if (note) note(what);
  };
  if (metrics != nullptr) {
    options->store.metrics = metrics;
    options->service.metrics = metrics;
  }
}

// Sets the shard's gauges at every scrape: its step, and the generation and
// live workers of the coordinator's view (`client`; null in static mode).
std::unique_ptr<ScrapeHook> WatchShard(
    MetricsExporter* exporter, ServerMetrics* shard, ShardServer* server,
    const coordinator::CoordinatorClient* client) {
  if (exporter == nullptr) return nullptr;
  if (server->restored().has_value()) shard->Restored(server->restored()->step);
  return exporter->OnScrape([shard, server, client] {
    const v1::GetStatusResponse status = server->store()->Report();
    shard->step().Set(static_cast<double>(status.min_version()));
    shard->receive_budget().Set(
        static_cast<double>(status.receive_budget_bytes()));
    shard->receive_budget_peak().Set(
        static_cast<double>(status.receive_budget_peak_bytes()));
    shard->receive_budget_waited().Set(
        static_cast<double>(status.receive_budget_waits_total()));
    if (client == nullptr) {
      shard->generation().Set(static_cast<double>(status.generation()));
      shard->live_workers().Set(status.num_workers());
      return;
    }
    const v1::ClusterView view = client->view();
    shard->generation().Set(static_cast<double>(view.generation()));
    shard->live_workers().Set(static_cast<double>(
        std::count_if(view.workers().begin(), view.workers().end(),
                      [](const v1::WorkerSlot& w) { return w.alive(); })));
  });
}

// Where the shard started from.
void LogRestore(const Logger& log, const ShardServer& server,
                const std::string& checkpoint_dir) {
  if (!server.restored().has_value()) return;
  const RestoredShard& r = *server.restored();
  for (const std::string& why : r.skipped) {
    Emit(log, LogLevel::kWarning, absl::StrCat("checkpoint skipped: ", why));
  }
  Emit(log, LogLevel::kInfo,
       absl::StrCat("restored from the checkpoint of step ", r.step, " in ",
                    checkpoint_dir));
}

// Stops serving and logs the counters.
void Stop(const Logger& log, ShardServer* server) {
  server->Shutdown(kShutdownGrace);
  const v1::GetStatusResponse status = server->store()->Report();
  Emit(log, LogLevel::kInfo,
       absl::StrCat("stopped after ", status.pushes_total(), " pushes, ",
                    status.updates_total(), " updates, ",
                    status.rejected_total(), " rejected"));
  const ReceiveBudget& budget = server->store()->budget();
  if (budget.limit() > 0) {
    Emit(log, LogLevel::kInfo,
         absl::StrFormat("receive budget %.2f MiB: at most %.2f MiB of "
                         "gradients held, %d reads waited for it",
                         budget.limit() / 1048576.0,
                         budget.usage().peak / 1048576.0,
                         budget.usage().waited));
  }
  const uint64_t kept = status.speculative_updates_kept_total();
  const uint64_t recomputed = status.speculative_updates_recomputed_total();
  if (kept + recomputed > 0) {
    Emit(log, LogLevel::kInfo,
         absl::StrCat("speculative weights: ", kept, " chunk updates kept, ",
                      recomputed, " recomputed (the step clipped or skipped)"));
  }
}

std::unique_ptr<ServerMetrics> MakeMetrics(MetricsExporter* exporter) {
  if (exporter == nullptr) return nullptr;
  return std::make_unique<ServerMetrics>(exporter->registry());
}

absl::Status CheckHooks(const ShardLifecycleOptions& options) {
  if (!options.wait_for_signal) {
    return absl::InvalidArgumentError("the shard needs a wait_for_signal hook");
  }
  return absl::OkStatus();
}

absl::Status RunStatic(ShardLifecycleOptions options) {
  SHARDPS_RETURN_IF_ERROR(CheckHooks(options));
  const Logger& log = options.log;
  std::unique_ptr<ServerMetrics> metrics = MakeMetrics(options.metrics);
  ReportTo(log, metrics.get(), nullptr, &options.server);
  const ShardServerOptions& o = options.server;
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<ShardServer> server,
                           ShardServer::Start(o));
  const std::unique_ptr<ScrapeHook> hook =
      WatchShard(options.metrics, metrics.get(), server.get(), nullptr);
  LogRestore(log, *server, o.checkpoint_dir);
  Emit(log, LogLevel::kInfo,
       absl::StrFormat("shard %d of %d listening on %s:%d (mode=%s, "
                       "workers=%d)",
                       o.store.shard_index, o.store.num_shards, o.host,
                       server->port(),
                       ConsistencyName(o.store.mode, o.store.staleness),
                       o.store.num_workers));
  Emit(log, LogLevel::kInfo,
       absl::StrCat("security: ", DescribeServerSecurity(o.security)));
  if (options.on_listening) {
    SHARDPS_RETURN_IF_ERROR(options.on_listening(server->port()));
  }
  const int sig = options.wait_for_signal(absl::InfiniteDuration());
  Emit(log, LogLevel::kInfo, absl::StrCat("signal ", sig, ": shutting down"));
  Stop(log, server.get());
  return absl::OkStatus();
}

// The host workers use to reach a shard listening on `host`.
std::string AdvertiseHost(const std::string& given, const std::string& host) {
  if (!given.empty()) return given;
  if (host != "0.0.0.0" && host != "::" && host != "[::]") return host;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

absl::Status RunCoordinated(ShardLifecycleOptions options) {
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<CoordinatedShard> shard,
                           CoordinatedShard::Listen(options));
  const Logger& log = options.log;
  const absl::Status joined = shard->Join();
  if (shard->stop_signal() != 0) {
    Emit(log, LogLevel::kInfo,
         absl::StrCat("signal ", shard->stop_signal(),
                      " while joining: shutting down"));
    shard->server()->Shutdown(kUnservedShutdownGrace);
    return absl::OkStatus();
  }
  SHARDPS_RETURN_IF_ERROR(joined);
  const absl::Status status = options.on_listening
                                  ? options.on_listening(shard->port())
                                  : absl::OkStatus();
  const bool finished = status.ok() && shard->ServeUntilEnd();
  if (finished) {
    Emit(log, LogLevel::kInfo,
         absl::StrCat("job ", options.job_id,
                      " finished: training completed; exiting"));
  }
  shard->LeaveAndStop(finished);
  return status;
}

}  // namespace

absl::Status RunShard(ShardLifecycleOptions options) {
  if (options.coordinator.empty()) return RunStatic(std::move(options));
  return RunCoordinated(std::move(options));
}

CoordinatedShard::CoordinatedShard(ShardLifecycleOptions options)
    : options_(std::move(options)) {}

CoordinatedShard::~CoordinatedShard() = default;

void CoordinatedShard::Log(LogLevel level, const std::string& line) const {
  Emit(options_.log, level, line);
}

absl::StatusOr<std::unique_ptr<CoordinatedShard>> CoordinatedShard::Listen(
    ShardLifecycleOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError(
        "a coordinated shard needs the coordinator's address");
  }
  SHARDPS_RETURN_IF_ERROR(CheckHooks(options));
  std::unique_ptr<CoordinatedShard> shard(
      new CoordinatedShard(std::move(options)));
  CoordinatedShard* const self = shard.get();
  ShardServerOptions& o = shard->options_.server;
  shard->metrics_ = MakeMetrics(shard->options_.metrics);
  ReportTo(
      shard->options_.log, shard->metrics_.get(),
      [self](const std::string& what) { self->NoteStall(what); }, &o);
  SHARDPS_ASSIGN_OR_RETURN(shard->server_, ShardServer::Listen(o));
  shard->server_->SetWaiting("waiting for the coordinator's shard map");
  shard->address_ =
      absl::StrCat(AdvertiseHost(shard->options_.advertise_host, o.host), ":",
                   shard->server_->port());
  // The newest committed checkpoint now is the one the shard restores:
  // announced when joining, loaded after (and verified once, here).
  if (!o.checkpoint_dir.empty() && std::filesystem::exists(o.checkpoint_dir)) {
    absl::StatusOr<CheckpointInfo> latest = LatestCommitted(o.checkpoint_dir);
    if (latest.ok()) o.restore_from = *std::move(latest);
  }
  return shard;
}

absl::Status CoordinatedShard::Join() {
  ShardServerOptions& o = options_.server;
  coordinator::JoinOptions join;
  join.client.coordinator = options_.coordinator;
  join.client.security = o.security;
  // The shard starts from this checkpoint: say so when joining, so that a
  // restart rolls the job back to it.
  join.client.restored_step =
      o.restore_from.has_value() ? o.restore_from->step : -1;
  // Signals are taken synchronously: look for one between attempts.
  join.client.cancelled = [this] {
    if (stop_signal_ == 0) {
      stop_signal_ = options_.wait_for_signal(absl::ZeroDuration());
    }
    return stop_signal_ != 0;
  };
  join.role = v1::ROLE_SERVER;
  join.address = address_;
  join.requested_index = options_.requested_index;
  join.job_id = options_.job_id;
  join.timeout = options_.join_timeout;
  join.on_retry = [this](const std::string& line) {
    Log(LogLevel::kInfo, line);
  };
  Log(LogLevel::kInfo,
      absl::StrCat("joining job ", options_.job_id, " at coordinator ",
                   options_.coordinator, " as ", address_, ", shard index ",
                   options_.requested_index < 0
                       ? "any"
                       : absl::StrCat(options_.requested_index)));
  SHARDPS_ASSIGN_OR_RETURN(client_, coordinator::JoinJob(std::move(join)));
  if (options_.on_joined) options_.on_joined(client_->index());
  absl::Status installed = AdoptJobShape();
  if (installed.ok()) installed = server_->Install(o, /*serve=*/false);
  if (!installed.ok()) {
    client_->Leave(absl::Now() + options_.leave_timeout).IgnoreError();
    return installed;
  }
  hook_ = WatchShard(options_.metrics, metrics_.get(), server_.get(),
                     client_.get());
  LogRestore(options_.log, *server_, o.checkpoint_dir);
  Log(LogLevel::kInfo,
      absl::StrFormat(
          "shard %d of %d listening on %s:%d, advertised as %s "
          "(mode=%s, workers=%d); %s",
          o.store.shard_index, o.store.num_shards, o.host, server_->port(),
          address_, ConsistencyName(o.store.mode, o.store.staleness),
          o.store.num_workers, coordinator::DescribeView(client_->view())));
  Log(LogLevel::kInfo,
      absl::StrCat("security: ", DescribeServerSecurity(o.security)));
  return absl::OkStatus();
}

absl::Status CoordinatedShard::AdoptJobShape() {
  const v1::ClusterView view = client_->view();
  const std::optional<uint32_t>& shards = options_.num_shards;
  const std::optional<uint32_t>& workers = options_.num_workers;
  if (shards.has_value() && *shards != view.num_shards()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--num_shards=", *shards, " but job ", view.job_id(),
                     " has ", view.num_shards(), " shards"));
  }
  if (workers.has_value() && *workers != view.num_workers()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--num_workers=", *workers, " but job ", view.job_id(),
                     " has ", view.num_workers(), " workers"));
  }
  StoreOptions& store = options_.server.store;
  store.shard_index = client_->index();
  store.num_shards = view.num_shards();
  store.num_workers = view.num_workers();
  return ValidateStoreOptions(store);
}

void CoordinatedShard::ApplyView(const v1::ClusterView& view) {
  for (const std::string& change : server_->store()->ApplyView(view)) {
    Log(LogLevel::kInfo, change);
  }
}

void CoordinatedShard::MaybeRollBack(const v1::ClusterView& view) {
  if (view.rollback_id() <= applied_rollback_) return;
  const absl::Time start = absl::Now();
  const absl::Status s =
      server_->RollBack(view.rollback_id(), view.rollback_step());
  if (!s.ok()) {
    // Once per distinct failure: it is tried again at every look.
    if (s.ToString() != rollback_error_) {
      Log(LogLevel::kError, absl::StrCat("rollback ", view.rollback_id(),
                                         " to step ", view.rollback_step(),
                                         " failed (retrying): ", s.ToString()));
      rollback_error_ = s.ToString();
    }
    return;
  }
  applied_rollback_ = view.rollback_id();
  rollback_error_.clear();
  Log(LogLevel::kInfo, absl::StrCat("rollback ", view.rollback_id(),
                                    ": shard reset to the checkpoint of step ",
                                    view.rollback_step(), " in ",
                                    absl::FormatDuration(absl::Now() - start)));
}

void CoordinatedShard::NoteStall(const std::string& what) {
  absl::MutexLock lock(&stall_mu_);
  stall_note_ = what;
}

void CoordinatedShard::Serve() {
  const v1::ClusterView view = client_->view();
  generation_ = view.generation();
  coordinator_incarnation_ = view.coordinator_incarnation();
  ApplyView(view);
  MaybeRollBack(view);
  // Served once it follows the view: the ranks it waits for and any
  // rollback its own restart started are in place.
  server_->Serve();
}

bool CoordinatedShard::Follow() {
  const v1::ClusterView view = client_->view();
  if (view.generation() != generation_ ||
      view.coordinator_incarnation() != coordinator_incarnation_) {
    generation_ = view.generation();
    coordinator_incarnation_ = view.coordinator_incarnation();
    Log(LogLevel::kInfo, coordinator::DescribeView(view));
    ApplyView(view);
  }
  MaybeRollBack(view);
  std::string stalled;
  {
    absl::MutexLock lock(&stall_mu_);
    stalled = stall_note_;
  }
  // Outside the lock: the client takes its own.
  if (stalled != stall_sent_) {
    stall_sent_ = stalled;
    client_->SetStalled(stalled);
  }
  const absl::Status now = client_->health();
  if (now != health_) {
    if (now.ok()) {
      Log(LogLevel::kInfo, absl::StrCat("coordinator ", options_.coordinator,
                                        " reachable again"));
    } else {
      Log(LogLevel::kWarning, now.ToString());
    }
    health_ = now;
  }
  if (client_->rejoins() != rejoins_) {
    rejoins_ = client_->rejoins();
    Log(LogLevel::kWarning,
        absl::StrCat("the coordinator had lost this shard: joined again as "
                     "shard ",
                     client_->index()));
  }
  return client_->job_finished();
}

bool CoordinatedShard::ServeUntilEnd() {
  Serve();
  while (true) {
    const int sig = options_.wait_for_signal(options_.view_check_interval);
    if (sig != 0) {
      stop_signal_ = sig;
      Log(LogLevel::kInfo,
          absl::StrCat("signal ", sig, ": leaving the job and shutting down"));
      return false;
    }
    if (Follow()) return true;
  }
}

void CoordinatedShard::LeaveAndStop(bool finished) {
  const absl::Status left =
      client_->Leave(absl::Now() + options_.leave_timeout);
  // After the job's end the coordinator may be gone already.
  if (!left.ok() && !finished) Log(LogLevel::kWarning, left.ToString());
  Stop(options_.log, server_.get());
}

}  // namespace shardps::server
