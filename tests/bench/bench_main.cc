// shardps-bench: benchmarks, each reported as a ratio to a baseline measured
// in the same run. Not part of the test suite.
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/chunking.h"
#include "common/daemon_flags.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/status.h"
#include "tests/bench/aggregate_bench.h"
#include "tests/bench/codec_bench.h"
#include "tests/bench/gpu_bench.h"
#include "tests/bench/netns_link.h"
#include "tests/bench/scale_bench.h"
#include "tests/bench/tcp_exchange.h"
#include "tests/bench/torch_bench.h"
#include "tests/bench/torch_hosts_bench.h"
#include "tests/bench/train_bench.h"
#include "tests/bench/train_hosts_bench.h"
#include "tests/bench/transport_bench.h"

ABSL_FLAG(std::string, server_binary, "",
          "shardps-server to start; default: next to this binary's build.");
ABSL_FLAG(std::vector<std::string>, server_flags, {},
          "scale: more flags for every shardps-server, comma-separated "
          "(e.g. --max_inflight_mib=64).");
ABSL_FLAG(std::string, coordinator_binary, "",
          "scale: shardps-coordinator to start; default: next to this "
          "binary's build.");
ABSL_FLAG(int32_t, epochs, 10,
          "Epochs (train; 2 unless given with --emulate_hosts).");
ABSL_FLAG(bool, emulate_hosts, false,
          "train, torch: shardps (shardps-local --emulate_hosts) and PyTorch "
          "DDP "
          "(gloo ring all-reduce, a rank per host) with every process on an "
          "emulated host whose link is --link each way (root, iproute2, "
          "python3-torch, an optimized build); one row per --rows and "
          "--compressions. train also runs each row's raw TCP exchange (its "
          "bytes and chunks a step, no compute) on hosts of the same link.");
ABSL_FLAG(std::string, rows, "2x2,4x4",
          "train and torch --emulate_hosts: WORKERSxSERVERS of each row (DDP: "
          "WORKERS "
          "ranks), e.g. 2x2,4x4,4x1.");
ABSL_FLAG(double, clip_grad_norm, 0,
          "train, torch: also run shardps with global-norm clipping at this "
          "bound (two-phase steps), alternating with runs without, and "
          "print what clipping costs; 0: not.");
ABSL_FLAG(int32_t, steps, 10,
          "Measured steps per configuration (scale: per row, fewer for big "
          "rows, more for fast ones).");
ABSL_FLAG(int32_t, cnn_steps, 200, "Measured steps of the CNN (torch).");
ABSL_FLAG(int32_t, gpt_steps, 60,
          "Measured steps of the GPT (torch; with --emulate_hosts the first "
          "is not timed).");
ABSL_FLAG(int32_t, wide_steps, 20,
          "torch --emulate_hosts: measured steps of the wide GPT (12.8 M "
          "parameters for 256 tokens a step: the link dominates); the first "
          "is not timed; under 2: not run.");
ABSL_FLAG(std::vector<std::string>, workloads, {},
          "torch --emulate_hosts: the workloads to run, comma-separated "
          "(gpt, gpt-wide, gpt-wide-noclip, gpt-wide-clip5, "
          "gpt-wide-clip5-nospec); empty: all.");
ABSL_FLAG(int32_t, torch_rounds, 2,
          "torch: runs of each side, alternating; the fastest of each counts "
          "(a noisy machine only ever slows a run down).");
ABSL_FLAG(int32_t, streams_per_shard, 2,
          "Client streams per shard (transport, scale).");
ABSL_FLAG(std::optional<bool>, shared_memory, std::nullopt,
          "Payloads through shared memory with the servers on this machine "
          "(default: on for transport on loopback, off for scale; never "
          "across --link).");
ABSL_FLAG(int64_t, model_mib, 64, "Model size in MiB (transport).");
ABSL_FLAG(std::string, compressions, "",
          "transport: instead of the table, PushPull step times of these "
          "codecs against the first, each GRADIENTS[/WEIGHTS] as "
          "--compression and --weight_encoding spell them, e.g. "
          "none,bf16/bf16,topk:0.01/topk:0.05. train and torch "
          "--emulate_hosts: fp32 (default), bf16 (both ways; DDP all-reduces "
          "fp16) and/or topk (top-k 1% gradients with error feedback, bf16 "
          "weights; DDP fp32), e.g. fp32,bf16,topk.");
