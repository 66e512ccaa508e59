// shardps-bench train --emulate_hosts. Each row runs the main job through
// shardps-local --emulate_hosts (the user's path: its final line, metrics.csv
// and the bytes it prints per host), then DDP: EmulatedHosts makes one host
// per rank (10.213.0.1 is rank 0, where gloo's rendezvous listens) and each
// rank of tests/bench/torch/mlp_ddp.py runs in its host's namespace. Times
// are the sums of the epochs' training loops on both sides (rank 0's; no
// start-up, no evaluation), so the ratio compares the same work.
#include "tests/bench/train_hosts_bench.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "deploy/local/child_process.h"
#include "deploy/local/emulated_hosts.h"
#include "tests/bench/run_command.h"
#include "tests/testing/daemon.h"

namespace shardps::bench {
namespace {

// The main job's steps: 60000 images in global batches of 256.
constexpr int64_t kSamplesPerEpoch = 60000 / 256 * 256;
// Where rank 0 listens for the others (its own namespace: always free).
constexpr int kMasterPort = 29500;
// A DDP row that runs longer than this is stuck (a lost rank leaves gloo
// waiting for 30 minutes).
constexpr absl::Duration kDdpTimeoutPerEpoch = absl::Minutes(5);

struct HostBytes {
  std::string name;
  int64_t sent = 0;
  int64_t received = 0;
};

struct SideRun {
  double train_s = 0;  // sum of the epochs' training loops
  double wall_s = 0;   // shardps-local's final wall_s; DDP: rank 0's wall_s
  double accuracy = 0;
  std::vector<HostBytes> bytes;
  std::string detail;  // the final line, or the DDP ranks' encoding
};

std::string FormatBytes(double bytes) {
  if (bytes >= (1 << 30)) return absl::StrFormat("%.2f GiB", bytes / (1 << 30));
  if (bytes >= (1 << 20)) return absl::StrFormat("%.1f MiB", bytes / (1 << 20));
  return absl::StrFormat("%.1f KiB", bytes / 1024);
}

// "1.16 GiB" as shardps-local prints it (FormatLinkBytes), in bytes.
bool ParseBytes(absl::string_view number, absl::string_view unit,
                int64_t* bytes) {
  double v = 0;
  if (!absl::SimpleAtod(number, &v)) return false;
  const std::map<absl::string_view, double> units = {
      {"B", 1}, {"KiB", 1024}, {"MiB", 1 << 20}, {"GiB", 1 << 30}};
  const auto it = units.find(unit);
  if (it == units.end()) return false;
  *bytes = static_cast<int64_t>(v * it->second);
  return true;
}

// The per-host lines after "bytes over each host's link": "  worker-0
// 10.213.0.4   sent   1.6 MiB  received   1.7 MiB".
std::vector<HostBytes> ParseLinkBytes(const std::string& out) {
  std::vector<HostBytes> hosts;
  bool in_table = false;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "bytes over each host's link")) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    HostBytes h;
    if (f.size() != 8 || f[2] != "sent" || f[5] != "received" ||
        !ParseBytes(f[3], f[4], &h.sent) ||
        !ParseBytes(f[6], f[7], &h.received)) {
      break;
    }
    h.name = std::string(f[0]);
    hosts.push_back(h);
  }
  return hosts;
}

// Column `name` of metrics.csv's rows, as numbers.
absl::StatusOr<std::vector<double>> MetricsColumn(const std::string& path,
                                                  const std::string& name) {
  std::ifstream csv(path);
  std::string line;
  if (!std::getline(csv, line)) {
    return absl::InternalError(absl::StrCat("no metrics in ", path));
  }
  const std::vector<std::string> header = absl::StrSplit(line, ',');
  const auto at = std::find(header.begin(), header.end(), name);
  if (at == header.end()) {
    return absl::InternalError(absl::StrCat(path, " has no column ", name));
  }
  std::vector<double> values;
  while (std::getline(csv, line)) {
    const std::vector<std::string> f = absl::StrSplit(line, ',');
    double v = 0;
    const size_t i = at - header.begin();
    if (i < f.size() && absl::SimpleAtod(f[i], &v)) values.push_back(v);
  }
  return values;
}

