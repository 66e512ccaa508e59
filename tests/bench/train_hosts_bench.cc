// shardps-bench train --emulate_hosts. Each row runs the main job through
// shardps-local --emulate_hosts (the user's path: its final line, metrics.csv
// and the bytes it prints per host), then DDP: EmulatedHosts makes one host
// per rank (10.213.0.1 is rank 0, where gloo's rendezvous listens) and each
// rank of tests/bench/torch/mlp_ddp.py runs in its host's namespace. Times
// are the sums of the epochs' training loops on both sides (rank 0's; no
// start-up, no evaluation), so the ratio compares the same work. Between
// them, the raw TCP exchange (tcp_exchange.h) moves shardps's bytes a step
// in its chunks on hosts of the same link: a baseline of what the links and
// the machine allow a step with no compute and no gRPC (not a floor: it has
// no flow control, and loses more to incast where pushes are large).
#include "tests/bench/train_hosts_bench.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/chunking.h"
#include "common/link_rate.h"
#include "common/status.h"
#include "deploy/local/child_process.h"
#include "deploy/local/emulated_hosts.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/emulated_ddp.h"
#include "tests/bench/run_command.h"
#include "tests/bench/tcp_exchange.h"
#include "tests/testing/daemon.h"

namespace shardps::bench {
namespace {

// The main job's steps: 60000 images in global batches of 256.
constexpr int64_t kGlobalBatch = 256;
constexpr int64_t kSamplesPerEpoch = 60000 / kGlobalBatch * kGlobalBatch;
// A DDP row that runs longer than this is stuck (a lost rank leaves gloo
// waiting for 30 minutes).
constexpr absl::Duration kDdpTimeoutPerEpoch = absl::Minutes(5);

// The steps of a run: every epoch's global batches.
double Steps(const TrainHostsOptions& o) {
  return static_cast<double>(o.epochs) * kSamplesPerEpoch / kGlobalBatch;
}

struct SideRun {
  double train_s = 0;  // sum of the epochs' training loops
  double wall_s = 0;   // shardps-local's final wall_s; DDP: rank 0's wall_s
  double accuracy = 0;
  std::vector<HostBytes> bytes;
  std::string detail;    // the final line, or the DDP ranks' encoding
  int chunks = 0;        // shardps: the chunks the model was declared in
  MachineLoad load;      // the machine's CPUs, over the whole run
  double elapsed_s = 0;  // the run, as this process timed it
};

absl::StatusOr<SideRun> RunShardps(const TrainHostsOptions& o,
                                   const TrainHostsRow& row) {
  const std::string dir = testing::MakeTempDir("shardps-bench-hosts");
  std::string command =
      absl::StrCat(o.local_binary, " --emulate_hosts --link=", o.link,
                   " --run_dir=", dir, " --epochs=", o.epochs,
                   " --workers=", row.workers, " --servers=", row.servers);
  if (o.chunk_kib > 0) absl::StrAppend(&command, " --chunk_kib=", o.chunk_kib);
  const RowEncodings encodings = EncodingsOf(row);
  if (!encodings.gradients.empty()) {
    absl::StrAppend(&command, " --compression=", encodings.gradients,
                    " --weight_encoding=", encodings.weights);
  }
  const MachineLoad before = MachineLoad::Now();
  const absl::Time start = absl::Now();
  SHARDPS_ASSIGN_OR_RETURN(std::string out,
                           RunCommand(absl::StrCat(command, " 2>&1")));
  SideRun run;
  run.load = MachineLoad::Now().Since(before);
  run.elapsed_s = absl::ToDoubleSeconds(absl::Now() - start);
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "final:")) run.detail = std::string(line);
  }
  const size_t at = run.detail.find("wall_s=");
  if (at != std::string::npos) {
    (void)absl::SimpleAtod(run.detail.substr(at + 7), &run.wall_s);
  }
  run.bytes = ParseLinkBytes(out);
  const std::string csv = dir + "/metrics.csv";
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> epoch_s,
                           CsvColumn(csv, "epoch_s"));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> accuracy,
                           CsvColumn(csv, "test_accuracy"));
  if (static_cast<int>(epoch_s.size()) != o.epochs || accuracy.empty() ||
      run.bytes.size() != static_cast<size_t>(1 + row.servers + row.workers)) {
    return absl::InternalError(absl::StrCat(
        "`", command, "`: expected ", o.epochs, " epochs in ", csv, " and ",
        1 + row.servers + row.workers, " hosts' bytes; its output:\n", out));
  }
  for (double s : epoch_s) run.train_s += s;
  run.accuracy = accuracy.back();
  // "declared in 44 chunks of up to 64 KiB over 4 shards"
  for (const std::string& line :
       local::LastLines(dir + "/logs/worker-0.log", 1000)) {
    const size_t at = line.find("declared in ");
    if (at != std::string::npos) {
      const std::string rest = line.substr(at + 12);
      (void)absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &run.chunks);
    }
  }
  if (run.chunks < 1) {
    return absl::InternalError(absl::StrCat("no \"declared in N chunks\" in ",
                                            dir, "/logs/worker-0.log"));
  }
  return run;
}

