// shardps-bench torch --emulate_hosts. Each row runs the GPT example under
// shardps-local --emulate_hosts (the user's path: `-- python3 gpt_kjv.py`,
// its progress lines and the bytes it prints per host), then
// tests/bench/torch/ddp_bench.py with one rank in each of W emulated hosts.
// Times are each side's rank 0's, of the steps after the first (which also
// brings every rank the initial weights): the example's step rows
// (metrics.csv, --log_every=1) and ddp_bench.py's steady_s; neither counts
// start-up or evaluation.
#include "tests/bench/torch_hosts_bench.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/link_rate.h"
#include "common/status.h"
#include "deploy/local/emulated_hosts.h"
#include "tests/bench/emulated_ddp.h"
#include "tests/bench/run_command.h"
#include "tests/testing/daemon.h"

namespace shardps::bench {
namespace {

struct Workload {
  const char* name;
  std::string args;  // gpt_kjv.py's, on both sides
  int steps;
  const char* about;
  const char* env = "";  // the shardps side's environment
};

struct SideRun {
  double seconds = 0;  // of the measured steps
  double tokens_per_s = 0;
  double train_loss = 0;  // the mean over the steps
  std::vector<HostBytes> bytes;
};

struct RowResult {
  TrainHostsRow row;
  SideRun shardps, ddp;
};

// The shardps workers' encodings: the torch layer reads them from the
// environment shardps-local passes on.
std::string EncodingEnv(const TrainHostsRow& row) {
  const RowEncodings e = EncodingsOf(row);
  if (e.gradients.empty()) return "";
  return absl::StrCat("SHARDPS_COMPRESSION=", e.gradients,
                      " SHARDPS_WEIGHT_ENCODING=", e.weights, " ");
}

absl::StatusOr<SideRun> RunShardps(const TorchHostsOptions& o,
                                   const Workload& w,
                                   const TrainHostsRow& row) {
  const std::string dir = testing::MakeTempDir("shardps-bench-torch-hosts");
  const std::string command = absl::StrCat(
      w.env, EncodingEnv(row), o.local_binary,
      " --emulate_hosts --link=", o.link, " --run_dir=", dir,
      " --servers=", row.servers, " --workers=", row.workers,
      " -- /usr/bin/python3 ", o.source_dir,
      "/worker/python/examples/gpt_kjv.py --log_every=1 --max_steps=", w.steps,
      " ", w.args, " 2>&1");
  SHARDPS_ASSIGN_OR_RETURN(std::string out, RunCommand(command));
  SideRun run;
  double loss_s = 0, epochs_s = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    double epoch_s = 0, loss = 0;
    if (absl::StartsWith(line, "epoch ") &&
        ProgressField(line, "epoch_s", &epoch_s) &&
        ProgressField(line, "train_loss", &loss)) {
      loss_s += loss * epoch_s;  // epochs of equal steps: equal weights
      epochs_s += epoch_s;
    }
  }
  // The steps after the first, from rank 0's step rows (--log_every=1): the
  // first also waits for the initial weights, which DDP broadcasts before
  // its timing starts.
  const std::string csv = dir + "/gpt_kjv/metrics.csv";
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> steps,
                           CsvColumn(csv, "step", "kind", "step"));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> ms,
                           CsvColumn(csv, "ms_per_step", "kind", "step"));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<double> rate,
                           CsvColumn(csv, "tokens_per_s", "kind", "step"));
  double tokens = 0;
  for (size_t i = 0; i < steps.size() && i < ms.size() && i < rate.size();
       ++i) {
    if (steps[i] < 2) continue;
    run.seconds += ms[i] / 1000;
    tokens += rate[i] * ms[i] / 1000;
  }
  run.bytes = ParseLinkBytes(out);
  if (run.seconds <= 0 || epochs_s <= 0 ||
      run.bytes.size() != static_cast<size_t>(1 + row.servers + row.workers)) {
    return absl::InternalError(
        absl::StrCat("`", command, "`: no step rows in ", csv,
                     ", progress lines or hosts' bytes:\n", Tail(out, 20)));
  }
  run.tokens_per_s = tokens / run.seconds;
  run.train_loss = loss_s / epochs_s;
  return run;
}

