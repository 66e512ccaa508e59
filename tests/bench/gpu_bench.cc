#include "tests/bench/gpu_bench.h"

#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "worker/backend.h"
#include "worker/gemm_roofline.h"
#include "worker/model.h"

namespace shardps::bench {
namespace {

// Samples per second of Gradients() at `batch`, inputs from the host as the
// worker passes them (the backend's transfers included).
absl::StatusOr<double> StepRate(worker::Backend* backend,
                                const worker::ModelSpec& spec, int batch,
                                int steps) {
  SHARDPS_RETURN_IF_ERROR(backend->Init(spec, batch));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<std::vector<float>> params, grads;
  for (const worker::ParamSpec& p : spec.Params(1)) {
    params.emplace_back(p.num_elements());
    for (float& v : params.back()) v = normal(rng);
    grads.emplace_back(p.num_elements());
  }
  std::vector<absl::Span<const float>> pv(params.begin(), params.end());
  std::vector<absl::Span<float>> gv;
  for (auto& g : grads) gv.emplace_back(absl::MakeSpan(g));
  std::vector<float> x(int64_t{batch} * spec.num_features());
  for (float& v : x) v = std::uniform_real_distribution<float>(0, 1)(rng);
  std::vector<int32_t> labels(batch);
  for (int i = 0; i < batch; ++i) labels[i] = i % spec.num_classes();
  auto step = [&]() -> absl::Status {
    SHARDPS_RETURN_IF_ERROR(backend->SetParams(pv));
    return backend->Gradients(x, labels, 1.0f / batch, gv).status();
  };
  SHARDPS_RETURN_IF_ERROR(step());  // warm-up
  const absl::Time start = absl::Now();
  for (int s = 0; s < steps; ++s) SHARDPS_RETURN_IF_ERROR(step());
  return static_cast<double>(batch) * steps /
         absl::ToDoubleSeconds(absl::Now() - start);
}

}  // namespace

absl::Status RunGpuBench() {
  SHARDPS_ASSIGN_OR_RETURN(
      worker::ModelSpec spec,
      worker::ParseModelSpec("mlp:784-512-256-10", 784, 10));
  absl::StatusOr<std::unique_ptr<worker::Backend>> cuda =
      worker::NewCudaBackend(0);
  if (!cuda.ok()) {
    absl::PrintF("gpu: SKIPPED, no GPU: %s\n", cuda.status().ToString());
    return absl::OkStatus();
  }
  const int cpu_threads =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<worker::Backend> cpu,
                           worker::NewCpuBackend(cpu_threads));
  absl::PrintF(
      "gpu: %s, model %s, one training step = forward + backward "
      "with host transfers\n",
      (*cuda)->name(), spec.ToString());
  for (int batch : {256, 4096}) {
    SHARDPS_ASSIGN_OR_RETURN(double gpu_rate,
                             StepRate(cuda->get(), spec, batch, 200));
    SHARDPS_ASSIGN_OR_RETURN(absl::Duration gemm,
                             worker::CublasStepGemmTime(spec, batch, 0, 200));
    const double roofline = batch / absl::ToDoubleSeconds(gemm);
    SHARDPS_ASSIGN_OR_RETURN(double cpu_rate,
                             StepRate(cpu.get(), spec, batch, 10));
    absl::PrintF(
        "batch %5d: cuda %10.0f samples/s  cuBLAS-only roofline %10.0f "
        "samples/s  ratio = %.2f of roofline;  cpu (%d threads) %8.0f "
        "samples/s, cuda/cpu %.1fx\n",
        batch, gpu_rate, roofline, gpu_rate / roofline, cpu_threads, cpu_rate,
        gpu_rate / cpu_rate);
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