ABSL_FLAG(std::string, model, "w",
          "transport codec runs: w (one tensor of --model_mib) or mlp (the "
          "main job's model).");
ABSL_FLAG(double, chunk_mib, 4,
          "Chunk size in MiB, e.g. 0.25 (transport; scale: at most, and at "
          "most a 16th of the model; train --emulate_hosts: shardps's chunks, "
          "whole KiB, instead of the workers' automatic size).");
ABSL_FLAG(bool, raw_baseline, true,
          "Measure the raw TCP baseline (off only to profile shardps alone).");
ABSL_FLAG(std::string, shards, "1,2", "Shard counts to run (transport).");
ABSL_FLAG(std::string, workers, "1,2", "Worker counts to run (transport).");
ABSL_FLAG(std::string, scale_workers, "1,2,4,8,16,32,64",
          "scale: worker counts (each rank its own member of the job and "
          "its own Client, a thread of this process).");
ABSL_FLAG(std::string, scale_shards, "1,2,4", "scale: shard counts.");
ABSL_FLAG(std::string, scale_models_mib, "2,64",
          "scale: model sizes in MiB, one table each.");
ABSL_FLAG(int64_t, scale_row_mib, 2048,
          "scale: a row whose --steps would push more gradient than this "
          "(workers x model per step) runs fewer steps, at least 3.");
ABSL_FLAG(int64_t, scale_heartbeat_timeout_ms, 5000,
          "scale: the coordinator's --heartbeat_timeout_ms.");
// Not listed in the usage: the scale bench's memberships process.
ABSL_FLAG(std::string, scale_coordinator, "",
          "scale_members: the coordinator (host:port) to join.");
ABSL_FLAG(uint64_t, scale_incarnation, 0,
          "scale_members: rank r joins with this incarnation + r.");
// Not listed in the usage: a host of train --emulate_hosts' raw TCP
// exchange.
ABSL_FLAG(std::string, exchange, "",
          "tcp_exchange_host: WORKERS,SERVERS,PUSH_BYTES,REPLY_BYTES,CHUNKS,"
          "STEPS,WARMUP.");
ABSL_FLAG(int32_t, exchange_rank, -1,
          "tcp_exchange_host: this host's rank (workers first).");
ABSL_FLAG(std::string, link, "",
          "train and torch --emulate_hosts: each host's link, as tc writes a "
          "rate. "
          "transport: a tc rate (500mbit, 1gbit, 10gbit) for a veth link "
          "between a servers' and a workers' network namespace, shaped with "
          "tbf each way (needs root, ip and tc); empty: loopback. Unless "
          "given, --steps is 5, --model_mib about 0.5 s of the rate (16 to "
          "256), --chunk_mib as shardps-worker sizes chunks for the model (a "
          "power of two near 1/128 of it) and --streams_per_shard 1, as it "
          "connects.");

namespace shardps::bench {
namespace {

// --link (required) and the rows of --rows times --compressions (fp32
// unless given) of `command` --emulate_hosts.
absl::Status HostsFlags(const std::string& command, std::string* link,
                        std::vector<TrainHostsRow>* rows) {
  *link = absl::GetFlag(FLAGS_link);
  if (link->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(command,
                     " --emulate_hosts needs --link=RATE, each host's link "
                     "(e.g. 1gbit)"));
  }
  SHARDPS_RETURN_IF_ERROR(ParseLinkRate(*link).status());
  const std::string compressions = absl::GetFlag(FLAGS_compressions);
  SHARDPS_ASSIGN_OR_RETURN(
      *rows, ParseTrainHostsRows(absl::GetFlag(FLAGS_rows),
                                 compressions.empty() ? "fp32" : compressions));
  return absl::OkStatus();
}

// --chunk_mib in bytes, a multiple of 4 (at least 4).
int64_t ChunkFlagBytes() {
  const double bytes = absl::GetFlag(FLAGS_chunk_mib) * (1 << 20);
  return std::max<int64_t>(4, static_cast<int64_t>(bytes) / 4 * 4);
}

// A binary of the same build tree: build/tests/shardps-bench ->
// build/<path>.
std::string SiblingBinary(const std::string& path) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string self = n > 0 ? std::string(buf, n) : "";
  const size_t pos = self.rfind("/tests/");
  return pos == std::string::npos ? path.substr(path.rfind('/') + 1)
                                  : self.substr(0, pos) + "/" + path;
}

