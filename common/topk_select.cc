#include "common/topk_select.h"

#include <cstdint>
#include <vector>

#include "common/float_bits.h"
#include "common/multiversion.h"

namespace shardps {
namespace {

using float_bits::Bits;
using float_bits::kAbsMask;
using float_bits::Store32;
using float_bits::Sum;

// Scans hist[0, bins) from the top for the bin where the running count
// reaches `want` (>= 1); *above gets the count of the bins above it.
uint32_t TopBin(const std::vector<uint32_t>& hist, int64_t want,
                int64_t* above) {
  int64_t count = 0;
  for (uint32_t bin = hist.size() - 1;; --bin) {
    if (count + hist[bin] >= want || bin == 0) {
      *above = count;
      return bin;
    }
    count += hist[bin];
  }
}

template <bool kResidual>
[[gnu::always_inline]] inline uint32_t AbsBitsAt(const float* __restrict x,
                                                 const float* __restrict r,
                                                 int64_t i) {
  return Bits(Sum<kResidual>(x, r, i)) & kAbsMask;
}

// The second and third passes look at few elements (those in one bin, or
// the top k): each block is tested with a vector compare first, and only a
// block with a hit is walked element by element. About 1% of the elements
// are kept, so a collect block of 8 has a hit one time in 12 or so; the
// threshold's bin holds far fewer.
constexpr int64_t kBinBlock = 64;
constexpr int64_t kCollectBlock = 8;

// hist (32768 bins) counts the high 16 bits of |y| (the sign bit is 0).
void HighHistogram(const float* x, const float* r, int64_t n,
                   std::vector<uint32_t>* hist) {
  uint32_t* h = hist->data();
  if (r != nullptr) {
    for (int64_t i = 0; i < n; ++i) ++h[AbsBitsAt<true>(x, r, i) >> 16];
  } else {
    for (int64_t i = 0; i < n; ++i) ++h[AbsBitsAt<false>(x, r, i) >> 16];
  }
}

template <bool kResidual>
[[gnu::always_inline]] inline void LowHistogramOf(const float* __restrict x,
                                                  const float* __restrict r,
                                                  int64_t n, uint32_t high,
                                                  uint32_t* hist) {
  int64_t begin = 0;
  for (; begin + kBinBlock <= n; begin += kBinBlock) {
    uint32_t hit = 0;
#pragma GCC unroll 1  // kept a loop, so that it is vectorised
    for (int64_t i = begin; i < begin + kBinBlock; ++i) {
      hit |=
          static_cast<uint32_t>((AbsBitsAt<kResidual>(x, r, i) >> 16) == high);
    }
    if (hit == 0) continue;
    for (int64_t i = begin; i < begin + kBinBlock; ++i) {
      const uint32_t a = AbsBitsAt<kResidual>(x, r, i);
      if ((a >> 16) == high) ++hist[a & 0xffffu];
    }
  }
  for (int64_t i = begin; i < n; ++i) {
    const uint32_t a = AbsBitsAt<kResidual>(x, r, i);
    if ((a >> 16) == high) ++hist[a & 0xffffu];
  }
}

// hist (65536 bins) counts the low 16 bits of the |y| whose high ones are
// `high`.
SHARDPS_MULTIVERSIONED void LowHistogram(const float* x, const float* r,
                                         int64_t n, uint32_t high,
                                         uint32_t* hist) {
  if (r != nullptr) {
    LowHistogramOf<true>(x, r, n, high, hist);
  } else {
    LowHistogramOf<false>(x, r, n, high, hist);
  }
}

// Elements [begin, end) one by one: takes each |y| above `threshold`, and
// while *ties lasts each equal to it, appending to indices/values at *j;
// a taken element's residual becomes 0. With a residual, r already holds y.
template <bool kResidual>
[[gnu::always_inline]] inline void CollectRange(const float* __restrict x,
                                                float* __restrict r,
                                                int64_t begin, int64_t end,
                                                uint32_t threshold,
                                                int64_t* ties, int64_t* j,
                                                char* indices, char* values) {
  for (int64_t i = begin; i < end; ++i) {
    const float y = kResidual ? r[i] : x[i];
    const uint32_t a = Bits(y) & kAbsMask;
    bool take = a > threshold;
    if (a == threshold && *ties > 0) {
      take = true;
      --*ties;
    }
    if (!take) continue;
    Store32(indices + 4 * *j, static_cast<uint32_t>(i));
    Store32(values + 4 * *j, Bits(y));
    ++*j;
    if constexpr (kResidual) r[i] = 0.0f;
  }
}

template <bool kResidual>
[[gnu::always_inline]] inline void CollectTopkOf(const float* __restrict x,
                                                 float* __restrict r, int64_t n,
                                                 uint32_t threshold,
                                                 int64_t ties, char* indices,
                                                 char* values) {
  int64_t j = 0;
  int64_t begin = 0;
  for (; begin + kCollectBlock <= n; begin += kCollectBlock) {
    uint32_t hit = 0;
#pragma GCC unroll 1  // kept a loop, so that it is vectorised
    for (int64_t i = begin; i < begin + kCollectBlock; ++i) {
      const float y = Sum<kResidual>(x, r, i);
      hit |= static_cast<uint32_t>((Bits(y) & kAbsMask) >= threshold);
      if constexpr (kResidual) r[i] = y;
    }
    if (hit == 0) continue;
    CollectRange<kResidual>(x, r, begin, begin + kCollectBlock, threshold,
                            &ties, &j, indices, values);
  }
  if constexpr (kResidual) {
    for (int64_t i = begin; i < n; ++i) r[i] = x[i] + r[i];
  }
  CollectRange<kResidual>(x, r, begin, n, threshold, &ties, &j, indices,
                          values);
}

// Writes the selected indices and values to `indices` and `values` (k
// entries, unaligned) in index order and, with a residual, leaves in it the
// unsent y and 0 where sent.
SHARDPS_MULTIVERSIONED void CollectTopk(const float* x, float* r, int64_t n,
                                        uint32_t threshold, int64_t ties,
                                        char* indices, char* values) {
  if (r != nullptr) {
    CollectTopkOf<true>(x, r, n, threshold, ties, indices, values);
  } else {
    CollectTopkOf<false>(x, r, n, threshold, ties, indices, values);
  }
}

}  // namespace

void SelectTopk(const float* x, float* r, int64_t n, int64_t k, char* out) {
  // Per thread, so the step loop does not allocate 256 KiB per chunk.
  thread_local std::vector<uint32_t> hist;
  hist.assign(32768, 0);
  HighHistogram(x, r, n, &hist);
  int64_t above = 0;
  const uint32_t high = TopBin(hist, k, &above);
  hist.assign(65536, 0);
  LowHistogram(x, r, n, high, hist.data());
  int64_t above_in_bin = 0;
  const uint32_t low = TopBin(hist, k - above, &above_in_bin);
  const uint32_t threshold = (high << 16) | low;
  const int64_t ties = k - above - above_in_bin;
  Store32(out, static_cast<uint32_t>(k));
  CollectTopk(x, r, n, threshold, ties, out + 4, out + 4 + 4 * k);
}

}  // namespace shardps
