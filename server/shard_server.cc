#include "server/shard_server.h"

#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/chunking.h"
#include "common/grpc_server.h"
#include "common/status.h"
#include "common/transport.h"
#include "grpcpp/health_check_service_interface.h"

namespace shardps::server {

absl::Status ValidateStoreOptions(const StoreOptions& o) {
  if (o.num_shards < 1) {
    return absl::InvalidArgumentError("--num_shards must be at least 1");
  }
  if (o.shard_index >= o.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard_index=", o.shard_index,
                     " must be below --num_shards=", o.num_shards));
  }
  if (o.num_workers < 1 || o.num_workers > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_workers=", o.num_workers, " must be in [1, 65536]"));
  }
  if (o.update_threads < 0 || o.update_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--update_threads=", o.update_threads, " must be in [0, 1024]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(
    const ShardServerOptions& options) {
  SHARDPS_RETURN_IF_ERROR(ValidateStoreOptions(options.store));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<ShardServer> s, Listen(options));
  SHARDPS_RETURN_IF_ERROR(s->Install(options));
  return s;
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Listen(
    const ShardServerOptions& options) {
  SHARDPS_RETURN_IF_ERROR(CheckServerSecurity(options.security));
  int max_message = options.max_message_bytes;
  if (max_message <= 0) max_message = kMaxChunkBytes + kMessageOverheadBytes;
  std::unique_ptr<ShardServer> s(new ShardServer());
  s->service_ = std::make_unique<ParameterService>(options.service);

  GrpcServerOptions grpc_options;
  grpc_options.host = options.host;
  grpc_options.port = options.port;
  grpc_options.security = options.security;
  grpc_options.max_message_bytes = max_message;
  grpc_options.receive_buffer_bytes = options.receive_buffer_bytes;
  SHARDPS_ASSIGN_OR_RETURN(
      s->server_,
      StartGrpcServer(grpc_options, {s->service_.get()}, &s->port_));
  s->SetServing(false);  // until Install
  return s;
}

absl::Status ShardServer::Install(const ShardServerOptions& options,
                                  bool serve) {
  SHARDPS_RETURN_IF_ERROR(ValidateStoreOptions(options.store));
  if (store_ != nullptr) {
    return absl::FailedPreconditionError("the shard is already installed");
  }
  service_->SetWaiting("loading its checkpoint");
  StoreOptions store_options = options.store;
  SHARDPS_RETURN_IF_ERROR(StartCheckpoints(options, &store_options));
  auto store = std::make_unique<ParameterStore>(store_options);
  if (restored_.has_value()) {
    SHARDPS_RETURN_IF_ERROR(
        store->Restore(restored_->declaration, std::move(restored_->chunks)));
    restored_->chunks.clear();
  }
  store_ = std::move(store);
  if (options.step_timeout > absl::ZeroDuration() && options.on_stall) {
    watchdog_ =
        std::thread([this, timeout = options.step_timeout,
                     report = options.on_stall] { Watch(timeout, report); });
  }
  if (serve) Serve();
  return absl::OkStatus();
}

void ShardServer::Serve() {
  service_->Install(store_.get(), checkpointer_.get());
  SetServing(true);
}

absl::Status ShardServer::StartCheckpoints(const ShardServerOptions& options,
                                           StoreOptions* store) {
  if (options.checkpoint_dir.empty()) return absl::OkStatus();
  // Fail at start, not at the first checkpoint, when the directory is
  // unusable.
  std::error_code ec;
  std::filesystem::create_directories(options.checkpoint_dir, ec);
  if (ec || ::access(options.checkpoint_dir.c_str(), W_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint directory ", options.checkpoint_dir,
                     " cannot be created or written",
                     ec ? absl::StrCat(": ", ec.message()) : ""));
  }
  if (options.keep_checkpoints < 1 || options.checkpoint_every < 0) {
    return absl::InvalidArgumentError(
        "--keep_checkpoints must be >= 1 and --checkpoint_every_steps >= 0");
  }
  checkpointer_ = std::make_unique<ShardCheckpointer>(
      options.checkpoint_dir, store->shard_index, store->num_shards,
      options.keep_checkpoints);
  if (options.restore_from.has_value()) {
    SHARDPS_ASSIGN_OR_RETURN(restored_,
                             checkpointer_->LoadFrom(*options.restore_from));
  } else {
    SHARDPS_ASSIGN_OR_RETURN(restored_, checkpointer_->LoadLatest());
  }
  // Set up even without periodic checkpoints: the Checkpoint RPC asks for
  // one at a given step.
  writer_ = std::make_unique<ThreadPool>(1);
  const int64_t every = options.checkpoint_every;
  store->checkpoint_every = every;
  auto report = options.on_checkpoint;
  // Runs on an update thread: hand the copies to the writer and return. One
  // write at a time; a periodic checkpoint due while another is queued or
  // being written is skipped, so copies never pile up behind a slow disk. A
  // requested one waits its turn: someone is waiting for it.
  store->on_checkpoint = [this, report, every](int64_t step,
                                               std::vector<ChunkState> chunks) {
    int idle = 0;
    if (every > 0 && step % every == 0) {
      if (!pending_writes_.compare_exchange_strong(idle, 1)) {
        const absl::Status skipped = absl::ResourceExhaustedError(
            absl::StrCat("checkpoint of step ", step,
                         " skipped: the previous one is still being written"));
        checkpointer_->Failed(step, skipped);
        if (report) report(skipped);
        return;
      }
    } else {
      pending_writes_.fetch_add(1);
    }
    auto shared = std::make_shared<std::vector<ChunkState>>(std::move(chunks));
    // Read here, where the store is alive (the writer may run while the
    // store shuts down).
    auto declaration = std::make_shared<absl::StatusOr<v1::DeclareRequest>>(
        store_->declaration());
    writer_->Schedule([this, report, step, shared, declaration] {
      absl::StatusOr<CheckpointWrite> written =
          declaration->ok()
              ? checkpointer_->Write(step, **declaration, *shared)
              : absl::StatusOr<CheckpointWrite>(declaration->status());
      if (!declaration->ok()) {
        checkpointer_->Failed(step, declaration->status());
      }
      pending_writes_.fetch_sub(1);
      if (report) report(written);
    });
  };
  return absl::OkStatus();
}