absl::StatusOr<SideRun> RunShardps(const TrainHostsOptions& o,
                                   const TrainHostsRow& row) {
  const std::string dir = testing::MakeTempDir("shardps-bench-hosts");
  std::string command =
      absl::StrCat(o.local_binary, " --emulate_hosts --link=", o.link,
                   " --run_dir=", dir, " --epochs=", o.epochs,
                   " --workers=", row.workers, " --servers=", row.servers);
  if (row.compression == "bf16") {
    absl::StrAppend(&command, " --compression=bf16 --weight_encoding=bf16");
  }
  SHARDPS_ASSIGN_OR_RETURN(std::string out,
                           RunCommand(absl::StrCat(command, " 2>&1")));
  SideRun run;
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
                           MetricsColumn(csv, "epoch_s"));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> accuracy,
                           MetricsColumn(csv, "test_accuracy"));
  if (static_cast<int>(epoch_s.size()) != o.epochs || accuracy.empty() ||
      run.bytes.size() != static_cast<size_t>(1 + row.servers + row.workers)) {
    return absl::InternalError(absl::StrCat(
        "`", command, "`: expected ", o.epochs, " epochs in ", csv, " and ",
        1 + row.servers + row.workers, " hosts' bytes; its output:\n", out));
  }
  for (double s : epoch_s) run.train_s += s;
  run.accuracy = accuracy.back();
  return run;
}

// The numbers of a flat JSON list, "key": [1.5, 2.5].
std::vector<double> JsonList(const std::string& json, const std::string& key) {
  const std::string text = JsonField(json, key);
  absl::string_view list = text;
  std::vector<double> values;
  if (!absl::ConsumePrefix(&list, "[") || !absl::ConsumeSuffix(&list, "]")) {
    return values;
  }
  for (absl::string_view part :
       absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    double v = 0;
    if (absl::SimpleAtod(part, &v)) values.push_back(v);
  }
  return values;
}

// Kills and reaps the ranks whose `done` is false.
void KillRanks(const std::vector<pid_t>& pids, const std::vector<bool>& done) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (done[r]) continue;
    kill(pids[r], SIGKILL);
    waitpid(pids[r], nullptr, 0);
  }
}

// Waits for every rank; the first that fails has the others killed.
absl::Status WaitForRanks(std::vector<pid_t> pids,
                          const std::vector<std::string>& logs,
                          absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<bool> done(pids.size(), false);
  absl::Status status;
  for (size_t left = pids.size(); left > 0 && status.ok();) {
    for (size_t r = 0; r < pids.size() && status.ok(); ++r) {
      int wait_status = 0;
      if (done[r] || waitpid(pids[r], &wait_status, WNOHANG) != pids[r]) {
        continue;
      }
      done[r] = true;
      --left;
      if (!local::ExitedCleanly(wait_status)) {
        status = absl::InternalError(absl::StrCat(
            "DDP rank ", r, " ended with ", local::DescribeExit(wait_status),
            "; the end of ", logs[r], ":\n",
            absl::StrJoin(local::LastLines(logs[r], 20), "\n")));
      }
    }
    if (status.ok() && left > 0 && absl::Now() > deadline) {
      status = absl::InternalError(
          absl::StrCat("DDP ranks still running after ",
                       absl::FormatDuration(timeout), "; logs: ", logs[0]));
    }
    // Polled: the ranks are children of this thread alone, and a tenth of
    // a second is nothing against a run of many seconds.
    if (status.ok() && left > 0) absl::SleepFor(absl::Milliseconds(100));
  }
  KillRanks(pids, done);
  return status;
}