// A binary flag's value, or the same build tree's `path` when it is empty.
std::string BinaryFlag(const absl::Flag<std::string>& flag,
                       const std::string& path) {
  const std::string given = absl::GetFlag(flag);
  return given.empty() ? SiblingBinary(path) : given;
}

// This program's path, for running it again (readlink /proc/self/exe).
std::string SelfBinary() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : "shardps-bench";
}

// The flag differs from its default (Abseil 20220623 keeps whether it was
// on the command line private, so giving the default counts as not given).
template <typename T>
bool Given(const absl::Flag<T>& flag) {
  const absl::CommandLineFlag& f = absl::GetFlagReflectionHandle(flag);
  return f.CurrentValue() != f.DefaultValue();
}

absl::StatusOr<std::vector<uint32_t>> ParseCounts(const std::string& flag,
                                                  const std::string& value) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    uint32_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", value, " is not a list of counts"));
    }
    out.push_back(v);
  }
  return out;
}

// The emulated-host flags mean something only where they are read: refused
// elsewhere rather than ignored (torch --link without --emulate_hosts would
// measure loopback and look like a link).
absl::Status CheckEmulatedHostFlags(const std::string& command) {
  const bool emulated = absl::GetFlag(FLAGS_emulate_hosts);
  if (emulated && command != "train" && command != "torch") {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate_hosts is for train and torch, not ", command));
  }
  if (emulated) return absl::OkStatus();
  if (command == "torch" &&
      (Given(FLAGS_link) || Given(FLAGS_rows) || Given(FLAGS_compressions) ||
       Given(FLAGS_wide_steps) || Given(FLAGS_workloads))) {
    return absl::InvalidArgumentError(
        "torch: --link, --rows, --compressions, --wide_steps and --workloads "
        "go with --emulate_hosts");
  }
  if (command == "train" &&
      (Given(FLAGS_link) || Given(FLAGS_rows) || Given(FLAGS_compressions))) {
    return absl::InvalidArgumentError(
        "train: --link, --rows and --compressions go with --emulate_hosts");
  }
  return absl::OkStatus();
}

// The exchange's flags are its hosts' own: refused elsewhere rather than
// ignored.
absl::Status CheckExchangeFlags(const std::string& command) {
  if (command != "tcp_exchange_host" &&
      (Given(FLAGS_exchange) || Given(FLAGS_exchange_rank))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--exchange and --exchange_rank are for tcp_exchange_host, not ",
        command));
  }
  return absl::OkStatus();
}

