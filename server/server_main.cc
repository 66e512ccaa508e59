// shardps-server: one parameter shard. Static mode: --shard_index,
// --num_shards and --num_workers on the command line. With --coordinator it
// joins the job there, takes its shard index and the job's shape from the
// coordinator, and exits 0 by itself once every worker has finished.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security_flags.h"
#include "common/signal_wait.h"
#include "common/status.h"
#include "server/checkpoint.h"
#include "server/coordinator/coordinator_client.h"
#include "server/coordinator/coordinator_protocol.h"
#include "server/coordinator/member_flags.h"
#include "server/server_metrics.h"
#include "server/shard_server.h"

ABSL_FLAG(int32_t, shard_index, -1,
          "This shard's index in [0, num_shards); -1: any free one (with "
          "--coordinator), else 0.");
ABSL_FLAG(std::optional<uint32_t>, num_shards, std::nullopt,
          "Number of parameter shards in the job; unset: the coordinator's "
          "--num_servers, else 1.");
ABSL_FLAG(std::optional<uint32_t>, num_workers, std::nullopt,
          "Number of workers; sync steps wait for all of them. Unset: the "
          "coordinator's --num_workers, else 1.");
ABSL_FLAG(std::string, mode, "sync",
          "Consistency: sync (every step waits for every worker), async "
          "(pushes applied on arrival) or ssp:K (applied on arrival, but no "
          "worker gets more than K steps ahead of the slowest).");
ABSL_FLAG(bool, allow_nonfinite, false,
          "Accept gradients holding NaN or infinity (rejected by default).");
ABSL_FLAG(int32_t, update_threads, 2,
          "Threads running optimizer updates in parallel across chunks.");
ABSL_FLAG(int32_t, max_message_bytes, 0,
          "Largest gRPC message accepted; 0: 64 MiB plus 64 KiB.");
ABSL_FLAG(int64_t, fault_drop_reply_every, 0,
          "Testing only: drop every Nth PushPull reply and end its stream "
          "with UNAVAILABLE.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory (shared by every shard of the job) for checkpoints; the "
          "newest committed one there is restored at start. Empty: none.");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "Write a checkpoint every N steps (0: never; needs "
          "--checkpoint_dir).");
ABSL_FLAG(int32_t, keep_checkpoints, 3, "Committed checkpoints to keep.");
ABSL_FLAG(int32_t, step_timeout_s, 60,
          "Log which workers and chunks a sync step waits for once it has "
          "waited this long (0: never).");
ABSL_FLAG(std::string, advertise_host, "",
          "With --coordinator: the host workers reach this shard at; empty: "
          "--host, or this machine's hostname when --host is a wildcard.");
ABSL_FLAG(int32_t, join_timeout_s, 120,
          "With --coordinator: how long to keep trying to join the job.");