absl::StatusOr<SideRun> RunDdp(const TrainHostsOptions& o,
                               const TrainHostsRow& row,
                               const local::NetworkTools& tools) {
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, local::ParseLinkRate(o.link));
  std::vector<local::EmulatedHost> hosts;
  for (int r = 0; r < row.workers; ++r) {
    hosts.push_back(
        {absl::StrCat("rank-", r), absl::StrCat("10.213.0.", 1 + r)});
  }
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<local::EmulatedHosts> made,
      local::EmulatedHosts::Create(hosts, local::TbfShapeFor(rate), tools));
  const std::string dir = testing::MakeTempDir("shardps-bench-ddp");
  const std::string encoding = row.compression == "bf16" ? "fp16" : "fp32";
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  absl::Status spawned;
  for (int r = 0; r < row.workers && spawned.ok(); ++r) {
    logs.push_back(absl::StrCat(dir, "/rank-", r, ".log"));
    absl::StatusOr<pid_t> pid = local::SpawnWithLog(
        "/usr/bin/python3",
        {o.torch_script, absl::StrCat("--processes=", row.workers),
         absl::StrCat("--rank=", r),
         absl::StrCat("--master=", hosts[0].address, ":", kMasterPort),
         "--ifname=eth0", "--threads=1", absl::StrCat("--epochs=", o.epochs),
         absl::StrCat("--data=", o.data_dir),
         absl::StrCat("--compression=", encoding)},
        logs.back(), /*append=*/false, /*env=*/nullptr,
        made->NamespaceFd(hosts[r].name));
    if (pid.ok()) {
      pids.push_back(*pid);
    } else {
      spawned = pid.status();
    }
  }
  if (!spawned.ok()) {
    // The ranks started would wait for the missing one.
    KillRanks(pids, std::vector<bool>(pids.size(), false));
    return spawned;
  }
  SHARDPS_RETURN_IF_ERROR(
      WaitForRanks(pids, logs, o.epochs * kDdpTimeoutPerEpoch));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<local::HostLinkBytes> link_bytes,
                           made->Bytes());
  const std::vector<std::string> last = local::LastLines(logs[0], 1);
  const std::string json = last.empty() ? "" : last.back();
  SideRun run;
  run.wall_s = JsonNumber(json, "wall_s");
  const std::vector<double> epoch_s = JsonList(json, "epoch_s");
  for (double v : epoch_s) run.train_s += v;
  const std::vector<double> accuracies = JsonList(json, "test_accuracy");
  if (run.wall_s < 0 || static_cast<int>(epoch_s.size()) != o.epochs ||
      accuracies.empty()) {
    return absl::InternalError(absl::StrCat(
        "no result line from DDP rank 0 in ", logs[0], ": ", json));
  }
  run.accuracy = accuracies.back();
  for (const local::HostLinkBytes& b : link_bytes) {
    run.bytes.push_back({b.name, b.sent, b.received});
  }
  run.detail = absl::StrCat(
      "gloo, ", encoding, " all-reduce, torch ",
      absl::StripSuffix(absl::StripPrefix(JsonField(json, "torch"), "\""),
                        "\""));
  return run;
}

// The busiest card: its larger direction, in bytes.
int64_t BusiestBytes(const std::vector<HostBytes>& bytes, std::string* name) {
  int64_t most = 0;
  for (const HostBytes& b : bytes) {
    if (std::max(b.sent, b.received) > most) {
      most = std::max(b.sent, b.received);
      *name = b.name;
    }
  }
  return most;
}

// "worker-0 0.96/0.96 GiB, ...": each host's sent/received.
std::string HostBytesText(const std::vector<HostBytes>& bytes) {
  std::vector<std::string> parts;
  for (const HostBytes& b : bytes) {
    parts.push_back(absl::StrCat(b.name, " ", FormatBytes(b.sent), " / ",
                                 FormatBytes(b.received)));
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status CheckPrerequisites(const TrainHostsOptions& o,
                                local::NetworkTools* tools) {
#if !defined(NDEBUG) || !defined(__OPTIMIZE__)
  return absl::FailedPreconditionError(
      "shardps-bench train --emulate_hosts: this build is unoptimized or has "
      "assertions on; its times would not be the job's. Build with "
      "deploy/local/build.sh (CMAKE_BUILD_TYPE=Release)");
#endif
  SHARDPS_ASSIGN_OR_RETURN(
      *tools, local::FindNetworkTools("shardps-bench train --emulate_hosts"));
  if (access(o.local_binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(o.local_binary, " is not there: build shardps-local"));
  }
  if (!RunCommand("/usr/bin/python3 -c 'import torch' 2>&1").ok()) {
    return absl::FailedPreconditionError(
        "shardps-bench train --emulate_hosts compares with PyTorch DDP: "
        "apt-get install python3-torch");
  }
  if (o.rows.empty() || o.epochs < 1) {
    return absl::InvalidArgumentError("give at least one row and one epoch");
  }
  return absl::OkStatus();
}

struct RowResult {
  TrainHostsRow row;
  SideRun shardps, ddp;
};

void PrintRow(const TrainHostsOptions& o, int64_t rate,
              const RowResult& result) {
  const TrainHostsRow& row = result.row;
  const double ideal = IdealTimeRatio(row.workers, row.servers);
  absl::PrintF("%d workers x %d servers, %s, %s:\n", row.workers, row.servers,
               local::FormatLinkRate(rate), row.compression);
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
        busiest, FormatBytes(most), most * 8.0 / rate / side->train_s,
        HostBytesText(side->bytes));
  }
  std::string unused;
  absl::PrintF(
      "  shardps / DDP time %.2f; ideal when link-bound %.2f (a perfectly "
      "balanced shard map), %.2f (the busiest cards' bytes measured)\n",
      result.shardps.train_s / result.ddp.train_s, ideal,
      static_cast<double>(BusiestBytes(result.shardps.bytes, &unused)) /
          BusiestBytes(result.ddp.bytes, &unused));
}

