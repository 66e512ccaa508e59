// shardps-bench train: the main job's training speed. One worker computing
// gradients alone, the 2-server/2-worker local cluster (shardps-local), and,
// in the same run, PyTorch DistributedDataParallel with the same model,
// batch and threads when Debian's python3-torch is installed.
#include "tests/bench/train_bench.h"

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "tests/bench/run_command.h"
#include "tests/testing/daemon.h"
#include "worker/backend.h"
#include "worker/dataset.h"
#include "worker/model.h"

namespace shardps::bench {
namespace {

constexpr char kModel[] = "mlp:784-512-256-10";

// Gradients of 128-sample slices (the main job's per-worker batch) on the
// CPU backend, one thread: the compute a worker does each step.
absl::StatusOr<double> SoloGradientRate(const worker::Dataset& train) {
  SHARDPS_ASSIGN_OR_RETURN(worker::ModelSpec spec,
                           worker::ParseModelSpec(kModel, 784, 10));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<worker::Backend> backend,
                           worker::NewCpuBackend(1));
  constexpr int kBatch = 128;
  SHARDPS_RETURN_IF_ERROR(backend->Init(spec, kBatch));
  std::vector<std::vector<float>> params, grads;
  for (const worker::ParamSpec& p : spec.Params(1)) {
    params.emplace_back(p.num_elements(), 0.01f);
    grads.emplace_back(p.num_elements());
  }
  std::vector<absl::Span<const float>> pv(params.begin(), params.end());
  std::vector<absl::Span<float>> gv;
  for (auto& g : grads) gv.emplace_back(absl::MakeSpan(g));
  std::vector<float> x(kBatch * 784);
  std::vector<int32_t> labels(kBatch);
  std::vector<int64_t> indices(kBatch);
  constexpr int kSteps = 300;
  const absl::Time start = absl::Now();
  for (int s = 0; s < kSteps; ++s) {
    for (int i = 0; i < kBatch; ++i) {
      indices[i] = (int64_t{s} * kBatch + i) % train.num_samples();
    }
    train.FillBatch(indices, x.data(), labels.data());
    SHARDPS_RETURN_IF_ERROR(backend->SetParams(pv));
    SHARDPS_RETURN_IF_ERROR(
        backend->Gradients(x, labels, 1.0f / kBatch, gv).status());
  }
  return kSteps * kBatch / absl::ToDoubleSeconds(absl::Now() - start);
}

struct ClusterRun {
  double wall_s = 0;
  double mean_epoch_s = 0;
  double accuracy = 0;
  std::string final_line;
  // Means over the epochs of rank 0's per-step figures (metrics.csv).
  double compute_ms = 0, exchange_ms = 0, exposed_ms = 0;
  CommandUsage usage;  // every process of the job together
};

absl::StatusOr<ClusterRun> RunCluster(const TrainOptions& o,
                                      double clip_grad_norm = 0) {
  const std::string dir = testing::MakeTempDir("shardps-bench-train");
  ClusterRun run;
  SHARDPS_ASSIGN_OR_RETURN(
      std::string out,
      RunCommand(absl::StrCat(
                     o.local_binary, " --run_dir=", dir, " --epochs=", o.epochs,
                     clip_grad_norm > 0
                         ? absl::StrCat(" --clip_grad_norm=", clip_grad_norm)
                         : "",
                     " 2>&1"),
                 &run.usage));
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "final:")) run.final_line = std::string(line);
  }
  std::ifstream csv(dir + "/metrics.csv");
  std::string line;
  std::getline(csv, line);  // header
  int rows = 0;
  while (std::getline(csv, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ',');
    double epoch_s = 0, acc = 0;
    if (f.size() < 7 || !absl::SimpleAtod(f[6], &epoch_s)) continue;
    if (absl::SimpleAtod(f[4], &acc)) run.accuracy = acc;
    run.mean_epoch_s += epoch_s;
    double ms[3] = {0, 0, 0};
    for (int i = 0; i < 3 && f.size() >= 13; ++i) {
      (void)absl::SimpleAtod(f[10 + i], &ms[i]);
    }
    run.compute_ms += ms[0];
    run.exchange_ms += ms[1];
    run.exposed_ms += ms[2];
    ++rows;
  }
  if (rows == 0) {
    return absl::InternalError(
        absl::StrCat("no metrics from shardps-local:\n", out));
  }
  run.mean_epoch_s /= rows;
  run.compute_ms /= rows;
  run.exchange_ms /= rows;
  run.exposed_ms /= rows;
  const size_t at = run.final_line.find("wall_s=");
  if (at != std::string::npos) {
    (void)absl::SimpleAtod(run.final_line.substr(at + 7), &run.wall_s);
  }
  return run;
}

