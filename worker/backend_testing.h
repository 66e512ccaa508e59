// Seeded inputs shared by the backend and kernel tests: random floats and
// whole problems (a model, its parameters and a batch). Test-only.
#ifndef SHARDPS_WORKER_BACKEND_TESTING_H_
#define SHARDPS_WORKER_BACKEND_TESTING_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "worker/model.h"

namespace shardps::worker::testing {

// n floats uniform in [-scale, scale), the same for the same seed.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& f : v) f = u(rng);
  return v;
}

// A model, its parameters and a batch of inputs and labels, all seeded.
struct Problem {
  ModelSpec spec;
  std::vector<std::vector<float>> params;
  std::vector<float> x;
  std::vector<int32_t> labels;

  std::vector<absl::Span<const float>> param_spans() const {
    return {params.begin(), params.end()};
  }
};

// The ranges MakeProblem draws from.
struct ProblemScales {
  // Parameters uniform in [-param, param); when by_init, normally
  // initialised ones in [-2 std, 2 std) instead (roughly their initial scale).
  float param = 0.8f;
  bool by_init = false;
  // Inputs uniform in [x_center - x, x_center + x).
  float x = 1.0f;
  float x_center = 0.0f;
};

// A problem of layer widths `sizes` and batch size `b`, the same for the same
// seed and scales; labels uniform over the classes.
inline Problem MakeProblem(const std::vector<int64_t>& sizes, int b,
                           uint32_t seed, const ProblemScales& scales = {}) {
  Problem p{ModelSpec(sizes), {}, {}, {}};
  for (const ParamSpec& s : p.spec.Params(seed)) {
    const float scale = scales.by_init && s.init == ParamSpec::Init::kNormal
                            ? 2 * s.std
                            : scales.param;
    p.params.push_back(RandomFloats(s.num_elements(), seed++, scale));
  }
  p.x = RandomFloats(static_cast<size_t>(b) * sizes.front(), seed++, scales.x);
  if (scales.x_center != 0.0f) {
    for (float& v : p.x) v += scales.x_center;
  }
  std::mt19937 rng(seed);
  for (int i = 0; i < b; ++i) {
    p.labels.push_back(static_cast<int32_t>(rng() % sizes.back()));
  }
  return p;
}

}  // namespace shardps::worker::testing

#endif  // SHARDPS_WORKER_BACKEND_TESTING_H_