void PrintTable(const TrainHostsOptions& o, int64_t rate,
                const std::vector<RowResult>& results) {
  absl::PrintF(
      "\n| W x S | link | encoding | shardps s | DDP s | shardps/DDP | ideal "
      "| busiest bytes ratio | samples/s shardps / DDP | accuracy shardps / "
      "DDP | busiest link shardps / DDP (fraction of %s) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n",
      local::FormatLinkRate(rate));
  for (const RowResult& r : results) {
    std::string a, b;
    const int64_t sa = BusiestBytes(r.shardps.bytes, &a);
    const int64_t sb = BusiestBytes(r.ddp.bytes, &b);
    absl::PrintF(
        "| %dx%d | %s | %s | %.1f | %.1f | %.2f | %.2f | %.2f | %.0f / %.0f "
        "| %.4f / "
        "%.4f | %s %s (%.2f) / %s %s (%.2f) |\n",
        r.row.workers, r.row.servers, o.link, r.row.compression,
        r.shardps.train_s, r.ddp.train_s, r.shardps.train_s / r.ddp.train_s,
        IdealTimeRatio(r.row.workers, r.row.servers),
        static_cast<double>(sa) / sb,
        o.epochs * kSamplesPerEpoch / r.shardps.train_s,
        o.epochs * kSamplesPerEpoch / r.ddp.train_s, r.shardps.accuracy,
        r.ddp.accuracy, a, FormatBytes(sa), sa * 8.0 / rate / r.shardps.train_s,
        b, FormatBytes(sb), sb * 8.0 / rate / r.ddp.train_s);
  }
  // DDP's fp16 hook sums in fp16 on the CPU, which can cost more than the
  // bytes it saves: compare a bf16 row with DDP's fp32 too.
  for (const RowResult& r : results) {
    for (const RowResult& fp32 : results) {
      if (r.row.compression == "bf16" && fp32.row.compression == "fp32" &&
          fp32.row.workers == r.row.workers &&
          fp32.row.servers == r.row.servers) {
        absl::PrintF("%dx%d bf16: shardps / DDP fp32 (%.1f s) %.2f\n",
                     r.row.workers, r.row.servers, fp32.ddp.train_s,
                     r.shardps.train_s / fp32.ddp.train_s);
        break;
      }
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
      if (c != "fp32" && c != "bf16") {
        return absl::InvalidArgumentError(
            absl::StrCat("--compressions: \"", c,
                         "\" is not fp32 or bf16 (train --emulate_hosts)"));
      }
      row.compression = std::string(c);
      out.push_back(row);
    }
  }
  return out;
}

double IdealTimeRatio(int workers, int servers) {
  const double ps = std::max(1.0, static_cast<double>(workers) / servers);
  const double ring = 2.0 * (workers - 1) / workers;
  return ps / ring;
}

absl::Status RunTrainHostsBench(const TrainHostsOptions& o) {
  local::NetworkTools tools;
  SHARDPS_RETURN_IF_ERROR(CheckPrerequisites(o, &tools));
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, local::ParseLinkRate(o.link));
  absl::PrintF(
      "train on emulated hosts: mlp:784-512-256-10 on Fashion-MNIST, global "
      "batch 256, SGD 0.1 momentum 0.9 cosine, %d epochs, 1 BLAS thread a "
      "process; each host's link %s each way\n"
      "shardps: shardps-local --emulate_hosts (a host per coordinator, server "
      "and worker); DDP: a host per rank\n\n",
      o.epochs, local::FormatLinkRate(rate));
  std::vector<RowResult> results;
  for (const TrainHostsRow& row : o.rows) {
    RowResult result;
    result.row = row;
    SHARDPS_ASSIGN_OR_RETURN(result.shardps, RunShardps(o, row));
    SHARDPS_ASSIGN_OR_RETURN(result.ddp, RunDdp(o, row, tools));
    PrintRow(o, rate, result);
    results.push_back(std::move(result));
  }
  PrintTable(o, rate, results);
  return absl::OkStatus();
}

}  // namespace shardps::bench