namespace shardps::server {
namespace {

// How often the main thread looks at the cluster view between signals.
constexpr absl::Duration kViewCheckInterval = absl::Milliseconds(100);
// Leaving is a courtesy (the lease would expire anyway): do not hang on it.
constexpr absl::Duration kLeaveTimeout = absl::Seconds(1);

// The watchdog's last report, for the coordinator's status (empty: no step
// is stalled).
ABSL_CONST_INIT absl::Mutex stall_mu(absl::kConstInit);
std::string& StallNote() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stall_mu) {
  static std::string* note = new std::string();
  return *note;
}

absl::StatusOr<ShardServerOptions> OptionsFromFlags() {
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  SHARDPS_RETURN_IF_ERROR(coordinator::CheckMemberFlags());
  ShardServerOptions o;
  SHARDPS_ASSIGN_OR_RETURN(o.security, ServerSecurityOptionsFromFlags());
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  const int32_t index = absl::GetFlag(FLAGS_shard_index);
  if (index < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_index=", index, " must be -1 (any) or at least 0"));
  }
  // In static mode the defaults are a one-shard, one-worker job; with a
  // coordinator, AdoptJobShape fills in what the flags leave open.
  o.store.shard_index = static_cast<uint32_t>(std::max(index, 0));
  o.store.num_shards = absl::GetFlag(FLAGS_num_shards).value_or(1);
  o.store.num_workers = absl::GetFlag(FLAGS_num_workers).value_or(1);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "sync") {
    o.store.mode = Mode::kSync;
  } else if (mode == "async") {
    o.store.mode = Mode::kAsync;
  } else if (absl::StartsWith(mode, "ssp:") &&
             absl::SimpleAtoi(mode.substr(4), &o.store.staleness) &&
             o.store.staleness >= 0) {
    o.store.mode = Mode::kSsp;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode=", mode, " is not one of: sync, async, ssp:K (K >= 0)"));
  }
  o.store.allow_nonfinite = absl::GetFlag(FLAGS_allow_nonfinite);
  o.store.update_threads = absl::GetFlag(FLAGS_update_threads);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (o.max_message_bytes < 0) {
    return absl::InvalidArgumentError("--max_message_bytes is negative");
  }
  o.service.drop_reply_every = absl::GetFlag(FLAGS_fault_drop_reply_every);
  o.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  o.on_stall = [](const std::string& what) {
    if (!what.empty()) LogWarning("%s", what);
    absl::MutexLock lock(&stall_mu);
    StallNote() = what;
  };
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every_steps);
  o.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  if (o.checkpoint_every != 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint_every_steps needs --checkpoint_dir");
  }
  o.on_checkpoint = [](const absl::StatusOr<CheckpointWrite>& w) {
    if (!w.ok()) {
      LogWarning("checkpoint: %s", w.status().ToString());
      return;
    }
    LogInfo("checkpoint of step %d written: %.1f MiB in %.3f s (%.2f ms/MiB)%s",
            w->step, w->bytes / 1048576.0, w->seconds,
            1000 * w->seconds / std::max(1e-9, w->bytes / 1048576.0),
            w->committed ? "; committed (all shards written)" : "");
  };
  if (!coordinator::UseCoordinator())
    SHARDPS_RETURN_IF_ERROR(ValidateStoreOptions(o.store));
  return o;
}

// The shard's metrics when --metrics_port is set; both null otherwise.
struct Metrics {
  std::unique_ptr<MetricsExporter> exporter;
  std::unique_ptr<ServerMetrics> shard;
};

// Serves /metrics and hands the handles to the store, the service and the
// checkpoint report.
absl::StatusOr<Metrics> StartMetrics(ShardServerOptions* options) {
  Metrics m;
  SHARDPS_ASSIGN_OR_RETURN(m.exporter, ServeMetricsFromFlags());
  if (m.exporter == nullptr) return m;
  m.shard = std::make_unique<ServerMetrics>(m.exporter->registry());
  ServerMetrics* shard = m.shard.get();
  options->store.metrics = shard;
  options->service.metrics = shard;
  options->on_checkpoint = [shard, log = options->on_checkpoint](
                               const absl::StatusOr<CheckpointWrite>& w) {
    shard->CheckpointDone(w);
    log(w);
  };
  return m;
}