// The same job with and without clipping, alternating, `rounds` each: the
// fastest epoch time of each side, and rank 0's per-step figures of it.
absl::Status CompareClipping(const TrainOptions& o, const ClusterRun& first) {
  ClusterRun off = first, on;
  constexpr int kRounds = 2;
  for (int round = 0; round < kRounds; ++round) {
    SHARDPS_ASSIGN_OR_RETURN(ClusterRun c, RunCluster(o, o.clip_grad_norm));
    if (round == 0 || c.mean_epoch_s < on.mean_epoch_s) on = c;
    if (round + 1 < kRounds) {
      SHARDPS_ASSIGN_OR_RETURN(ClusterRun u, RunCluster(o));
      if (u.mean_epoch_s < off.mean_epoch_s) off = u;
    }
  }
  absl::PrintF(
      "clipping (--clip_grad_norm=%g: two-phase steps, one more round trip "
      "of small messages each), fastest of %d runs each:\n"
      "  s/epoch: on %.3f, off %.3f: cost %+.1f%%\n"
      "  per step (rank 0): exchange %.2f vs %.2f ms, not hidden %.2f vs "
      "%.2f ms, compute %.2f vs %.2f ms\n"
      "  test accuracy: on %.4f, off %.4f\n",
      o.clip_grad_norm, kRounds, on.mean_epoch_s, off.mean_epoch_s,
      100 * (on.mean_epoch_s / off.mean_epoch_s - 1), on.exchange_ms,
      off.exchange_ms, on.exposed_ms, off.exposed_ms, on.compute_ms,
      off.compute_ms, on.accuracy, off.accuracy);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunTrainBench(const TrainOptions& o) {
  absl::PrintF(
      "train: %s on Fashion-MNIST, global batch 256, SGD 0.1 "
      "momentum 0.9 cosine, %d epochs\n",
      kModel, o.epochs);
  SHARDPS_ASSIGN_OR_RETURN(worker::Dataset train,
                           worker::LoadFashionMnist(o.data_dir, true));
  SHARDPS_ASSIGN_OR_RETURN(double solo, SoloGradientRate(train));
  absl::PrintF(
      "one worker computing gradients alone (batch 128, 1 thread): "
      "%.0f samples/s\n",
      solo);
  SHARDPS_ASSIGN_OR_RETURN(ClusterRun cluster, RunCluster(o));
  absl::PrintF(
      "shardps-local 2 servers x 2 workers: %.1f s wall, %.2f s/epoch "
      "(%.0f samples/s), test accuracy %.4f\n  %s\n",
      cluster.wall_s, cluster.mean_epoch_s, 60000 / cluster.mean_epoch_s,
      cluster.accuracy, cluster.final_line);
  // Every sample's gradient is computed once, by one worker, at the solo
  // rate: what the job's CPU would be if nothing else cost anything.
  const int64_t steps = int64_t{o.epochs} * (60000 / 256);
  const double gradient_s = o.epochs * 60000.0 / solo;
  absl::PrintF(
      "  per step (rank 0): compute %.2f ms, exchange %.2f ms, of it not "
      "hidden behind compute %.2f ms\n",
      cluster.compute_ms, cluster.exchange_ms, cluster.exposed_ms);
  if (o.clip_grad_norm > 0)
    SHARDPS_RETURN_IF_ERROR(CompareClipping(o, cluster));
  absl::PrintF(
      "  CPU, all processes: %.1f core-s over %.1f s wall; gradients %.1f "
      "core-s, beyond them %.1f core-s (%.2f ms per step); context switches "
      "%.0f per step (%.0f voluntary)\n",
      cluster.usage.cpu_s, cluster.wall_s, gradient_s,
      cluster.usage.cpu_s - gradient_s,
      1000 * (cluster.usage.cpu_s - gradient_s) / steps,
      static_cast<double>(cluster.usage.voluntary_switches +
                          cluster.usage.involuntary_switches) /
          steps,
      static_cast<double>(cluster.usage.voluntary_switches) / steps);
  if (!RunCommand("/usr/bin/python3 -c 'import torch' 2>&1").ok()) {
    absl::PrintF(
        "PyTorch: not installed (apt-get install python3-torch); "
        "no comparison\n");
    return absl::OkStatus();
  }
  for (int procs : {2, 1}) {
    const int threads = procs == 2 ? 1 : 2;
    CommandUsage usage;
    SHARDPS_ASSIGN_OR_RETURN(
        std::string json,
        RunCommand(absl::StrCat("/usr/bin/python3 ", o.torch_script,
                                " --processes=", procs, " --threads=", threads,
                                " --epochs=", o.epochs, " --data=", o.data_dir,
                                " 2>&1 | tail -n 1"),
                   &usage));
    const double wall = JsonNumber(json, "wall_s");
    absl::PrintF(
        "PyTorch %s %d process(es) x %d thread(s) (BLAS %s): %.1f s wall, "
        "%.2f s/epoch\n",
        JsonField(json, "torch"), procs, threads, JsonField(json, "blas"), wall,
        wall / o.epochs);
    absl::PrintF("  accuracies %s\n", JsonField(json, "test_accuracy"));
    absl::PrintF(
        "  CPU %.1f core-s (beyond the gradients at shardps's solo rate %.1f "
        "core-s); context switches %.0f per step\n",
        usage.cpu_s, usage.cpu_s - gradient_s,
        static_cast<double>(usage.voluntary_switches +
                            usage.involuntary_switches) /
            steps);
    absl::PrintF("  ratio = shardps wall / PyTorch wall = %.2f\n",
                 cluster.wall_s / wall);
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
