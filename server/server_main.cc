// shardps-server: one parameter shard.
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/status.h"
#include "server/shard_server.h"

ABSL_FLAG(uint32_t, shard_index, 0, "This shard's index in [0, num_shards).");
ABSL_FLAG(uint32_t, num_shards, 1, "Number of parameter shards in the job.");
ABSL_FLAG(uint32_t, num_workers, 1,
          "Number of workers; sync steps wait for all of them.");
ABSL_FLAG(std::string, mode, "sync",
          "Consistency: sync (every step waits for every worker), async "
          "(pushes applied on arrival) or ssp:K (applied on arrival, but no "
          "worker gets more than K steps ahead of the slowest).");
ABSL_FLAG(uint64_t, generation, 0, "Cluster generation requests must carry.");
ABSL_FLAG(bool, allow_nonfinite, false,
          "Accept gradients holding NaN or infinity (rejected by default).");
ABSL_FLAG(int32_t, update_threads, 2,
          "Threads running optimizer updates in parallel across chunks.");
ABSL_FLAG(int32_t, max_message_bytes, 0,
          "Largest gRPC message accepted; 0: 64 MiB plus 64 KiB.");
ABSL_FLAG(int64_t, fault_drop_reply_every, 0,
          "Testing only: drop every Nth PushPull reply and end its stream "
          "with UNAVAILABLE.");

namespace shardps::server {
namespace {

absl::StatusOr<ShardServerOptions> OptionsFromFlags() {
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  ShardServerOptions o;
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  o.store.shard_index = absl::GetFlag(FLAGS_shard_index);
  o.store.num_shards = absl::GetFlag(FLAGS_num_shards);
  o.store.num_workers = absl::GetFlag(FLAGS_num_workers);
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
  o.store.generation = absl::GetFlag(FLAGS_generation);
  o.store.allow_nonfinite = absl::GetFlag(FLAGS_allow_nonfinite);
  o.store.update_threads = absl::GetFlag(FLAGS_update_threads);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (o.max_message_bytes < 0) {
    return absl::InvalidArgumentError("--max_message_bytes is negative");
  }
  o.service.drop_reply_every = absl::GetFlag(FLAGS_fault_drop_reply_every);
  SHARDPS_RETURN_IF_ERROR(ValidateStoreOptions(o.store));
  return o;
}

absl::Status Run() {
  SHARDPS_ASSIGN_OR_RETURN(ShardServerOptions options, OptionsFromFlags());
  InitLog("server", static_cast<int>(options.store.shard_index),
          absl::GetFlag(FLAGS_log_format) == "json");
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<ShardServer> server,
                           ShardServer::Start(options));
  LogInfo("shard %d of %d listening on %s:%d (mode=%s, workers=%d)",
          options.store.shard_index, options.store.num_shards, options.host,
          server->port(), absl::GetFlag(FLAGS_mode), options.store.num_workers);
  SHARDPS_RETURN_IF_ERROR(
      WritePortFile(absl::GetFlag(FLAGS_port_file), server->port()));
  const int sig = WaitForTerminationSignal();
  LogInfo("signal %d: shutting down", sig);
  server->Shutdown(absl::Seconds(2));
  v1::GetStatusResponse status = server->store()->Status();
  LogInfo("stopped after %d pushes, %d updates, %d rejected",
          status.pushes_total(), status.updates_total(),
          status.rejected_total());
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardps::server

int main(int argc, char** argv) {
  shardps::BlockTerminationSignals();
  shardps::ParseDaemonFlags(
      argc, argv,
      "serves one parameter shard of a shardps job.\n"
      "  shardps-server --shard_index=0 --num_shards=2 --num_workers=2 "
      "--port=0 --port_file=/tmp/s0.port");
  return shardps::ExitCode(shardps::server::Run());
}