// Sets the shard's gauges at every scrape: its step, and the generation and
// live workers of the coordinator's view (`client`; null in static mode).
std::unique_ptr<ScrapeHook> WatchShard(
    const Metrics& m, ShardServer* server,
    const coordinator::CoordinatorClient* client) {
  if (m.exporter == nullptr) return nullptr;
  if (server->restored().has_value())
    m.shard->Restored(server->restored()->step);
  ServerMetrics* shard = m.shard.get();
  return m.exporter->OnScrape([shard, server, client] {
    const v1::GetStatusResponse status = server->store()->Report();
    shard->step().Set(static_cast<double>(status.min_version()));
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

// Logs where the shard started from.
void LogRestore(const ShardServer& server) {
  if (!server.restored().has_value()) return;
  const RestoredShard& r = *server.restored();
  for (const std::string& why : r.skipped) {
    LogWarning("checkpoint skipped: %s", why);
  }
  LogInfo("restored from the checkpoint of step %d in %s", r.step,
          absl::GetFlag(FLAGS_checkpoint_dir));
}

// Logs the counters and stops serving.
void Stop(ShardServer* server) {
  server->Shutdown(absl::Seconds(2));
  v1::GetStatusResponse status = server->store()->Report();
  LogInfo("stopped after %d pushes, %d updates, %d rejected",
          status.pushes_total(), status.updates_total(),
          status.rejected_total());
}

absl::Status RunStatic(ShardServerOptions options) {
  InitLog("server", static_cast<int>(options.store.shard_index),
          absl::GetFlag(FLAGS_log_format) == "json");
  SHARDPS_ASSIGN_OR_RETURN(Metrics metrics, StartMetrics(&options));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<ShardServer> server,
                           ShardServer::Start(options));
  const std::unique_ptr<ScrapeHook> hook =
      WatchShard(metrics, server.get(), nullptr);
  LogRestore(*server);
  LogInfo("shard %d of %d listening on %s:%d (mode=%s, workers=%d)",
          options.store.shard_index, options.store.num_shards, options.host,
          server->port(), absl::GetFlag(FLAGS_mode), options.store.num_workers);
  LogInfo("security: %s", DescribeServerSecurity(options.security));
  SHARDPS_RETURN_IF_ERROR(
      WritePortFile(absl::GetFlag(FLAGS_port_file), server->port()));
  const int sig = WaitForTerminationSignal();
  LogInfo("signal %d: shutting down", sig);
  Stop(server.get());
  return absl::OkStatus();
}

// The host workers use to reach this shard.
std::string AdvertiseHost(const std::string& host) {
  const std::string given = absl::GetFlag(FLAGS_advertise_host);
  if (!given.empty()) return given;
  if (host != "0.0.0.0" && host != "::" && host != "[::]") return host;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

// Takes the shard index and the job's shape from the coordinator's answer;
// a shape given on the command line must agree with it.
absl::Status AdoptJobShape(const coordinator::CoordinatorClient& client,
                           StoreOptions* store) {
  const v1::ClusterView view = client.view();
  const std::optional<uint32_t> shards = absl::GetFlag(FLAGS_num_shards);
  const std::optional<uint32_t> workers = absl::GetFlag(FLAGS_num_workers);
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
  store->shard_index = client.index();
  store->num_shards = view.num_shards();
  store->num_workers = view.num_workers();
  return ValidateStoreOptions(*store);
}

// Serves the shard the coordinator assigned on the listening `server`.
absl::Status InstallJoinedShard(const coordinator::CoordinatorClient& client,
                                ShardServerOptions* options,
                                ShardServer* server) {
  SHARDPS_RETURN_IF_ERROR(AdoptJobShape(client, &options->store));
  return server->Install(*options, /*serve=*/false);
}

// Hands `view` to the store (which ranks sync steps wait for) and logs
// what changed.
void ApplyView(const v1::ClusterView& view, ParameterStore* store) {
  for (const std::string& change : store->ApplyView(view)) {
    LogInfo("%s", change);
  }
}

// Applies a rollback of `view` newer than *applied (see
// ClusterView.rollback_id); a failed one is tried again at the next call.
void MaybeRollBack(const v1::ClusterView& view, ShardServer* server,
                   uint64_t* applied, std::string* last_error) {
  if (view.rollback_id() <= *applied) return;
  const absl::Time start = absl::Now();
  const absl::Status s =
      server->RollBack(view.rollback_id(), view.rollback_step());
  if (!s.ok()) {
    if (s.ToString() != *last_error) {
      LogError("rollback %d to step %d failed (retrying): %s",
               view.rollback_id(), view.rollback_step(), s.ToString());
      *last_error = s.ToString();
    }
    return;
  }
  *applied = view.rollback_id();
  last_error->clear();
  LogInfo("rollback %d: shard reset to the checkpoint of step %d in %s",
          view.rollback_id(), view.rollback_step(),
          absl::FormatDuration(absl::Now() - start));
}

// Waits for SIGINT or SIGTERM, or for the job to finish (true), logging
// every generation this shard sees and changes of the coordinator link, and
// keeping the store's membership and the coordinator's stall report current.
bool ServeUntilEnd(coordinator::CoordinatorClient* client,
                   ShardServer* server) {
  ParameterStore* store = server->store();
  v1::ClusterView view = client->view();
  uint64_t generation = view.generation();
  uint64_t coordinator = view.coordinator_incarnation();
  ApplyView(view, store);
  uint64_t rollback = 0;
  std::string rollback_error;
  MaybeRollBack(view, server, &rollback, &rollback_error);
  // Served once it follows the view: the ranks it waits for and any
  // rollback its own restart started are in place.
  server->Serve();
  absl::Status health;
  int64_t rejoins = 0;
  std::string stalled;
  while (true) {
    const int sig = WaitForTerminationSignalFor(kViewCheckInterval);
    if (sig != 0) {
      LogInfo("signal %d: leaving the job and shutting down", sig);
      return false;
    }
    view = client->view();
    if (view.generation() != generation ||
        view.coordinator_incarnation() != coordinator) {
      generation = view.generation();
      coordinator = view.coordinator_incarnation();
      LogInfo("%s", coordinator::DescribeView(view));
      ApplyView(view, store);
    }
    MaybeRollBack(view, server, &rollback, &rollback_error);
    {
      absl::MutexLock lock(&stall_mu);
      if (StallNote() != stalled) {
        stalled = StallNote();
        client->SetStalled(stalled);
      }
    }
    const absl::Status now = client->health();
    if (now != health) {
      if (now.ok()) {
        LogInfo("coordinator %s reachable again",
                absl::GetFlag(FLAGS_coordinator));
      } else {
        LogWarning("%s", now.ToString());
      }
      health = now;
    }
    if (client->rejoins() != rejoins) {
      rejoins = client->rejoins();
      LogWarning(
          "the coordinator had lost this shard: joined again as shard %d",
          client->index());
    }
    if (client->job_finished()) return true;
  }
}

// Joins the job as a server reachable at `address`. Stops early with
// Cancelled, setting *stop_signal, when SIGINT or SIGTERM arrives first.
absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> JoinJob(
    const std::string& address, const SecurityOptions& security,
    int64_t restore_step, int* stop_signal) {
  const int32_t requested = absl::GetFlag(FLAGS_shard_index);
  coordinator::CoordinatorClientOptions co;
  co.coordinator = absl::GetFlag(FLAGS_coordinator);
  co.security = security;
  co.on_retry = [](const absl::Status& reason, absl::Duration wait) {
    LogInfo("not joined yet (%s); retrying in %s", reason.ToString(),
            absl::FormatDuration(wait));
  };
  // The shard starts from this checkpoint: say so when joining, so that a
  // restart rolls the job back to it.
  co.restored_step = restore_step;
  // Signals are taken synchronously: look for one between attempts.
  co.cancelled = [stop_signal] {
    if (*stop_signal == 0) {
      *stop_signal = WaitForTerminationSignalFor(absl::ZeroDuration());
    }
    return *stop_signal != 0;
  };
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<coordinator::CoordinatorClient> client,
      coordinator::CoordinatorClient::Create(co));
  const std::string job = absl::GetFlag(FLAGS_job_id);
  LogInfo("joining job %s at coordinator %s as %s, shard index %s", job,
          co.coordinator, address,
          requested < 0 ? "any" : absl::StrCat(requested));
  SHARDPS_RETURN_IF_ERROR(client->Join(
      v1::ROLE_SERVER, address, requested, job,
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s))));
  return client;
}

