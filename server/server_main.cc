// shardps-server: one parameter shard. Static mode: --shard_index,
// --num_shards and --num_workers on the command line. With --coordinator it
// joins the job there, takes its shard index and the job's shape from the
// coordinator, and exits 0 by itself once every worker has finished.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/daemon_flags.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security_flags.h"
#include "common/signal_wait.h"
#include "common/status.h"
#include "common/transport.h"
#include "coordinator/client/member_flags.h"
#include "server/gradient_decode.h"
#include "server/shard_lifecycle.h"

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
ABSL_FLAG(std::string, encodings, "all",
          "Gradient encodings accepted from workers: all, or a list of fp32, "
          "bf16, fp16, int8, topk (a push in another is refused).");
ABSL_FLAG(int32_t, update_threads, -1,
          "Threads running optimizer updates in parallel across chunks; 0: "
          "each update runs on the thread that completed its chunk's step; "
          "-1: 0 on a machine of at most 2 cores (where handing an update "
          "to another thread costs more than running it there), else 2.");
ABSL_FLAG(double, max_inflight_mib, 256,
          "Receive budget, in MiB: the most bytes of pushes being read and, "
          "in sync mode, of gradients that came before the ranks below them "
          "this shard holds, whatever the number of workers; while it is "
          "spent, streams are not read and their senders wait (a parked "
          "stream leaves at most 64 KiB in gRPC's buffers). The least rank a "
          "sum needs next always reads (so it cannot deadlock), one push at "
          "a time per stream. 0: no budget. Fractions allowed (0.5: "
          "512 KiB).");
ABSL_FLAG(int32_t, max_message_bytes, 0,
          "Largest gRPC message accepted; 0: 64 MiB plus 64 KiB.");
ABSL_FLAG(std::string, link_rate, "",
          "This server's network link, as tc writes rates (100mbit, 1gbit, "
          "10gbit); empty: not known. When given, every connection gets a TCP "
          "receive buffer of what the link carries in 2.5 ms (30.5 KiB at "
          "100 Mbit/s) instead of the kernel's autotuned one, so that workers "
          "pushing at once cannot grow their windows until the queue before "
          "this server's link overflows (incast): 4 workers on one server at "
          "100 Mbit/s step 6-7 % faster, with no retransmissions. Needs "
          "net.core.rmem_max at half of it, or CAP_NET_ADMIN. shardps-local "
          "--emulate_hosts gives its --link.");
ABSL_FLAG(bool, shared_memory, true,
          "Let workers on this machine move gradients and weights through "
          "shared memory (their memfds, opened by /proc path); false: "
          "everything over gRPC.");
ABSL_FLAG(bool, shared_memory_rings, true,
          "With --shared_memory: let those workers pass PushPull headers "
          "through message rings in that shared memory too (no gRPC message "
          "per chunk); false: headers over gRPC.");
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

