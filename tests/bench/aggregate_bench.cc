#include "tests/bench/aggregate_bench.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "server/optimizer.h"

namespace shardps::bench {
namespace {

template <typename Fn>
absl::Duration BestOf(int n, Fn fn) {
  absl::Duration best = absl::InfiniteDuration();
  for (int i = 0; i < n; ++i) {
    const absl::Time start = absl::Now();
    fn();
    best = std::min(best, absl::Now() - start);
  }
  return best;
}

// The baseline: one read of g, one read and one write of w per element.
__attribute__((noinline)) void AddInPlace(float* __restrict w,
                                          const float* __restrict g,
                                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) w[i] += g[i];
}

}  // namespace

absl::Status RunAggregateBench(const AggregateOptions& o) {
  const int64_t n = o.bytes / 4;
  std::vector<float> w(n, 0.5f);
  std::vector<std::vector<float>> grads(4, std::vector<float>(n, 1e-3f));
  std::vector<std::vector<float>> slots(2, std::vector<float>(n, 0.0f));
  const absl::Duration base =
      BestOf(o.repeats, [&] { AddInPlace(w.data(), grads[0].data(), n); });
  const double base_gbs = o.bytes / 1e9 / absl::ToDoubleSeconds(base);
  absl::PrintF(
      "aggregate: %.0f MiB per contribution, one thread, best of %d\n"
      "baseline w += g: %.2f GB/s of gradient (%.1f ms)\n",
      o.bytes / 1048576.0, o.repeats, base_gbs,
      absl::ToDoubleMilliseconds(base));
  struct Config {
    const char* name;
    v1::OptimizerSpec::Kind kind;
    float momentum;
  };
  for (Config c : {Config{"sgd-momentum", v1::OptimizerSpec::KIND_SGD, 0.9f},
                   Config{"adam", v1::OptimizerSpec::KIND_ADAM, 0.0f}}) {
    v1::OptimizerSpec spec;
    spec.set_kind(c.kind);
    spec.set_learning_rate(1e-3f);
    spec.set_momentum(c.momentum);
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<server::Optimizer> opt,
                             server::Optimizer::Create(spec));
    std::vector<float*> slot_ptrs;
    for (int s = 0; s < opt->num_slots(); ++s)
      slot_ptrs.push_back(slots[s].data());
    for (int contributions : {2, 4}) {
      std::vector<const float*> g;
      for (int r = 0; r < contributions; ++r) g.push_back(grads[r].data());
      int64_t update = 0;
      const absl::Duration d = BestOf(
          o.repeats, [&] { opt->Apply(update++, g, w.data(), slot_ptrs, n); });
      const double gbs =
          contributions * o.bytes / 1e9 / absl::ToDoubleSeconds(d);
      absl::PrintF(
          "%-13s %d contributions: %6.2f GB/s of gradient (%.1f ms)  ratio = "
          "%.2f of w += g\n",
          c.name, contributions, gbs, absl::ToDoubleMilliseconds(d),
          gbs / base_gbs);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