// A step of raw TCP moving what shardps's worker-0 moved a step, in as many
// chunks a server, with no compute: each worker's card's bytes per step
// (the initial pull and evaluation are a rounding error over the epochs).
absl::StatusOr<TcpExchangeRun> RunRawExchange(
    const TrainHostsOptions& o, const TrainHostsRow& row, int64_t rate,
    const SideRun& shardps, const local::NetworkTools& tools) {
  const HostBytes* worker = nullptr;
  for (const HostBytes& b : shardps.bytes) {
    if (b.name == "worker-0") worker = &b;
  }
  if (worker == nullptr) {
    return absl::InternalError(
        "no bytes of worker-0's link from shardps-local");
  }
  const double steps = Steps(o);
  TcpExchange x;
  x.workers = row.workers;
  x.servers = row.servers;
  x.push_bytes = static_cast<int64_t>(worker->sent / steps / row.servers);
  x.reply_bytes = static_cast<int64_t>(worker->received / steps / row.servers);
  x.chunks = (shardps.chunks + row.servers - 1) / row.servers;
  // About 3 s of the link, and at least 40 steps.
  const double bound_s =
      static_cast<double>(std::max(x.push_bytes, x.reply_bytes)) * row.servers *
      8 / rate;
  x.steps = std::clamp(static_cast<int>(3.0 / bound_s), 40, 1000);
  x.warmup = x.steps / 10;
  return RunTcpExchangeOnHosts(o.self_binary, rate, x, tools);
}

absl::StatusOr<SideRun> RunDdp(const TrainHostsOptions& o,
                               const TrainHostsRow& row,
                               const local::NetworkTools& tools) {
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, ParseLinkRate(o.link));
  const std::string encoding = EncodingsOf(row).ddp;
  const MachineLoad before = MachineLoad::Now();
  const absl::Time start = absl::Now();
  SHARDPS_ASSIGN_OR_RETURN(RanksRun ddp,
                           RunRanksOnHosts(
                               "/usr/bin/python3", rate, row.workers, tools,
                               [&](int rank, const std::string& master) {
                                 return std::vector<std::string>{
                                     o.torch_script,
                                     absl::StrCat("--processes=", row.workers),
                                     absl::StrCat("--rank=", rank),
                                     absl::StrCat("--master=", master),
                                     "--ifname=eth0",
                                     "--threads=1",
                                     absl::StrCat("--epochs=", o.epochs),
                                     absl::StrCat("--data=", o.data_dir),
                                     absl::StrCat("--compression=", encoding)};
                               },
                               o.epochs * kDdpTimeoutPerEpoch));
  SideRun run;
  run.load = MachineLoad::Now().Since(before);
  run.elapsed_s = absl::ToDoubleSeconds(absl::Now() - start);
  run.wall_s = JsonNumber(ddp.result, "wall_s");
  const std::vector<double> epoch_s = JsonList(ddp.result, "epoch_s");
  for (double v : epoch_s) run.train_s += v;
  const std::vector<double> accuracies = JsonList(ddp.result, "test_accuracy");
  if (run.wall_s < 0 || static_cast<int>(epoch_s.size()) != o.epochs ||
      accuracies.empty()) {
    return absl::InternalError(absl::StrCat(
        "no result line from DDP rank 0 in ", ddp.log0, ": ", ddp.result));
  }
  run.accuracy = accuracies.back();
  run.bytes = std::move(ddp.bytes);
  run.detail = absl::StrCat(
      "gloo, ", encoding, " all-reduce, torch ",
      absl::StripSuffix(absl::StripPrefix(JsonField(ddp.result, "torch"), "\""),
                        "\""));
  return run;
}