// The server binds its port before it can join (it advertises host:port),
// but the store it serves needs the shard index the join answers. So the
// gRPC server listens first, with health NOT_SERVING and the
// ParameterServer methods answering UNAVAILABLE ("waiting for the shard
// map", then "loading its checkpoint"), and installs the store once joined.
absl::Status RunCoordinated(ShardServerOptions options) {
  const bool json = absl::GetFlag(FLAGS_log_format) == "json";
  InitLog("server", absl::GetFlag(FLAGS_shard_index), json);
  SHARDPS_ASSIGN_OR_RETURN(Metrics metrics, StartMetrics(&options));
  absl::StatusOr<std::unique_ptr<ShardServer>> server =
      ShardServer::Listen(options);
  SHARDPS_RETURN_IF_ERROR(server.status());
  (*server)->SetWaiting("waiting for the coordinator's shard map");
  const std::string address =
      absl::StrCat(AdvertiseHost(options.host), ":", (*server)->port());
  // The newest committed checkpoint now is the one the shard restores
  // (announced when joining, loaded after).
  // (Verified once, here.)
  if (!options.checkpoint_dir.empty() &&
      std::filesystem::exists(options.checkpoint_dir)) {
    absl::StatusOr<CheckpointInfo> latest =
        LatestCommitted(options.checkpoint_dir);
    if (latest.ok()) options.restore_from = *std::move(latest);
  }
  int stop_signal = 0;
  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> joined =
      JoinJob(
          address, options.security,
          options.restore_from.has_value() ? options.restore_from->step : -1,
          &stop_signal);
  if (stop_signal != 0) {
    LogInfo("signal %d while joining: shutting down", stop_signal);
    (*server)->Shutdown(absl::Seconds(1));
    return absl::OkStatus();
  }
  SHARDPS_RETURN_IF_ERROR(joined.status());
  std::unique_ptr<coordinator::CoordinatorClient> client = *std::move(joined);
  const std::string job = absl::GetFlag(FLAGS_job_id);
  // Only this thread logs; the client's threads never do.
  InitLog("server", static_cast<int>(client->index()), json);
  const absl::Status installed =
      InstallJoinedShard(*client, &options, server->get());
  if (!installed.ok()) {
    client->Leave(absl::Now() + kLeaveTimeout).IgnoreError();
    return installed;
  }
  const std::unique_ptr<ScrapeHook> hook =
      WatchShard(metrics, server->get(), client.get());
  LogRestore(**server);
  LogInfo(
      "shard %d of %d listening on %s:%d, advertised as %s (mode=%s, "
      "workers=%d); %s",
      options.store.shard_index, options.store.num_shards, options.host,
      (*server)->port(), address, absl::GetFlag(FLAGS_mode),
      options.store.num_workers, coordinator::DescribeView(client->view()));
  LogInfo("security: %s", DescribeServerSecurity(options.security));
  const absl::Status status =
      WritePortFile(absl::GetFlag(FLAGS_port_file), (*server)->port());
  const bool finished =
      status.ok() && ServeUntilEnd(client.get(), server->get());
  if (finished) {
    LogInfo("job %s finished: training completed; exiting", job);
  }
  const absl::Status left = client->Leave(absl::Now() + kLeaveTimeout);
  // After the job's end the coordinator may be gone already.
  if (!left.ok() && !finished) LogWarning("%s", left.ToString());
  Stop(server->get());
  return status;
}

absl::Status Run() {
  SHARDPS_ASSIGN_OR_RETURN(ShardServerOptions options, OptionsFromFlags());
  if (coordinator::UseCoordinator()) return RunCoordinated(std::move(options));
  return RunStatic(std::move(options));
}

}  // namespace
}  // namespace shardps::server

int main(int argc, char** argv) {
  shardps::BlockTerminationSignals();
  shardps::ParseDaemonFlags(
      argc, argv,
      "serves one parameter shard of a shardps job.\n"
      "  shardps-server --shard_index=0 --num_shards=2 --num_workers=2 "
      "--port=0 --port_file=/tmp/s0.port\n"
      "  shardps-server --coordinator=127.0.0.1:7000 --port=0");
  return shardps::ExitCode(shardps::server::Run());
}