absl::StatusOr<SideRun> RunDdp(const TorchHostsOptions& o, const Workload& w,
                               const TrainHostsRow& row,
                               const local::NetworkTools& tools) {
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, ParseLinkRate(o.link));
  const std::vector<std::string> example_args =
      absl::StrSplit(w.args, ' ', absl::SkipEmpty());
  SHARDPS_ASSIGN_OR_RETURN(
      RanksRun ddp,
      RunRanksOnHosts(
          "/usr/bin/python3", rate, row.workers, tools,
          [&](int rank, const std::string& master) {
            std::vector<std::string> argv = {
                absl::StrCat(o.source_dir, "/tests/bench/torch/ddp_bench.py"),
                "--model=gpt",
                absl::StrCat("--steps=", w.steps),
                absl::StrCat("--processes=", row.workers),
                absl::StrCat("--rank=", rank),
                absl::StrCat("--master=", master),
                "--ifname=eth0",
                absl::StrCat("--compression=", EncodingsOf(row).ddp),
                "--"};
            argv.insert(argv.end(), example_args.begin(), example_args.end());
            return argv;
          },
          // A lost rank leaves gloo waiting for 30 minutes.
          absl::Minutes(5) + w.steps * absl::Seconds(10),
          {absl::StrCat("PYTHONPATH=", o.python_path)}));
  SideRun run;
  run.seconds = JsonNumber(ddp.result, "steady_s");
  run.tokens_per_s = JsonNumber(ddp.result, "steady_items_per_s");
  run.train_loss = JsonNumber(ddp.result, "train_loss_mean");
  if (run.seconds <= 0) {
    return absl::InternalError(absl::StrCat(
        "no result line from DDP rank 0 in ", ddp.log0, ": ", ddp.result));
  }
  run.bytes = std::move(ddp.bytes);
  return run;
}

// The busiest card's share of the link over the timed steps, estimated from
// the whole run's bytes: those of steps + 1 exchanges (the initial weights
// are about one more), of which steps - 1 were timed.
double LinkShare(int64_t bytes, int steps, int64_t rate, double seconds) {
  return bytes * (steps - 1.0) / (steps + 1.0) * 8 / rate / seconds;
}

void PrintRow(const TorchHostsOptions& o, int64_t rate, const Workload& w,
              const RowResult& r) {
  absl::PrintF("%s, %d workers x %d servers, %s, %s:\n", w.name, r.row.workers,
               r.row.servers, FormatLinkRate(rate), r.row.compression);
  for (const auto& [label, side] :
       {std::pair<const char*, const SideRun*>{"shardps", &r.shardps},
        {"DDP", &r.ddp}}) {
    std::string busiest;
    const int64_t most = BusiestBytes(side->bytes, &busiest);
    absl::PrintF(
        "  %-7s %.1f s (%d steps after the first, %.0f tokens/s), mean train "
        "loss %.4f; busiest link %s %s in the run, about %.2f of the link "
        "over the timed steps\n          sent / received: %s\n",
        label, side->seconds, w.steps - 1, side->tokens_per_s, side->train_loss,
        busiest, local::FormatBytes(most),
        LinkShare(most, w.steps, rate, side->seconds),
        HostBytesText(side->bytes));
  }
  absl::PrintF(
      "  shardps / DDP time %.2f (DDP %s); ideal when link-bound %.2f\n",
      r.shardps.seconds / r.ddp.seconds, EncodingsOf(r.row).ddp,
      IdealTimeRatio(r.row.workers, r.row.servers));
}

void PrintTable(const TorchHostsOptions& o, int64_t rate,
                const std::vector<std::pair<const Workload*, RowResult>>& all) {
  absl::PrintF(
      "\n| model | W x S | link | encoding (DDP's) | shardps s | DDP s | "
      "shardps/DDP | ideal | tokens/s shardps / DDP | mean train loss "
      "shardps / DDP | busiest link shardps / DDP (about, fraction of %s) "
      "|\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n",
      FormatLinkRate(rate));
  for (const auto& [w, r] : all) {
    std::string a, b;
    const int64_t sa = BusiestBytes(r.shardps.bytes, &a);
    const int64_t sb = BusiestBytes(r.ddp.bytes, &b);
    absl::PrintF(
        "| %s | %dx%d | %s | %s (%s) | %.1f | %.1f | %.2f | %.2f | %.0f / "
        "%.0f | %.4f / %.4f | %s %.2f / %s %.2f |\n",
        w->name, r.row.workers, r.row.servers, o.link, r.row.compression,
        EncodingsOf(r.row).ddp, r.shardps.seconds, r.ddp.seconds,
        r.shardps.seconds / r.ddp.seconds,
        IdealTimeRatio(r.row.workers, r.row.servers), r.shardps.tokens_per_s,
        r.ddp.tokens_per_s, r.shardps.train_loss, r.ddp.train_loss, a,
        LinkShare(sa, w->steps, rate, r.shardps.seconds), b,
        LinkShare(sb, w->steps, rate, r.ddp.seconds));
  }
}

}  // namespace

