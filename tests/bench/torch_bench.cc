// shardps-bench torch: each example trains --steps global steps twice in the
// same run, through shardps-local (2 servers, 2 workers) and through
// tests/bench/torch/ddp_bench.py; the figure is the ratio of the time of
// those steps, shardps / DDP, as each side's rank 0 measures it.
#include "tests/bench/torch_bench.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/bench/run_command.h"
#include "tests/testing/daemon.h"

namespace shardps::bench {
namespace {

struct Workload {
  const char* name;    // ddp_bench.py --model
  const char* script;  // under worker/python/examples
  const char* items;   // what the examples count per second
  int steps;
};

struct Timing {
  double seconds = 0;  // of the measured steps
  double items_per_s = 0;
};

absl::StatusOr<Timing> RunDdp(const TorchOptions& o, const Workload& w) {
  absl::StatusOr<std::string> out = RunCommand(absl::StrCat(
      "PYTHONPATH=", o.python_path, " ", o.python, " ", o.source_dir,
      "/tests/bench/torch/ddp_bench.py --model=", w.name, " --steps=", w.steps,
      " 2>&1"));
  if (!out.ok()) return out.status();
  const size_t at = out->rfind("\n{");
  const std::string json = out->substr(at == std::string::npos ? 0 : at + 1);
  Timing t{JsonNumber(json, "wall_s"), JsonNumber(json, "items_per_s")};
  if (t.seconds <= 0) {
    return absl::InternalError(
        absl::StrCat("no timings from ddp_bench.py:\n", Tail(*out, 20)));
  }
  absl::PrintF("  DDP (torch %s, BLAS %s): %.2f s, %.0f %s/s\n",
               JsonField(json, "torch"), JsonField(json, "blas"), t.seconds,
               t.items_per_s, w.items);
  return t;
}

// The example under shardps-local; sums epoch_s and the items of the progress
// lines rank 0 prints (evaluation is outside epoch_s on both sides).
absl::StatusOr<Timing> RunShardps(const TorchOptions& o, const Workload& w,
                                  const std::string& extra = "") {
  const std::string dir = testing::MakeTempDir("shardps-bench-torch");
  absl::StatusOr<std::string> out = RunCommand(absl::StrCat(
      o.local_binary, " --run_dir=", dir, " --servers=2 --workers=2 -- ",
      o.python, " ", o.source_dir, "/worker/python/examples/", w.script,
      " --max_steps=", w.steps, extra, " 2>&1"));
  if (!out.ok()) return out.status();
  Timing t;
  double items = 0;
  for (absl::string_view line : absl::StrSplit(*out, '\n')) {
    double epoch_s = 0, rate = 0;
    if (!absl::StartsWith(line, "epoch ") ||
        !ProgressField(line, "epoch_s", &epoch_s) ||
        !ProgressField(line, absl::StrCat(w.items, "/s"), &rate)) {
      continue;
    }
    t.seconds += epoch_s;
    items += rate * epoch_s;
  }
  if (t.seconds <= 0) {
    return absl::InternalError(
        absl::StrCat("no progress lines from shardps-local (run dir ", dir,
                     "):\n", Tail(*out, 20)));
  }
  t.items_per_s = items / t.seconds;
  absl::PrintF(
      "  shardps 2 servers x 2 workers: %.2f s, %.0f %s/s (run dir %s)\n",
      t.seconds, t.items_per_s, w.items, dir);
  return t;
}

// shardps with clipping at o.clip_grad_norm and without, alternating,
// o.rounds each; the fastest of each side.
absl::Status CompareClipping(const TorchOptions& o, const Workload& w) {
  absl::StatusOr<Timing> on, off;
  const std::string bound = absl::StrCat(" --max_grad_norm=", o.clip_grad_norm);
  for (int round = 0; round < std::max(1, o.rounds); ++round) {
    absl::StatusOr<Timing> a = RunShardps(o, w, " --max_grad_norm=0");
    if (!a.ok()) return a.status();
    if (!off.ok() || a->seconds < off->seconds) off = a;
    absl::StatusOr<Timing> b = RunShardps(o, w, bound);
    if (!b.ok()) return b.status();
    if (!on.ok() || b->seconds < on->seconds) on = b;
  }
  absl::PrintF(
      "  clipping (--max_grad_norm=%g: two-phase steps), fastest of %d runs "
      "each: %.2f s on, %.2f s off: cost %+.1f%% (%s/s %.0f vs %.0f)\n",
      o.clip_grad_norm, std::max(1, o.rounds), on->seconds, off->seconds,
      100 * (on->seconds / off->seconds - 1), w.items, on->items_per_s,
      off->items_per_s);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunTorchBench(const TorchOptions& o) {
  if (!RunCommand(absl::StrCat(o.python, " -c 'import torch' 2>&1")).ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        o.python, " cannot import torch (apt-get install python3-torch)"));
  }
  const Workload workloads[] = {
      {"cnn", "cnn_fashion_mnist.py", "samples", o.cnn_steps},
      {"gpt", "gpt_kjv.py", "tokens", o.gpt_steps},
  };
  std::vector<std::string> failed;
  for (const Workload& w : workloads) {
    if (w.steps <= 0) {
      absl::PrintF("torch %s: skipped (0 steps)\n", w.name);
      continue;
    }
    absl::PrintF("torch %s: %s, %d steps, each side's rank 0 timing them\n",
                 w.name, w.script, w.steps);
    absl::StatusOr<Timing> ddp, shardps;
    for (int round = 0; round < std::max(1, o.rounds); ++round) {
      absl::StatusOr<Timing> d = RunDdp(o, w);
      if (!d.ok() || !ddp.ok() || d->seconds < ddp->seconds) ddp = d;
      absl::StatusOr<Timing> s = RunShardps(o, w);
      if (!s.ok() || !shardps.ok() || s->seconds < shardps->seconds) {
        shardps = s;
      }
      if (!ddp.ok() || !shardps.ok()) break;
    }
    if (!ddp.ok()) {
      absl::PrintF("  DDP: FAILED\n%s\n", Tail(ddp.status().message(), 20));
      failed.push_back(absl::StrCat(w.name, " DDP"));
    }
    if (!shardps.ok()) {
      absl::PrintF("  shardps: FAILED\n%s\n",
                   Tail(shardps.status().message(), 20));
      failed.push_back(absl::StrCat(w.name, " shardps"));
    }
    if (ddp.ok() && shardps.ok()) {
      absl::PrintF(
          "  ratio = shardps time / DDP time = %.2f, fastest of %d runs each "
          "(%s/s: shardps %.0f, DDP %.0f)\n",
          shardps->seconds / ddp->seconds, std::max(1, o.rounds), w.items,
          shardps->items_per_s, ddp->items_per_s);
    }
    if (o.clip_grad_norm > 0) {
      const absl::Status clipped = CompareClipping(o, w);
      if (!clipped.ok()) {
        absl::PrintF("  clipping: FAILED\n%s\n", Tail(clipped.message(), 20));
        failed.push_back(absl::StrCat(w.name, " clipping"));
      }
    }
  }
  if (!failed.empty()) {
    return absl::InternalError(
        absl::StrCat("failed: ", absl::StrJoin(failed, ", ")));
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
