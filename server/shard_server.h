// A running parameter shard: the ParameterStore, its gRPC service, the health
// service and reflection, listening on one port. Used by shardps-server and by
// tests that want a shard in-process.
#ifndef SHARDPS_SERVER_SHARD_SERVER_H_
#define SHARDPS_SERVER_SHARD_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "grpcpp/server.h"
#include "server/parameter_service.h"
#include "server/parameter_store.h"
#include "server/shard_checkpointer.h"

namespace shardps::server {

struct ShardServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: the kernel picks a free port
  StoreOptions store;
  ServiceOptions service;
  // Largest message accepted (bigger ones get RESOURCE_EXHAUSTED).
  int max_message_bytes = 0;  // 0: kMaxChunkBytes + overhead
  // > 0: the TCP receive buffer of every connection (common/transport.h's
  // ReceiveBufferBytesForLink of the shard's link); 0: the kernel's.
  int receive_buffer_bytes = 0;
  // TLS, client certificates and the bearer token (default: plaintext);
  // Start checks them with CheckServerSecurity.
  SecurityOptions security;
  // Checkpoints (off when checkpoint_dir is empty): at start the newest
  // committed checkpoint in the directory is restored; every
  // checkpoint_every steps (0: never), and at the steps the Checkpoint RPC
  // asks for, the shard writes its file there (on a writer thread of its
  // own) and commits the step when all shards have written.
  std::string checkpoint_dir;
  // Restore this committed checkpoint, already verified (the one a
  // restarted server announced when it joined); unset: the newest one.
  std::optional<CheckpointInfo> restore_from;
  int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  // Told about every checkpoint write (for the daemon's log); any thread.
  std::function<void(const absl::StatusOr<CheckpointWrite>&)> on_checkpoint;
  // Watchdog: a sync step that has waited longer than this since its first
  // contribution is reported to on_stall (every `step_timeout` while it
  // lasts), naming the ranks and chunks it waits for, then with an empty
  // string once nothing is stalled any more. Zero: off.
  absl::Duration step_timeout = absl::ZeroDuration();
  std::function<void(const std::string& what)> on_stall;
};

class ShardServer {
 public:
  // Listen, then Install. InvalidArgument for inconsistent options;
  // Unavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(
      const ShardServerOptions& options);
  // Binds options.host:options.port and serves gRPC health (NOT_SERVING)
  // and reflection; the ParameterServer methods answer UNAVAILABLE until
  // Install. Lets a shard advertise its address before it knows its index.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Listen(
      const ShardServerOptions& options);
  // Loads the newest committed checkpoint of options.checkpoint_dir (if
  // any; options.restore_from: that one), creates the store for
  // options.store and, with `serve`, serves it (health SERVING). Without,
  // Serve() does that later. FailedPrecondition when called twice.
  absl::Status Install(const ShardServerOptions& options, bool serve = true);
  // Serves the installed store.
  void Serve();
  // What the ParameterServer methods answer UNAVAILABLE with before
  // Install ("waiting for the coordinator's shard map").
  void SetWaiting(const std::string& why) { service_->SetWaiting(why); }
  ~ShardServer();

  int port() const { return port_; }
  // The restored checkpoint, if the shard started from one. REQUIRES:
  // Install succeeded (also for store()).
  const std::optional<RestoredShard>& restored() const { return restored_; }
  ParameterStore* store() { return store_.get(); }
  // A job-wide rollback (ClusterView.rollback_id): reloads the newest
  // committed checkpoint, which must be of `step`, and resets the shard to
  // it; pushes waiting for replies fail with ABORTED. The health service
  // reports NOT_SERVING meanwhile. A shard already at `step` with nothing
  // applied beyond it keeps its state. FailedPrecondition without
  // checkpoints or when the newest committed checkpoint is another step.
  absl::Status RollBack(uint64_t rollback_id, int64_t step);
  // The gRPC health status of the whole server and its service.
  void SetServing(bool serving);

  // Stops accepting RPCs and cancels the ones in flight after `grace`.
  void Shutdown(absl::Duration grace);

 private:
  ShardServer() = default;
  absl::Status StartCheckpoints(const ShardServerOptions& options,
                                StoreOptions* store);
  // The watchdog thread's loop.
  void Watch(absl::Duration timeout,
             const std::function<void(const std::string&)>& report)
      ABSL_LOCKS_EXCLUDED(watchdog_mu_);

  // Declared before the store: the store's last updates may still hand a
  // checkpoint to them while it shuts down.
  std::unique_ptr<ShardCheckpointer> checkpointer_;
  std::unique_ptr<ThreadPool> writer_;
  std::atomic<int> pending_writes_{0};  // checkpoints queued or being written
  std::optional<RestoredShard> restored_;
  std::unique_ptr<ParameterStore> store_;
  absl::Mutex watchdog_mu_;
  bool stopping_ ABSL_GUARDED_BY(watchdog_mu_) = false;
  std::thread watchdog_;
  std::unique_ptr<ParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Checks the options a server needs: shard index below num_shards, at least
// one worker, sane thread count.
absl::Status ValidateStoreOptions(const StoreOptions& options);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_H_