absl::Status CheckPrerequisites(const TrainHostsOptions& o,
                                local::NetworkTools* tools) {
  SHARDPS_ASSIGN_OR_RETURN(
      *tools, CheckEmulatedBench("shardps-bench train --emulate_hosts",
                                 o.local_binary));
  if (o.rows.empty() || o.epochs < 1) {
    return absl::InvalidArgumentError("give at least one row and one epoch");
  }
  return absl::OkStatus();
}

struct RowResult {
  TrainHostsRow row;
  SideRun shardps, ddp;
  TcpExchangeRun raw;  // the raw TCP exchange
};

// The bytes the busiest card would carry with the same bytes spread evenly:
// the larger of the servers' and the workers' mean (each host's larger
// direction).
double BalancedBytes(const std::vector<HostBytes>& bytes) {
  double most = 0;
  for (const char* role : {"server-", "worker-"}) {
    double sum = 0;
    int hosts = 0;
    for (const HostBytes& b : bytes) {
      if (!absl::StartsWith(b.name, role)) continue;
      sum += static_cast<double>(std::max(b.sent, b.received));
      ++hosts;
    }
    if (hosts > 0) most = std::max(most, sum / hosts);
  }
  return most;
}

void PrintRow(const TrainHostsOptions& o, int64_t rate,
              const RowResult& result) {
  const TrainHostsRow& row = result.row;
  const double ideal = IdealTimeRatio(row.workers, row.servers);
  absl::PrintF("%d workers x %d servers, %s, %s:\n", row.workers, row.servers,
               FormatLinkRate(rate), row.compression);
  for (const auto& [label, side] :
       {std::pair<const char*, const SideRun*>{"shardps", &result.shardps},
        {"DDP", &result.ddp}}) {
    std::string busiest;
    const int64_t most = BusiestBytes(side->bytes, &busiest);
    absl::PrintF(
        "  %-7s train %.1f s (%d epoch(s), %.0f samples/s), test accuracy "
        "%.4f; %s\n",
        label, side->train_s, o.epochs,
        o.epochs * kSamplesPerEpoch / side->train_s, side->accuracy,
        side->detail);
    absl::PrintF(
        "          busiest link %s %s, %.2f of the link over the training "
        "time\n          sent / received: %s\n",
        busiest, local::FormatBytes(most), most * 8.0 / rate / side->train_s,
        HostBytesText(side->bytes));
  }
  std::string unused;
  // A step against the time its bytes need at the link's rate: the busiest
  // card's, and those of a perfectly balanced shard map.
  const double steps = Steps(o);
  const double step_ms = result.shardps.train_s * 1e3 / steps;
  const double busiest_ms =
      BusiestBytes(result.shardps.bytes, &unused) * 8e3 / rate / steps;
  const double balanced_ms =
      BalancedBytes(result.shardps.bytes) * 8e3 / rate / steps;
  const double raw_ms = absl::ToDoubleMilliseconds(result.raw.step);
  absl::PrintF(
      "  shardps a step %.1f ms: %.2fx the bytes-over-rate bound of its "
      "busiest card (%.1f ms), %.2fx that of a balanced shard map "
      "(%.1f ms)\n",
      step_ms, step_ms / busiest_ms, busiest_ms, step_ms / balanced_ms,
      balanced_ms);
  absl::PrintF(
      "  raw TCP, the same bytes in the same chunks on the same hosts, no "
      "compute: a step %.1f ms, %.2fx the busiest card's bound (its cards "
      "retransmitted up to %.2f %% of their TCP segments); shardps %.2fx "
      "it\n",
      raw_ms, raw_ms / busiest_ms, result.raw.most_retransmitted,
      step_ms / raw_ms);
  // Whether the machine's cores, not the links, set the pace: over each
  // whole run (start-up and evaluation included), how many of the cores
  // were busy on average (/proc/stat: the processes and the kernel's packet
  // processing), and the core time and context switches a step costs at
  // that rate.
  const double cores = std::thread::hardware_concurrency();
  // Per second of the run: busy cores, or context switches.
  auto per_second = [](const SideRun& side, double amount) {
    return side.elapsed_s > 0 && amount >= 0 ? amount / side.elapsed_s : 0.0;
  };
  const double ddp_step_ms = result.ddp.train_s * 1e3 / steps;
  auto per_raw_step = [&](double amount) {
    return result.raw.steps > 0 && amount >= 0 ? amount / result.raw.steps
                                               : 0.0;
  };
  absl::PrintF(
      "  CPU, this machine's %.0f cores: busy %.2f during shardps (%.1f "
      "core-ms and %.0f context switches a step), %.2f during DDP (%.1f "
      "core-ms and %.0f context switches a step); the raw TCP exchange %.1f "
      "core-ms and %.0f context switches a step\n",
      cores, per_second(result.shardps, result.shardps.load.busy_s),
      per_second(result.shardps, result.shardps.load.busy_s) * step_ms,
      per_second(result.shardps, result.shardps.load.context_switches) *
          step_ms / 1e3,
      per_second(result.ddp, result.ddp.load.busy_s),
      per_second(result.ddp, result.ddp.load.busy_s) * ddp_step_ms,
      per_second(result.ddp, result.ddp.load.context_switches) * ddp_step_ms /
          1e3,
      per_raw_step(result.raw.load.busy_s) * 1e3,
      per_raw_step(result.raw.load.context_switches));
  absl::PrintF(
      "  shardps / DDP time %.2f; ideal when link-bound %.2f (a perfectly "
      "balanced shard map), %.2f (the busiest cards' bytes measured)\n",
      result.shardps.train_s / result.ddp.train_s, ideal,
      static_cast<double>(BusiestBytes(result.shardps.bytes, &unused)) /
          BusiestBytes(result.ddp.bytes, &unused));
}

