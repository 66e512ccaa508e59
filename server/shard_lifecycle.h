// A shard's life as shardps-server lives it. Static: serve until a stop
// signal. Coordinated: listen, join the job at the coordinator, adopt the
// job's shape, restore, follow the cluster view (ranks, rollbacks, stall
// reports) until the job finishes or a signal says stop, leave. Runs on the
// calling thread; reports what happens through ShardLifecycleOptions::log
// and never logs itself.
#ifndef SHARDPS_SERVER_SHARD_LIFECYCLE_H_
#define SHARDPS_SERVER_SHARD_LIFECYCLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/metrics.h"
#include "coordinator/client/coordinator_client.h"
#include "coordinator/coordinator_protocol.h"
#include "server/server_metrics.h"
#include "server/shard_server.h"

namespace shardps::server {

struct ShardLifecycleOptions {
  // The shard. Static mode serves server.store's shape; coordinated mode
  // fills shard_index, num_shards and num_workers in from the job. Its
  // on_stall and on_checkpoint are replaced (they go to `log`).
  ShardServerOptions server;

  // Coordinated mode: the coordinator's host:port (empty: static mode).
  std::string coordinator;
  std::string job_id;
  int32_t requested_index = coordinator::kAnyIndex;
  // The command line's shape, which must agree with the job's; unset: take
  // the job's.
  std::optional<uint32_t> num_shards;
  std::optional<uint32_t> num_workers;
  // The host workers reach this shard at; empty: server.host, or this
  // machine's hostname when server.host is a wildcard.
  std::string advertise_host;
  absl::Duration join_timeout = absl::Minutes(2);
  // How often the view is looked at between signals.
  absl::Duration view_check_interval = absl::Milliseconds(100);
  // Leaving is a courtesy (the lease would expire anyway): not longer.
  absl::Duration leave_timeout = absl::Seconds(1);

  // Serves the shard's metrics when not null; borrowed, must outlive the run.
  MetricsExporter* metrics = nullptr;

  // Waits up to its argument (possibly absl::InfiniteDuration()) for a
  // request to stop and returns a nonzero number naming it (the signal), or
  // 0 when none came in time. Required.
  std::function<int(absl::Duration)> wait_for_signal;
  // Told every event worth a log line. Called on the calling thread and on
  // the shard's watchdog and checkpoint writer threads. May be empty.
  std::function<void(LogLevel, const std::string&)> log;
  // Called on the calling thread right after joining, with the shard index
  // the coordinator assigned (a daemon names its log lines after it). May be
  // empty.
  std::function<void(uint32_t shard_index)> on_joined;
  // Called once the shard listens and its store is installed (a daemon
  // writes its port file); an error ends the run with it. May be empty.
  std::function<absl::Status(int port)> on_listening;
};

// Runs the shard until a signal or (coordinated) the job's end: OK then, or
// the error that ended it (InvalidArgument for inconsistent options,
// Unavailable when the address cannot be bound, FailedPrecondition when the
// command line's shape disagrees with the job's, the join's errors).
absl::Status RunShard(ShardLifecycleOptions options);

// The coordinated life in steps, so that tests can take them one at a time.
// Thread-compatible: one thread drives it (the shard's own threads only
// touch the stall note, under its lock).
class CoordinatedShard {
 public:
  // Binds options.server.host:port (ParameterServer methods answer
  // UNAVAILABLE, "waiting for the coordinator's shard map") and picks the
  // checkpoint to restore: the newest committed one now, verified once (it
  // is announced when joining, so that the job rolls back to it).
  // InvalidArgument without options.coordinator or wait_for_signal.
  static absl::StatusOr<std::unique_ptr<CoordinatedShard>> Listen(
      ShardLifecycleOptions options);
  ~CoordinatedShard();
  CoordinatedShard(const CoordinatedShard&) = delete;
  CoordinatedShard& operator=(const CoordinatedShard&) = delete;

  // Joins the job (retrying until join_timeout), adopts its shape and
  // installs the shard, restored from its checkpoint, not serving yet.
  // Cancelled when a signal came first (stop_signal() names it);
  // FailedPrecondition when options.num_shards or num_workers disagrees
  // with the job (the shard has left the job then); the join's errors.
  // REQUIRES: called once.
  absl::Status Join();
  // Applies the view, and a rollback it asks for, then serves (health
  // SERVING). REQUIRES: Join succeeded.
  void Serve();
  // One look at the view: a new generation or coordinator goes to the
  // store (which ranks sync steps wait for), a newer rollback is applied
  // (a failed one is tried again at the next look), a changed stall note
  // goes to the coordinator, and changes of the coordinator link are
  // logged. True once the job finished. REQUIRES: Serve ran.
  bool Follow();
  // Serve, then Follow every view_check_interval until a signal (false) or
  // the job's end (true).
  bool ServeUntilEnd();
  // Leaves the job (a failure is logged unless `finished`: after the end
  // the coordinator may be gone) and stops serving, logging the counters.
  void LeaveAndStop(bool finished);

  int port() const { return server_->port(); }
  // host:port as the coordinator shows it.
  const std::string& address() const { return address_; }
  // The signal that stopped Join or ServeUntilEnd; 0 while none.
  int stop_signal() const { return stop_signal_; }
  // The options with the job's shape (after Join).
  const ShardServerOptions& server_options() const { return options_.server; }
  ShardServer* server() { return server_.get(); }
  coordinator::CoordinatorClient* client() { return client_.get(); }
  // The last rollback applied (0: none).
  uint64_t applied_rollback() const { return applied_rollback_; }

 private:
  explicit CoordinatedShard(ShardLifecycleOptions options);
  void Log(LogLevel level, const std::string& line) const;
  // Takes the shard index and the job's shape from the coordinator's view.
  absl::Status AdoptJobShape();
  void ApplyView(const v1::ClusterView& view);
  void MaybeRollBack(const v1::ClusterView& view);
  // The watchdog's report (empty: nothing stalled); any thread.
  void NoteStall(const std::string& what) ABSL_LOCKS_EXCLUDED(stall_mu_);

  ShardLifecycleOptions options_;
  std::string address_;
  int stop_signal_ = 0;

  // What the follow loop last saw and did.
  uint64_t generation_ = 0;
  uint64_t coordinator_incarnation_ = 0;
  uint64_t applied_rollback_ = 0;
  std::string rollback_error_;
  absl::Status health_;
  int64_t rejoins_ = 0;
  std::string stall_sent_;

  absl::Mutex stall_mu_;
  std::string stall_note_ ABSL_GUARDED_BY(stall_mu_);

  std::unique_ptr<ServerMetrics> metrics_;
  // The server after the mutex (its watchdog reports to NoteStall) and the
  // client before the hook (which reads both at every scrape).
  std::unique_ptr<ShardServer> server_;
  std::unique_ptr<coordinator::CoordinatorClient> client_;
  std::unique_ptr<ScrapeHook> hook_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_LIFECYCLE_H_
