// ResidualBound bounds what error feedback leaves, step after step, and
// CheckEncodableWithin gives CheckEncodable's answer, reading the residual
// only near the limits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

float MaxAbs(const std::vector<float>& v) {
  float m = 0;
  for (float f : v) m = std::max(m, std::fabs(f));
  return m;
}

TEST(CodecBoundTest, ResidualBoundHoldsStepAfterStepForEveryLossyEncoding) {
  const int64_t n = 4096;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (v1::Encoding encoding : {v1::ENCODING_BF16, v1::ENCODING_FP16,
                                v1::ENCODING_INT8, v1::ENCODING_TOPK}) {
    // Subnormal, tiny, ordinary and (but for FP16) huge gradients.
    std::vector<double> scales = {1e-42, 1e-30, 1e-6, 1.0, 1e3};
    if (encoding != v1::ENCODING_FP16) scales.push_back(1e30);
    // TOPK's residual keeps what it does not send: five steps of it add up.
    if (encoding != v1::ENCODING_FP16 && encoding != v1::ENCODING_TOPK) {
      scales.push_back(5e37);
    }
    for (double scale : scales) {
      SCOPED_TRACE(absl::StrCat(EncodingName(encoding), ", scale ", scale));
      std::vector<float> residual(n, 0.0f), next(n);
      for (int step = 0; step < 5; ++step) {
        std::vector<float> x(n);
        for (float& v : x) v = static_cast<float>(normal(rng) * scale);
        std::string payload;
        float y_max = -1;
        ASSERT_TRUE(EncodePayloadTo(encoding, x.data(), n, 0.01,
                                    residual.data(), next.data(), &payload,
                                    &y_max)
                        .ok());
        // y_max is the largest |x + residual| encoded.
        float want = 0;
        for (int64_t i = 0; i < n; ++i) {
          want = std::max(want, std::fabs(x[i] + residual[i]));
        }
        EXPECT_EQ(y_max, want);
        EXPECT_LE(MaxAbs(next), ResidualBound(encoding, y_max))
            << "step " << step;
        residual.swap(next);
      }
    }
  }
  EXPECT_EQ(ResidualBound(v1::ENCODING_FP32, 1e30f), 0.0f);
}

// CheckEncodableWithin(x, r, r_max) against CheckEncodable(x, r).
void ExpectAsExact(v1::Encoding encoding, const std::vector<float>& x,
                   const std::vector<float>& r, float r_max) {
  const absl::Status exact = CheckEncodable(encoding, x.data(), r.data(),
                                            static_cast<int64_t>(x.size()));
  const absl::Status within = CheckEncodableWithin(
      encoding, x.data(), r.data(), r_max, static_cast<int64_t>(x.size()));
  EXPECT_EQ(within, exact);
}

TEST(CodecBoundTest, CheckWithinAResidualBoundGivesTheExactChecksAnswer) {
  const int64_t n = 1000;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(n), r(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = unit(rng);
    r[i] = 1e-3f * unit(rng);
  }
  for (v1::Encoding encoding : {v1::ENCODING_BF16, v1::ENCODING_FP16,
                                v1::ENCODING_INT8, v1::ENCODING_TOPK}) {
    SCOPED_TRACE(EncodingName(encoding));
    ExpectAsExact(encoding, x, r, 1e-3f);  // ordinary values: OK
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()}) {
      std::vector<float> with = x;
      with[321] = bad;
      ExpectAsExact(encoding, with, r, 1e-3f);
      EXPECT_FALSE(
          CheckEncodableWithin(encoding, with.data(), r.data(), 1e-3f, n).ok());
    }
  }
  // Near BF16's limit (from 0x1.ffp127 = 3.3961775e38 up): x alone is
  // fine, x + r is not; and x + r fine with a bound that does not prove it.
  std::vector<float> big = x, push(n, 0.0f);
  big[500] = 3.395e38f;
  push[500] = 2e35f;
  ASSERT_FALSE(
      CheckEncodable(v1::ENCODING_BF16, big.data(), push.data(), n).ok());
  ExpectAsExact(v1::ENCODING_BF16, big, push, 2e35f);
  push[500] = -2e35f;
  ExpectAsExact(v1::ENCODING_BF16, big, push, 2e35f);
  EXPECT_TRUE(
      CheckEncodableWithin(v1::ENCODING_BF16, big.data(), push.data(), 2e35f, n)
          .ok());
  // FP16: 65000 + 600 is beyond binary16 (from 65520 up).
  std::vector<float> half = x, over(n, 0.0f);
  half[7] = 65000.0f;
  over[7] = 600.0f;
  ExpectAsExact(v1::ENCODING_FP16, half, over, 600.0f);
  EXPECT_FALSE(
      CheckEncodableWithin(v1::ENCODING_FP16, half.data(), over.data(), 600, n)
          .ok());
  // No residual: the exact check of x.
  EXPECT_EQ(CheckEncodableWithin(v1::ENCODING_FP16, half.data(), nullptr, 0, n),
            CheckEncodable(v1::ENCODING_FP16, half.data(), nullptr, n));
}

}  // namespace
}  // namespace shardps