void PrintTable(
    const TrainHostsOptions& o, int64_t rate,
    const std::vector<RowResult>& results,
    const std::map<std::pair<int, std::string>, SideRun>& ddp_runs) {
  absl::PrintF(
      "\n| W x S | link | encoding | shardps s | DDP s | shardps/DDP | ideal "
      "| busiest bytes ratio | step shardps / raw TCP ms | samples/s shardps "
      "/ DDP | accuracy shardps / DDP | busiest link shardps / DDP (fraction "
      "of %s) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      FormatLinkRate(rate));
  const double steps = Steps(o);
  for (const RowResult& r : results) {
    std::string a, b;
    const double step_ms = r.shardps.train_s * 1e3 / steps;
    const int64_t sa = BusiestBytes(r.shardps.bytes, &a);
    const int64_t sb = BusiestBytes(r.ddp.bytes, &b);
    absl::PrintF(
        "| %dx%d | %s | %s | %.1f | %.1f | %.2f | %.2f | %.2f | %.1f / %.1f "
        "(%.2f) | %.0f / %.0f | %.4f / "
        "%.4f | %s %s (%.2f) / %s %s (%.2f) |\n",
        r.row.workers, r.row.servers, o.link, r.row.compression,
        r.shardps.train_s, r.ddp.train_s, r.shardps.train_s / r.ddp.train_s,
        IdealTimeRatio(r.row.workers, r.row.servers),
        static_cast<double>(sa) / sb, step_ms,
        absl::ToDoubleMilliseconds(r.raw.step),
        step_ms / absl::ToDoubleMilliseconds(r.raw.step),
        o.epochs * kSamplesPerEpoch / r.shardps.train_s,
        o.epochs * kSamplesPerEpoch / r.ddp.train_s, r.shardps.accuracy,
        r.ddp.accuracy, a, local::FormatBytes(sa),
        sa * 8.0 / rate / r.shardps.train_s, b, local::FormatBytes(sb),
        sb * 8.0 / rate / r.ddp.train_s);
  }
  // DDP's fp16 hook sums in fp16 on the CPU, which can cost more than the
  // bytes it saves: compare a bf16 row with DDP's fp32 too, when it ran.
  for (const RowResult& r : results) {
    const auto fp32 = ddp_runs.find({r.row.workers, "fp32"});
    if (r.row.compression == "bf16" && fp32 != ddp_runs.end()) {
      absl::PrintF("%dx%d bf16: shardps / DDP fp32 (%.1f s) %.2f\n",
                   r.row.workers, r.row.servers, fp32->second.train_s,
                   r.shardps.train_s / fp32->second.train_s);
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<TrainHostsRow>> ParseTrainHostsRows(
    const std::string& rows, const std::string& compressions) {
  std::vector<TrainHostsRow> out;
  for (absl::string_view shape : absl::StrSplit(rows, ',')) {
    const std::vector<absl::string_view> ws = absl::StrSplit(shape, 'x');
    TrainHostsRow row;
    if (ws.size() != 2 || !absl::SimpleAtoi(ws[0], &row.workers) ||
        !absl::SimpleAtoi(ws[1], &row.servers) || row.workers < 2 ||
        row.servers < 1 ||
        1 + row.workers + row.servers > local::kMaxEmulatedHosts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rows: \"", shape,
          "\" is not WORKERSxSERVERS with at least 2 workers and 1 server "
          "(e.g. 4x2)"));
    }
    for (absl::string_view c : absl::StrSplit(compressions, ',')) {
      if (c != "fp32" && c != "bf16" && c != "topk") {
        return absl::InvalidArgumentError(
            absl::StrCat("--compressions: \"", c,
                         "\" is not fp32, bf16 or topk (--emulate_hosts)"));
      }
      row.compression = std::string(c);
      out.push_back(row);
    }
  }
  return out;
}

RowEncodings EncodingsOf(const TrainHostsRow& row) {
  if (row.compression == "bf16") return {"bf16", "bf16", "fp16"};
  if (row.compression == "topk") return {"topk:0.01", "bf16", "fp32"};
  return {};
}

double IdealTimeRatio(int workers, int servers) {
  const double ps = std::max(1.0, static_cast<double>(workers) / servers);
  const double ring = 2.0 * (workers - 1) / workers;
  return ps / ring;
}

// mlp:784-512-256-10's fp32 bytes: weights and biases.
constexpr int64_t kMainJobModelBytes =
    4 * (784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);

absl::Status RunTrainHostsBench(const TrainHostsOptions& o) {
  local::NetworkTools tools;
  SHARDPS_RETURN_IF_ERROR(CheckPrerequisites(o, &tools));
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, ParseLinkRate(o.link));
  absl::PrintF(
      "train on emulated hosts: mlp:784-512-256-10 on Fashion-MNIST, global "
      "batch 256, SGD 0.1 momentum 0.9 cosine, %d epochs, 1 BLAS thread a "
      "process; each host's link %s each way\n"
      "shardps: shardps-local --emulate_hosts (a host per coordinator, server "
      "and worker), %s chunks; DDP: a host per rank\n\n",
      o.epochs, FormatLinkRate(rate),
      o.chunk_kib > 0
          ? absl::StrCat(o.chunk_kib, " KiB")
          : absl::StrCat(
                "automatic (", AutoChunkBytes(kMainJobModelBytes, rate) >> 10,
                " KiB; ", AutoChunkBytes(kMainJobModelBytes, rate, 2) >> 10,
                " KiB with bf16 both ways, the same bytes on the wire: the "
                "workers get --link_rate)"));
  std::vector<RowResult> results;
  // DDP's run depends on the workers and its encoding only (not on the
  // servers): each runs once, its figures shared by the rows that need it.
  std::map<std::pair<int, std::string>, SideRun> ddp_runs;
  for (const TrainHostsRow& row : o.rows) {
    RowResult result;
    result.row = row;
    SHARDPS_ASSIGN_OR_RETURN(result.shardps, RunShardps(o, row));
    SHARDPS_ASSIGN_OR_RETURN(
        result.raw, RunRawExchange(o, row, rate, result.shardps, tools));
    const std::pair<int, std::string> key(row.workers, EncodingsOf(row).ddp);
    if (!ddp_runs.count(key)) {
      SHARDPS_ASSIGN_OR_RETURN(ddp_runs[key], RunDdp(o, row, tools));
    }
    result.ddp = ddp_runs[key];
    PrintRow(o, rate, result);
    std::fflush(stdout);  // a row at a time, also into a file
    results.push_back(std::move(result));
  }
  PrintTable(o, rate, results, ddp_runs);
  return absl::OkStatus();
}

}  // namespace shardps::bench
