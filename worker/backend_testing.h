// Seeded inputs shared by the backend and kernel tests. Test-only.
#ifndef SHARDPS_WORKER_BACKEND_TESTING_H_
#define SHARDPS_WORKER_BACKEND_TESTING_H_

#include <cstdint>
#include <random>
#include <vector>

namespace shardps::worker::testing {

// n floats uniform in [-scale, scale), the same for the same seed.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& f : v) f = u(rng);
  return v;
}

}  // namespace shardps::worker::testing

#endif  // SHARDPS_WORKER_BACKEND_TESTING_H_