absl::StatusOr<ShardLifecycleOptions> OptionsFromFlags() {
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  SHARDPS_RETURN_IF_ERROR(coordinator::CheckMemberFlags());
  ShardLifecycleOptions life;
  ShardServerOptions& o = life.server;
  SHARDPS_ASSIGN_OR_RETURN(o.security, ServerSecurityOptionsFromFlags());
  o.host = absl::GetFlag(FLAGS_host);
  o.port = absl::GetFlag(FLAGS_port);
  const int32_t index = absl::GetFlag(FLAGS_shard_index);
  if (index < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_index=", index, " must be -1 (any) or at least 0"));
  }
  // In static mode the defaults are a one-shard, one-worker job; with a
  // coordinator, the job's shape fills in what the flags leave open.
  o.store.shard_index = static_cast<uint32_t>(std::max(index, 0));
  o.store.num_shards = absl::GetFlag(FLAGS_num_shards).value_or(1);
  o.store.num_workers = absl::GetFlag(FLAGS_num_workers).value_or(1);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "sync") {
    o.store.mode = v1::CONSISTENCY_SYNC;
  } else if (mode == "async") {
    o.store.mode = v1::CONSISTENCY_ASYNC;
  } else if (absl::StartsWith(mode, "ssp:") &&
             absl::SimpleAtoi(mode.substr(4), &o.store.staleness) &&
             o.store.staleness >= 0) {
    o.store.mode = v1::CONSISTENCY_SSP;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode=", mode, " is not one of: sync, async, ssp:K (K >= 0)"));
  }
  o.store.allow_nonfinite = absl::GetFlag(FLAGS_allow_nonfinite);
  SHARDPS_ASSIGN_OR_RETURN(o.store.accepted_encodings,
                           ParseEncodingSet(absl::GetFlag(FLAGS_encodings)));
  o.store.update_threads = absl::GetFlag(FLAGS_update_threads);
  if (o.store.update_threads < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--update_threads=", o.store.update_threads,
                     " must be -1 (automatic) or in [0, 1024]"));
  }
  if (o.store.update_threads == -1) {
    o.store.update_threads = std::thread::hardware_concurrency() <= 2 ? 0 : 2;
  }
  const double inflight_mib = absl::GetFlag(FLAGS_max_inflight_mib);
  if (!(inflight_mib >= 0 && inflight_mib <= (1 << 30))) {  // NaN too
    return absl::InvalidArgumentError(
        absl::StrCat("--max_inflight_mib=", inflight_mib,
                     " must be in [0, 2^30] (0: no budget)"));
  }
  o.store.max_inflight_bytes = static_cast<int64_t>(inflight_mib * (1 << 20));
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (o.max_message_bytes < 0) {
    return absl::InvalidArgumentError("--max_message_bytes is negative");
  }
  if (const std::string link = absl::GetFlag(FLAGS_link_rate); !link.empty()) {
    SHARDPS_ASSIGN_OR_RETURN(const int64_t rate,
                             ParseLinkRate(link, "--link_rate"));
    o.receive_buffer_bytes = ReceiveBufferBytesForLink(rate);
  }
  o.service.drop_reply_every = absl::GetFlag(FLAGS_fault_drop_reply_every);
  o.service.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  o.service.shared_memory_rings = absl::GetFlag(FLAGS_shared_memory_rings);
  o.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every_steps);
  o.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  if (o.checkpoint_every != 0 && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint_every_steps needs --checkpoint_dir");
  }
  if (!coordinator::UseCoordinator()) {
    SHARDPS_RETURN_IF_ERROR(ValidateStoreOptions(o.store));
    return life;
  }
  life.coordinator = absl::GetFlag(FLAGS_coordinator);
  life.job_id = absl::GetFlag(FLAGS_job_id);
  life.requested_index = index;
  life.num_shards = absl::GetFlag(FLAGS_num_shards);
  life.num_workers = absl::GetFlag(FLAGS_num_workers);
  life.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  life.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  return life;
}

absl::Status Run() {
  SHARDPS_ASSIGN_OR_RETURN(ShardLifecycleOptions options, OptionsFromFlags());
  const bool json = absl::GetFlag(FLAGS_log_format) == "json";
  InitLog("server",
          options.coordinator.empty()
              ? static_cast<int>(options.server.store.shard_index)
              : options.requested_index,
          json);
  if (const int bytes = options.server.receive_buffer_bytes; bytes > 0) {
    Log(LogLevel::kInfo,
        absl::StrFormat(
            "link %s: every connection's TCP receive buffer is %.1f KiB "
            "(2.5 ms of the link)",
            FormatLinkRate(*ParseLinkRate(absl::GetFlag(FLAGS_link_rate))),
            bytes / 1024.0));
  }
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsExporter> metrics,
                           ServeMetricsFromFlags());
  options.metrics = metrics.get();
  options.wait_for_signal = [](absl::Duration timeout) {
    return timeout == absl::InfiniteDuration()
               ? WaitForTerminationSignal()
               : WaitForTerminationSignalFor(timeout);
  };
  options.log = [](LogLevel level, const std::string& line) {
    Log(level, line);
  };
  // Only the main thread logs until then; the client's threads never do.
  options.on_joined = [json](uint32_t shard_index) {
    InitLog("server", static_cast<int>(shard_index), json);
  };
  options.on_listening = [](int port) {
    return WritePortFile(absl::GetFlag(FLAGS_port_file), port);
  };
  return RunShard(std::move(options));
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