absl::Status RunTorchHostsBench(const TorchHostsOptions& o) {
  SHARDPS_ASSIGN_OR_RETURN(
      local::NetworkTools tools,
      CheckEmulatedBench("shardps-bench torch --emulate_hosts",
                         o.local_binary));
  if (o.rows.empty()) {
    return absl::InvalidArgumentError("give at least one row (--rows)");
  }
  // Every workload is gpt_kjv.py, which trains on Debian's KJV text: said
  // here, before any host is made, rather than by a failing worker.
  if (!RunCommand("command -v bible >/dev/null 2>&1").ok()) {
    return absl::FailedPreconditionError(
        "shardps-bench torch --emulate_hosts trains gpt_kjv.py on the King "
        "James Bible, and the `bible` program is missing: apt-get install "
        "bible-kjv bible-kjv-text");
  }
  SHARDPS_ASSIGN_OR_RETURN(int64_t rate, ParseLinkRate(o.link));
  // The example's recipe clips the global norm at 1.0 (two-phase steps: no
  // weight can come back before every gradient is in, unless it is a
  // speculative one the step does not clip); the wide GPT also runs
  // without clipping, to show what that barrier costs, and clipped at a
  // bound its norm falls under after a few steps, as a long run's does at
  // 1.0, where the speculative weights are kept.
  const std::string wide =
      "--dim=512 --layers=4 --heads=8 --seq_len=32 --batch_size=8";
  const Workload workloads[] = {
      {"gpt", "", o.gpt_steps,
       "gpt_kjv.py as it is: 5 layers of width 128 (1.1 M parameters, "
       "4.2 MB of fp32 gradients a step), global batch 16 x 64 bytes, "
       "clipped at 1.0"},
      {"gpt-wide", wide, o.wide_steps,
       "gpt_kjv.py --dim=512 --layers=4 --heads=8 --seq_len=32 "
       "--batch_size=8: 12.8 M parameters (51 MB of fp32 gradients a step) "
       "for 256 tokens a step, so that the link dominates; clipped at 1.0"},
      {"gpt-wide-noclip", wide + " --max_grad_norm=0", o.wide_steps,
       "the wide GPT without clipping (--max_grad_norm=0)"},
      {"gpt-wide-clip5", wide + " --max_grad_norm=5", o.wide_steps,
       "the wide GPT clipped at 5.0: its norm (18.8, 13.1, 6.8, 5.5 at "
       "steps 1-4, then 1.4-4.2) is clipped at the first 4 steps only, as "
       "a long run's norm at 1.0 is in most of its steps after the first "
       "thousands; the servers' speculative weights are kept from step 6 "
       "on"},
      {"gpt-wide-clip5-nospec", wide + " --max_grad_norm=5", o.wide_steps,
       "gpt-wide-clip5 with the workers' speculative weights off "
       "(SHARDPS_SPECULATIVE_WEIGHTS=0): the weights come after the "
       "decision",
       "SHARDPS_SPECULATIVE_WEIGHTS=0 "},
  };
  for (const std::string& name : o.workloads) {
    if (std::none_of(std::begin(workloads), std::end(workloads),
                     [&](const Workload& w) { return name == w.name; })) {
      std::vector<std::string> names;
      for (const Workload& w : workloads) names.push_back(w.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown workload \"", name,
          "\" (--workloads); one of: ", absl::StrJoin(names, ", ")));
    }
  }
  absl::PrintF(
      "torch on emulated hosts: each host's link %s each way; shardps: "
      "shardps-local --emulate_hosts -- python3 gpt_kjv.py (a host per "
      "coordinator, server and worker); DDP: ddp_bench.py, gloo, a host per "
      "rank; AdamW, bf16 autocast, 1 thread a process on both sides\n\n",
      FormatLinkRate(rate));
  std::vector<std::pair<const Workload*, RowResult>> all;
  for (const Workload& w : workloads) {
    if (!o.workloads.empty() &&
        std::find(o.workloads.begin(), o.workloads.end(), w.name) ==
            o.workloads.end()) {
      continue;
    }
    if (w.steps < 2) {
      absl::PrintF("%s: skipped (%d steps; the first is not timed)\n", w.name,
                   w.steps);
      continue;
    }
    absl::PrintF("%s: %s; %d steps, the first not timed\n", w.name, w.about,
                 w.steps);
    // DDP depends on the workers and its encoding only: once each.
    std::map<std::pair<int, std::string>, SideRun> ddp_runs;
    for (const TrainHostsRow& row : o.rows) {
      RowResult r;
      r.row = row;
      SHARDPS_ASSIGN_OR_RETURN(r.shardps, RunShardps(o, w, row));
      const std::pair<int, std::string> key(row.workers, EncodingsOf(row).ddp);
      if (!ddp_runs.count(key)) {
        SHARDPS_ASSIGN_OR_RETURN(ddp_runs[key], RunDdp(o, w, row, tools));
      }
      r.ddp = ddp_runs[key];
      PrintRow(o, rate, w, r);
      std::fflush(stdout);  // a row at a time, also into a file
      all.push_back({&w, std::move(r)});
    }
  }
  PrintTable(o, rate, all);
  return absl::OkStatus();
}

}  // namespace shardps::bench