void ShardServer::Watch(absl::Duration timeout,
                        const std::function<void(const std::string&)>& report) {
  bool was_stalled = false;
  while (true) {
    {
      absl::MutexLock lock(&watchdog_mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watchdog_mu_) {
        return stopping_;
      };
      if (watchdog_mu_.AwaitWithTimeout(absl::Condition(&stopping), timeout)) {
        return;
      }
    }
    std::vector<ParameterStore::StalledChunk> stalled =
        store_->Stalled(timeout);
    if (stalled.empty()) {
      if (was_stalled) report("");
      was_stalled = false;
      continue;
    }
    was_stalled = true;
    // One line: the step, the ranks that have not pushed, the chunks.
    std::vector<uint32_t> chunks;
    for (const auto& c : stalled) chunks.push_back(c.chunk_id);
    report(absl::StrCat(
        "step ", stalled[0].step, " has waited ",
        absl::FormatDuration(absl::Trunc(stalled[0].waiting, absl::Seconds(1))),
        " for rank(s) ", absl::StrJoin(stalled[0].missing_ranks, ","), "; ",
        stalled.size(), " chunk(s) pending: ",
        absl::StrJoin(chunks.begin(),
                      chunks.begin() + std::min<size_t>(chunks.size(), 16),
                      ","),
        chunks.size() > 16 ? ",..." : ""));
  }
}

void ShardServer::SetServing(bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
}

absl::Status ShardServer::RollBack(uint64_t rollback_id, int64_t step) {
  const v1::GetStatusResponse now = store_->Report();
  if (now.declared() && now.min_version() == step &&
      now.max_version() == step) {
    store_->NoteRollback(rollback_id);  // already there (the restarted one)
    return absl::OkStatus();
  }
  if (checkpointer_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("rollback ", rollback_id, " to step ", step,
                     " needs the job's checkpoints, and this server has no "
                     "--checkpoint_dir"));
  }
  if (!now.declared()) {
    store_->NoteRollback(rollback_id);  // no model yet: nothing to reset
    return absl::OkStatus();
  }
  // New calls wait (UNAVAILABLE) until the shard is reset; pushes already
  // in flight are refused by step or fail with the reset.
  service_->Pause(absl::StrCat("resetting to the checkpoint of step ", step,
                               " for rollback ", rollback_id));
  SetServing(false);
  absl::StatusOr<RestoredShard> loaded = checkpointer_->LoadStep(step);
  absl::Status status = loaded.status();
  if (status.ok()) {
    status = store_->ResetTo(
        std::move(loaded->chunks),
        absl::AbortedError(absl::StrCat(
            "the job rolls back to step ", step,
            ": a server restarted from the last committed checkpoint; "
            "redo the step from there")),
        rollback_id);
  }
  Serve();
  return status;
}

void ShardServer::Shutdown(absl::Duration grace) {
  if (store_ == nullptr && server_ != nullptr) {
    service_->SetWaiting("shutting down");
  }
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(grace));
  server_->Wait();
  server_.reset();
}

ShardServer::~ShardServer() {
  {
    absl::MutexLock lock(&watchdog_mu_);
    stopping_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  Shutdown(absl::ZeroDuration());
  store_.reset();   // its last updates may schedule a checkpoint write
  writer_.reset();  // finishes that write
}

}  // namespace shardps::server