absl::Status Run(const std::string& command) {
#ifndef NDEBUG
  absl::PrintF("WARNING: assertions are enabled; figures are not meaningful\n");
#endif
  SHARDPS_RETURN_IF_ERROR(CheckEmulatedHostFlags(command));
  SHARDPS_RETURN_IF_ERROR(CheckExchangeFlags(command));
  if (command == "aggregate") return RunAggregateBench(AggregateOptions());
  if (command == "codec") return RunCodecBench(CodecOptions());
  if (command == "transport") {
    TransportOptions o;
    o.server_binary = BinaryFlag(FLAGS_server_binary, "server/shardps-server");
    o.steps = absl::GetFlag(FLAGS_steps);
    o.raw_baseline = absl::GetFlag(FLAGS_raw_baseline);
    o.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
    o.shared_memory = absl::GetFlag(FLAGS_shared_memory).value_or(true);
    o.model_bytes = absl::GetFlag(FLAGS_model_mib) << 20;
    if (const std::string link = absl::GetFlag(FLAGS_link); !link.empty()) {
      absl::StatusOr<int64_t> rate = ParseLinkRate(link);
      if (!rate.ok()) return rate.status();
      o.link_bits_per_second = *rate;
      o.self_binary = SelfBinary();
      // A step of a slow link takes long enough to be steady after fewer.
      if (!Given(FLAGS_steps)) o.steps = 5;
      if (!Given(FLAGS_model_mib)) o.model_bytes = DefaultLinkModelBytes(*rate);
      // The namespaces share /proc: shared memory would bypass the link.
      if (absl::GetFlag(FLAGS_shared_memory).value_or(false)) {
        return absl::InvalidArgumentError(
            "--shared_memory=true bypasses --link (both namespaces see each "
            "other's /proc): leave it off to measure the link");
      }
      o.shared_memory = false;
    }
    o.chunk_bytes = ChunkFlagBytes();
    if (o.link_bits_per_second > 0) {
      // Across a link parallel streams only slow a sync step: each chunk's
      // reply waits for the last worker's copy, and more flows sharing the
      // link make that copy later (PushPull at 1 Gbit/s, 1 MiB chunks:
      // 0.85-0.93 of the link with 2 streams, 0.92-0.95 with 1). Chunks as
      // shardps-worker sizes them for the model (AutoChunkBytes).
      if (!Given(FLAGS_chunk_mib)) {
        o.chunk_bytes = static_cast<int64_t>(AutoChunkBytes(o.model_bytes));
      }
      if (!Given(FLAGS_streams_per_shard)) o.streams_per_shard = 1;
    }
    SHARDPS_ASSIGN_OR_RETURN(
        o.shards, ParseCounts("shards", absl::GetFlag(FLAGS_shards)));
    SHARDPS_ASSIGN_OR_RETURN(
        o.workers, ParseCounts("workers", absl::GetFlag(FLAGS_workers)));
    if (const std::string c = absl::GetFlag(FLAGS_compressions); !c.empty()) {
      o.compressions = absl::StrSplit(c, ',');
    }
    o.main_job_model = absl::GetFlag(FLAGS_model) == "mlp";
    if (absl::GetFlag(FLAGS_model) != "mlp" &&
        absl::GetFlag(FLAGS_model) != "w") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model=", absl::GetFlag(FLAGS_model), " is not w or mlp"));
    }
    return RunTransportBench(o);
  }
  if (command == "scale") {
    ScaleOptions o;
    o.server_binary = BinaryFlag(FLAGS_server_binary, "server/shardps-server");
    o.server_flags = absl::GetFlag(FLAGS_server_flags);
    o.self_binary = SelfBinary();
    o.coordinator_binary =
        BinaryFlag(FLAGS_coordinator_binary, "server/shardps-coordinator");
    SHARDPS_ASSIGN_OR_RETURN(
        o.workers,
        ParseCounts("scale_workers", absl::GetFlag(FLAGS_scale_workers)));
    SHARDPS_ASSIGN_OR_RETURN(
        o.shards,
        ParseCounts("scale_shards", absl::GetFlag(FLAGS_scale_shards)));
    SHARDPS_ASSIGN_OR_RETURN(
        const std::vector<uint32_t> models,
        ParseCounts("scale_models_mib", absl::GetFlag(FLAGS_scale_models_mib)));
    o.model_bytes.clear();
    for (uint32_t mib : models) o.model_bytes.push_back(int64_t{mib} << 20);
    o.steps = absl::GetFlag(FLAGS_steps);
    o.max_steps = std::max(o.max_steps, o.steps);
    o.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
    o.shared_memory = absl::GetFlag(FLAGS_shared_memory).value_or(false);
    o.max_chunk_bytes = ChunkFlagBytes();
    o.row_bytes = absl::GetFlag(FLAGS_scale_row_mib) << 20;
    o.heartbeat_timeout_ms = absl::GetFlag(FLAGS_scale_heartbeat_timeout_ms);
    if (o.max_chunk_bytes <= 0 || o.row_bytes <= 0 ||
        o.heartbeat_timeout_ms <= 0) {
      return absl::InvalidArgumentError(
          "--chunk_mib, --scale_row_mib and --scale_heartbeat_timeout_ms "
          "must be positive");
    }
    return RunScaleBench(o);
  }
  // Not listed: the memberships of a scale row's workers.
  if (command == "scale_members") {
    SHARDPS_ASSIGN_OR_RETURN(
        const std::vector<uint32_t> workers,
        ParseCounts("scale_workers", absl::GetFlag(FLAGS_scale_workers)));
    if (workers.size() != 1) {
      return absl::InvalidArgumentError(
          "scale_members: give one --scale_workers count");
    }
    // The port file tells the bench (Daemon::Start) that every rank joined.
    return ServeScaleMembers(
        absl::GetFlag(FLAGS_scale_coordinator), workers.front(),
        absl::GetFlag(FLAGS_scale_incarnation), [&] {
          return WritePortFile(absl::GetFlag(FLAGS_port_file),
                               static_cast<int>(workers.front()));
        });
  }
  if (command == "gpu") return RunGpuBench();
  // Not listed: the raw TCP peer a --link run starts in its servers'
  // namespace.
  if (command == "raw_tcp_peer") {
    return ServeRawTcpPeer(
        absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_port), [](int port) {
          return WritePortFile(absl::GetFlag(FLAGS_port_file), port);
        });
  }
  // Not listed: a host of train --emulate_hosts' raw TCP exchange, started
  // in its emulated host's namespace.
  if (command == "tcp_exchange_host") {
    SHARDPS_ASSIGN_OR_RETURN(const TcpExchange exchange,
                             ParseTcpExchange(absl::GetFlag(FLAGS_exchange)));
    return RunTcpExchangeHost(exchange, absl::GetFlag(FLAGS_exchange_rank));
  }
  if (command == "train" && absl::GetFlag(FLAGS_emulate_hosts)) {
    TrainHostsOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.torch_script = SHARDPS_SOURCE_DIR "/tests/bench/torch/mlp_ddp.py";
    o.self_binary = SelfBinary();
    o.epochs = Given(FLAGS_epochs) ? absl::GetFlag(FLAGS_epochs) : 2;
    SHARDPS_RETURN_IF_ERROR(HostsFlags(command, &o.link, &o.rows));
    if (Given(FLAGS_chunk_mib)) {
      const double kib = absl::GetFlag(FLAGS_chunk_mib) * 1024;
      if (!(kib >= 1 && kib <= 65536) || kib != static_cast<int64_t>(kib)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--chunk_mib=", absl::GetFlag(FLAGS_chunk_mib),
            ": train --emulate_hosts needs whole KiB from 1 KiB to 64 MiB "
            "(e.g. 0.015625 for 16 KiB)"));
      }
      o.chunk_kib = static_cast<int64_t>(kib);
    }
    return RunTrainHostsBench(o);
  }
  if (command == "train") {
    TrainOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.torch_script = SHARDPS_SOURCE_DIR "/tests/bench/torch/mlp_ddp.py";
    o.epochs = absl::GetFlag(FLAGS_epochs);
    o.clip_grad_norm = absl::GetFlag(FLAGS_clip_grad_norm);
    return RunTrainBench(o);
  }
  if (command == "torch" && absl::GetFlag(FLAGS_emulate_hosts)) {
    TorchHostsOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.python_path = SiblingBinary("worker/python");
    o.source_dir = SHARDPS_SOURCE_DIR;
    o.gpt_steps = absl::GetFlag(FLAGS_gpt_steps);
    o.wide_steps = absl::GetFlag(FLAGS_wide_steps);
    o.workloads = absl::GetFlag(FLAGS_workloads);
    SHARDPS_RETURN_IF_ERROR(HostsFlags(command, &o.link, &o.rows));
    return RunTorchHostsBench(o);
  }
  if (command == "torch") {
    TorchOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.python_path = SiblingBinary("worker/python");
    o.clip_grad_norm = absl::GetFlag(FLAGS_clip_grad_norm);
    o.source_dir = SHARDPS_SOURCE_DIR;
    o.cnn_steps = absl::GetFlag(FLAGS_cnn_steps);
    o.gpt_steps = absl::GetFlag(FLAGS_gpt_steps);
    o.rounds = absl::GetFlag(FLAGS_torch_rounds);
    return RunTorchBench(o);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown benchmark \"", command,
      "\"; one of: transport, scale, aggregate, codec, train, gpu, torch"));
}

}  // namespace
}  // namespace shardps::bench

