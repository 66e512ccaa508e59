// Bit-level helpers of the codecs (common/codec.cc, common/topk_select.cc):
// a float's bits, unaligned little-endian loads and stores, and the value an
// encoder compresses. Integer operations only, so that every vector width
// gives the same bits. Internal to common/.
#ifndef SHARDPS_COMMON_FLOAT_BITS_H_
#define SHARDPS_COMMON_FLOAT_BITS_H_

#include <cstdint>
#include <cstring>

namespace shardps::float_bits {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

[[gnu::always_inline]] inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
[[gnu::always_inline]] inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

[[gnu::always_inline]] inline uint16_t Load16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
[[gnu::always_inline]] inline void Store16(char* p, uint32_t v) {
  const uint16_t h = static_cast<uint16_t>(v);
  std::memcpy(p, &h, 2);
}
[[gnu::always_inline]] inline uint32_t Load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
[[gnu::always_inline]] inline void Store32(char* p, uint32_t v) {
  std::memcpy(p, &v, 4);
}

// y = x + residual (or x), the value an encoder compresses.
template <bool kResidual>
[[gnu::always_inline]] inline float Sum(const float* __restrict x,
                                        const float* __restrict r, int64_t i) {
  if constexpr (kResidual) {
    return x[i] + r[i];
  } else {
    return x[i];
  }
}

}  // namespace shardps::float_bits

#endif  // SHARDPS_COMMON_FLOAT_BITS_H_
