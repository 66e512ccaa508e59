// splitmix64, the 64-bit mixer every seeded stream in shardps derives from:
// tensor initialisation, the model's per-tensor seeds and the dataset's epoch
// shuffles. Header-only; the same input gives the same output everywhere, so
// a seed means the same numbers on every process and platform.
#ifndef SHARDPS_COMMON_SPLITMIX64_H_
#define SHARDPS_COMMON_SPLITMIX64_H_

#include <cstdint>

namespace shardps {

// A strong bijective mix of `x` (Steele, Lea and Flood's splitmix64 finaliser
// with its increment), usable as a counter-based generator.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_SPLITMIX64_H_