int main(int argc, char** argv) {
  std::vector<char*> args = shardps::ParseDaemonFlags(
      argc, argv,
      "runs a benchmark against a baseline measured in the same run.\n"
      "  shardps-bench transport | scale | aggregate | codec | train | gpu | "
      "torch [flags]\n"
      "  shardps-bench transport --link=1gbit  (as root: across a "
      "tbf-shaped veth link between two network namespaces)\n"
      "  shardps-bench train --emulate_hosts --link=1gbit --rows=2x2,4x4 "
      "--compressions=fp32,bf16  (as root: shardps and PyTorch DDP with "
      "every process on an emulated host of its own)\n"
      "  shardps-bench torch --emulate_hosts --link=100mbit --rows=2x2,4x4 "
      "--compressions=fp32,bf16,topk  (as root: the GPT example and a wide "
      "GPT, the same way)\n"
      "  shardps-bench scale --scale_workers=1,8,64 --scale_shards=1,4 "
      "--scale_models_mib=2,64  (a coordinated job: step time, bytes/s per "
      "shard, server RSS, connections, coordinator CPU as workers grow)");
  if (args.size() != 2) {
    shardps::LogError(
        "give one benchmark: transport, scale, aggregate, codec, train, gpu "
        "or torch");
    return 1;
  }
  return shardps::ExitCode(shardps::bench::Run(args[1]));
}
