#include "common/tensor_init.h"

#include <cmath>

#include "common/splitmix64.h"

namespace shardps {
namespace {

// Uniform in (0, 1): 53 random bits, never exactly 0 (log() below).
double Uniform01(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

}  // namespace

void FillInit(const v1::InitSpec& init, uint32_t tensor, int64_t offset,
              float* out, int64_t n) {
  const uint64_t key = SplitMix64(init.seed() ^ SplitMix64(tensor + 1));
  const double scale = init.value();
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t counter = static_cast<uint64_t>(offset + i);
    switch (init.kind()) {
      case v1::InitSpec::KIND_CONSTANT:
        out[i] = init.value();
        break;
      case v1::InitSpec::KIND_UNIFORM:
        out[i] = static_cast<float>(
            scale * (2.0 * Uniform01(SplitMix64(key ^ (2 * counter))) - 1.0));
        break;
      case v1::InitSpec::KIND_NORMAL: {
        // Box-Muller on two independent streams of the same counter.
        const double u1 = Uniform01(SplitMix64(key ^ (2 * counter)));
        const double u2 = Uniform01(SplitMix64(key ^ (2 * counter + 1)));
        out[i] = static_cast<float>(scale * std::sqrt(-2.0 * std::log(u1)) *
                                    std::cos(kTwoPi * u2));
        break;
      }
      default:
        out[i] = 0.0f;
    }
  }
}

}  // namespace shardps
