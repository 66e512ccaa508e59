#include "common/codec.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

using ::testing::HasSubstr;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint16_t Half(const std::string& payload, int64_t i) {
  uint16_t h;
  std::memcpy(&h, payload.data() + 2 * i, 2);
  return h;
}
uint32_t Word(const std::string& payload, int64_t i) {
  uint32_t w;
  std::memcpy(&w, payload.data() + 4 * i, 4);
  return w;
}
template <typename T>
void Put(std::string* payload, T v) {
  payload->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

constexpr float kFltMin = std::numeric_limits<float>::min();
constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Encodes x without error feedback; the test fails on an error.
std::string Encode(v1::Encoding encoding, const std::vector<float>& x,
                   double ratio = 1.0) {
  std::string out;
  absl::Status s =
      EncodePayload(encoding, x.data(), x.size(), ratio, nullptr, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::vector<float> Decode(v1::Encoding encoding, const std::string& payload,
                          int64_t n) {
  std::vector<float> out(n, -1.0f);
  absl::Status s = DecodePayload(encoding, payload, n, false, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The status of decoding `payload` as n elements.
absl::Status DecodeStatus(v1::Encoding encoding, const std::string& payload,
                          int64_t n, bool allow_nonfinite = false) {
  std::vector<float> out(n);
  return DecodePayload(encoding, payload, n, allow_nonfinite, out.data());
}

// ---------------------------------------------------------------------------
// References, written from the definitions in double arithmetic.

// binary16 nearest to finite f (|f| < 65520), ties to even.
uint16_t ReferenceFp16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double x = std::fabs(static_cast<double>(f));
  if (x < 0x1p-14) {  // subnormal spacing 2^-24; 1024 is the smallest normal
    return sign | static_cast<uint16_t>(std::nearbyint(x * 0x1p24));
  }
  int e = 0;
  std::frexp(x, &e);  // x in [2^(e-1), 2^e)
  int exponent = e - 1;
  double m = std::nearbyint(std::ldexp(x, 10 - exponent));  // [1024, 2048]
  if (m == 2048) {
    m = 1024;
    ++exponent;
  }
  return sign | static_cast<uint16_t>(((exponent + 15) << 10) |
                                      (static_cast<int>(m) - 1024));
}

// The value of binary16 h (infinity for exponent 31; NaN not asked).
double ReferenceFp16Value(uint16_t h) {
  const int e = (h >> 10) & 31;
  const int m = h & 1023;
  double v = e == 0   ? std::ldexp(m, -24)
             : e < 31 ? std::ldexp(1024 + m, e - 25)
                      : std::numeric_limits<double>::infinity();
  return (h & 0x8000) ? -v : v;
}

// bfloat16 nearest to finite f, ties to even: of the two candidates around
// f, the nearer, compared in double (exact differences).
uint16_t ReferenceBf16(float f) {
  const uint16_t low = static_cast<uint16_t>(Bits(f) >> 16);
  const double a = FromBits(static_cast<uint32_t>(low) << 16);
  const double b = FromBits(static_cast<uint32_t>(low + 1) << 16);
  const double da = std::fabs(f - a);
  const double db = std::fabs(b - f);
  if (da != db) return da < db ? low : low + 1;
  return (low & 1) ? low + 1 : low;
}

__attribute__((target("f16c"))) uint16_t HardwareFp16(float f) {
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
__attribute__((target("f16c"))) float HardwareFp32(uint16_t h) {
  return _cvtsh_ss(h);
}
// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports lacks "f16c").
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
}

// ---------------------------------------------------------------------------

TEST(CodecTest, EncodedBytesPerEncoding) {
  EXPECT_EQ(EncodedBytes(v1::ENCODING_FP32, 10), 40);
  EXPECT_EQ(EncodedBytes(v1::ENCODING_BF16, 10), 20);
  EXPECT_EQ(EncodedBytes(v1::ENCODING_FP16, 10), 20);
  EXPECT_EQ(EncodedBytes(v1::ENCODING_INT8, 10), 14);
  EXPECT_EQ(EncodedBytes(v1::ENCODING_TOPK, 10, 3), 28);
  EXPECT_EQ(EncodedBytes(v1::ENCODING_UNSPECIFIED, 10), -1);
  EXPECT_EQ(EncodedBytes(static_cast<v1::Encoding>(42), 10), -1);
}

TEST(CodecTest, TopkCountRoundsUpAndClamps) {
  EXPECT_EQ(TopkCount(1000, 0.01), 10);
  EXPECT_EQ(TopkCount(1001, 0.01), 11);
  EXPECT_EQ(TopkCount(1 << 20, 0.01), 10486);
  EXPECT_EQ(TopkCount(10, 0.01), 1);
  EXPECT_EQ(TopkCount(10, 1e-300), 1);
  EXPECT_EQ(TopkCount(10, 0.5), 5);
  EXPECT_EQ(TopkCount(10, 1.0), 10);
  EXPECT_EQ(TopkCount(1, 0.01), 1);
  EXPECT_EQ(TopkCount(0, 0.5), 0);
}

TEST(CodecTest, Fp32IsACopyAndFeedbackLeavesZero) {
  const std::vector<float> x = {1.5f, -0.0f, 1e-45f, kFltMax, -3.25f};
  const std::string p = Encode(v1::ENCODING_FP32, x);
  ASSERT_EQ(p.size(), 20u);
  EXPECT_EQ(std::memcmp(p.data(), x.data(), 20), 0);
  const std::vector<float> got = Decode(v1::ENCODING_FP32, p, 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Bits(got[i]), Bits(x[i])) << i;

  std::vector<float> r = {0.5f, 1.0f, 0.0f, -kFltMax, 0.25f};
  std::string out;
  SHARDPS_ASSERT_OK(
      EncodePayload(v1::ENCODING_FP32, x.data(), 5, 1.0, r.data(), &out));
  const std::vector<float> sum = Decode(v1::ENCODING_FP32, out, 5);
  EXPECT_EQ(sum, (std::vector<float>{2.0f, 1.0f, 1e-45f, 0.0f, -3.0f}));
  EXPECT_EQ(r, std::vector<float>(5, 0.0f));
}

TEST(CodecTest, Bf16RoundsToNearestEven) {
  struct Case {
    uint32_t in;
    uint16_t want;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1
      {0x3f807fffu, 0x3f80},  // below the half
      {0x3f808000u, 0x3f80},  // tie, kept half even: stays
      {0x3f808001u, 0x3f81},  // above the half
      {0x3f818000u, 0x3f82},  // tie, kept half odd: up to even
      {0xbf818000u, 0xbf82},  // the same, negative
      {0x3fff8000u, 0x4000},  // a carry into the exponent: 1.99.. -> 2
      {0x00008000u, 0x0000},  // subnormal tie down to zero
      {0x00008001u, 0x0001},  // smallest bf16 subnormal
      {0x00018000u, 0x0002},  // subnormal tie up to even
      {0x80008001u, 0x8001}, {0x80000000u, 0x8000},  // -0
      {0x7f7f0000u, 0x7f7f},                         // largest finite bfloat16
      {0x7f7f7fffu, 0x7f7f},  // just below the tie: still finite
      {0xff7f7fffu, 0xff7f},
  };
  std::vector<float> x;
  for (const Case& c : cases) x.push_back(FromBits(c.in));
  const std::string p = Encode(v1::ENCODING_BF16, x);
  ASSERT_EQ(p.size(), 2 * x.size());
  const std::vector<float> back = Decode(v1::ENCODING_BF16, p, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(Half(p, i), cases[i].want);
    EXPECT_EQ(Bits(back[i]), static_cast<uint32_t>(cases[i].want) << 16);
  }
  // The same through the reply path's functions.
  std::vector<uint16_t> h(x.size());
  EncodeBf16(x.data(), x.size(), h.data());
  std::vector<float> widened(x.size());
  DecodeBf16(h.data(), h.size(), widened.data());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(h[i], cases[i].want) << i;
    EXPECT_EQ(Bits(widened[i]), Bits(back[i])) << i;
  }
}

TEST(CodecTest, Bf16RefusesWhatRoundsToInfinity) {
  for (uint32_t bits : {0x7f7f8000u, 0x7f7fffffu, 0xff7f8000u}) {
    SCOPED_TRACE(bits);
    std::vector<float> x = {1.0f, 2.0f, FromBits(bits)};
    std::string out = "unchanged";
    absl::Status s =
        EncodePayload(v1::ENCODING_BF16, x.data(), 3, 1.0, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("element 2"));
    EXPECT_THAT(s.message(), HasSubstr("infinity in bfloat16"));
    EXPECT_THAT(s.message(), HasSubstr("3.38953139e+38"));
    EXPECT_EQ(out, "unchanged");
  }
  // EncodeBf16 cannot fail: it rounds to infinity and keeps NaN a NaN.
  const float x[] = {FromBits(0x7f7f8000u), FromBits(0x7f800001u),
                     -std::nanf("")};
  uint16_t h[3];
  EncodeBf16(x, 3, h);
  EXPECT_EQ(h[0], 0x7f80);
  EXPECT_EQ(h[1] & 0x7f80, 0x7f80);
  EXPECT_NE(h[1] & 0x7f, 0);
  EXPECT_EQ(h[2] & 0xffc0, 0xffc0);
}

TEST(CodecTest, Bf16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(7);
  std::vector<float> x;
  while (x.size() < 1000000) {
    // A quarter are exact ties.
    uint32_t b = rng();
    if (x.size() % 4 == 0) b = (b & 0xffff0000u) | 0x8000u;
    if ((b & 0x7fffffffu) >= 0x7f7f8000u) continue;
    x.push_back(FromBits(b));
  }
  const std::string p = Encode(v1::ENCODING_BF16, x);
  std::vector<uint16_t> h(x.size());
  EncodeBf16(x.data(), x.size(), h.data());
  int64_t mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t want = ReferenceBf16(x[i]);
    if (Half(p, i) != want || h[i] != want) {
      if (++mismatches < 10) {
        ADD_FAILURE() << std::hex << Bits(x[i]) << " -> " << Half(p, i) << ", "
                      << h[i] << ", want " << want;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CodecTest, Fp16RoundsToNearestEven) {
  struct Case {
    float in;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x3c00},
      {FromBits(0x3f801000u), 0x3c00},  // 1 + 2^-11: tie, stays even
      {FromBits(0x3f801001u), 0x3c01},  // just above the tie
      {FromBits(0x3f803000u), 0x3c02},  // 1 + 3 * 2^-11: tie up to even
      {-1.0f, 0xbc00},
      {-0.0f, 0x8000},
      {65504.0f, 0x7bff},               // largest finite binary16
      {FromBits(0x477fefffu), 0x7bff},  // just below 65520
      {-65504.0f, 0xfbff},
      {0x1p-14f, 0x0400},               // smallest normal
      {0x1p-24f, 0x0001},               // smallest subnormal
      {0x1p-25f, 0x0000},               // tie with zero: to zero
      {FromBits(0x33000001u), 0x0001},  // just above it
      {3 * 0x1p-25f, 0x0002},           // tie between 1 and 2
      {5 * 0x1p-25f, 0x0002},           // tie between 2 and 3
      {1023 * 0x1p-24f, 0x03ff},        // largest subnormal
      {2047 * 0x1p-25f, 0x0400},        // tie: up to the smallest normal
      {-3 * 0x1p-24f, 0x8003},
      {1e-40f, 0x0000},  // binary32 subnormal
      {-1e-40f, 0x8000},
      {1023.25f * 0x1p-24f, 0x03ff},  // below the tie with 0x400
  };
  std::vector<float> x;
  for (const Case& c : cases) x.push_back(c.in);
  const std::string p = Encode(v1::ENCODING_FP16, x);
  ASSERT_EQ(p.size(), 2 * x.size());
  const std::vector<float> back = Decode(v1::ENCODING_FP16, p, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(Half(p, i), cases[i].want) << std::hex << Bits(cases[i].in);
    EXPECT_EQ(static_cast<double>(back[i]), ReferenceFp16Value(cases[i].want));
    EXPECT_EQ(std::signbit(back[i]), (cases[i].want & 0x8000) != 0);
  }
}

TEST(CodecTest, Fp16RefusesOverflowNamingValueAndLimit) {
  for (float big : {65520.0f, -65520.0f, 1e6f, kFltMax}) {
    SCOPED_TRACE(big);
    std::vector<float> x = {0.0f, 1.0f, 2.0f, big, kInf};
    std::string out = "unchanged";
    absl::Status s =
        EncodePayload(v1::ENCODING_FP16, x.data(), 5, 1.0, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("element 3"));
    EXPECT_THAT(s.message(), HasSubstr(absl::StrFormat("%.9g", big)));
    EXPECT_THAT(s.message(), HasSubstr("65504"));
    EXPECT_EQ(out, "unchanged");
  }
}

TEST(CodecTest, Fp16DecodesEveryHalfLikeReference) {
  std::string p;
  for (uint32_t h = 0; h < 65536; ++h) Put(&p, static_cast<uint16_t>(h));
  std::vector<float> got(65536);
  SHARDPS_ASSERT_OK(DecodePayload(v1::ENCODING_FP16, p, 65536,
                                  /*allow_nonfinite=*/true, got.data()));
  std::vector<float> finite;
  std::vector<uint16_t> finite_halves;
  for (uint32_t h = 0; h < 65536; ++h) {
    SCOPED_TRACE(h);
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(got[h]));
      continue;
    }
    ASSERT_EQ(static_cast<double>(got[h]), ReferenceFp16Value(h));
    ASSERT_EQ(std::signbit(got[h]), (h & 0x8000) != 0);
    if (HasF16c()) {
      ASSERT_EQ(Bits(got[h]), Bits(HardwareFp32(h)));
    }
    if ((h & 0x7c00) != 0x7c00) {
      finite.push_back(got[h]);
      finite_halves.push_back(h);
    }
  }
  // Every finite half encodes back to itself.
  const std::string again = Encode(v1::ENCODING_FP16, finite);
  for (size_t i = 0; i < finite.size(); ++i) {
    ASSERT_EQ(Half(again, i), finite_halves[i]) << i;
  }
  // Refused without allow_nonfinite: 0x7c00 (+infinity) comes first.
  absl::Status s = DecodeStatus(v1::ENCODING_FP16, p, 65536);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("element 31744 is inf"));
}

TEST(CodecTest, Fp16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(11);
  std::vector<float> x;
  std::vector<uint16_t> tie_want;  // for the midpoints, the even neighbour
  while (x.size() < 1000000) {
    const uint32_t b = rng();
    if (x.size() % 3 == 0) {
      // The midpoint of two adjacent finite halves (12 significant bits, so
      // exact in binary32), or one binary32 ulp either side of it.
      const uint16_t h = static_cast<uint16_t>(b % 0x7bff) |
                         static_cast<uint16_t>(b & 0x80000000u ? 0x8000 : 0);
      const double mid =
          (ReferenceFp16Value(h) + ReferenceFp16Value(h + 1)) / 2;
      const float m = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(m), mid);
      const int side = static_cast<int>((b >> 16) % 3) - 1;
      x.push_back(FromBits(Bits(m) + side));
      const uint16_t even = (h & 1) ? h + 1 : h;
      tie_want.push_back(side == 0 ? even : side > 0 ? h + 1 : h);
      continue;
    }
    // Exponents from binary32 subnormals up to 2^15.
    const uint32_t exponent = 90 + (b >> 24) % 53;
    const uint32_t v = (b & 0x807fffffu) | (exponent << 23);
    if ((v & 0x7fffffffu) >= 0x477ff000u) continue;
    x.push_back(FromBits(v));
    tie_want.push_back(0);
  }
  const std::string p = Encode(v1::ENCODING_FP16, x);
  const bool f16c = HasF16c();
  int64_t mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t got = Half(p, i);
    uint16_t want = ReferenceFp16(x[i]);
    bool bad = got != want;
    if (i % 3 == 0) bad |= got != tie_want[i];
    if (f16c) bad |= got != HardwareFp16(x[i]);
    if (bad && ++mismatches < 10) {
      ADD_FAILURE() << std::hex << Bits(x[i]) << " -> " << got << ", want "
                    << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CodecTest, Int8RoundsHalvesToEvenAgainstTheScale) {
  // max|x| = 127, so s = 1 and q = rint(x).
  const std::vector<float> x = {127.0f, -63.5f, 0.5f, 1.5f,  2.5f,
                                -2.5f,  64.0f,  0.0f, -0.49f};
  const std::string p = Encode(v1::ENCODING_INT8, x);
  ASSERT_EQ(p.size(), 4 + x.size());
  EXPECT_EQ(Word(p, 0), Bits(1.0f));
  const std::vector<int> want = {127, -64, 0, 2, 2, -2, 64, 0, 0};
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(static_cast<signed char>(p[4 + i]), want[i]) << i;
  }
  const std::vector<float> back = Decode(v1::ENCODING_INT8, p, x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], want[i]) << i;
}

TEST(CodecTest, Int8ScaleRules) {
  // s = m / 127 in binary32.
  {
    const std::vector<float> x = {0.3f, -1.7f, 0.01f};
    const std::string p = Encode(v1::ENCODING_INT8, x);
    const float s = 1.7f / 127.0f;
    EXPECT_EQ(Word(p, 0), Bits(s));
    EXPECT_EQ(static_cast<signed char>(p[5]), -127);
    EXPECT_EQ(static_cast<signed char>(p[4]), std::nearbyint(0.3f / s));
    const std::vector<float> back = Decode(v1::ENCODING_INT8, p, 3);
    EXPECT_EQ(back[1], -127.0f * s);
  }
  // All zero: s = 2^-126 (normal), and zeros come back as zeros.
  {
    const std::vector<float> x(5, 0.0f);
    const std::string p = Encode(v1::ENCODING_INT8, x);
    EXPECT_EQ(Word(p, 0), Bits(kFltMin));
    EXPECT_EQ(Decode(v1::ENCODING_INT8, p, 5), x);
  }
  // m / 127 subnormal: s = 2^-126 again; q = rint(x / 2^-126).
  {
    const std::vector<float> x = {3 * kFltMin, 2.5f * kFltMin, -kFltMin,
                                  1e-40f};
    const std::string p = Encode(v1::ENCODING_INT8, x);
    EXPECT_EQ(Word(p, 0), Bits(kFltMin));
    const std::vector<int> want = {3, 2, -1, 0};
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(static_cast<signed char>(p[4 + i]), want[i]) << i;
    }
    const std::vector<float> back = Decode(v1::ENCODING_INT8, p, 4);
    EXPECT_EQ(back,
              (std::vector<float>{3 * kFltMin, 2 * kFltMin, -kFltMin, 0.0f}));
  }
  // Near binary32's largest: s is lowered until 127 * s is finite.
  {
    const std::vector<float> x = {kFltMax, -kFltMax / 2, 1.0f};
    const std::string p = Encode(v1::ENCODING_INT8, x);
    const float s = FromBits(Word(p, 0));
    EXPECT_TRUE(std::isfinite(127.0f * s));
    EXPECT_LE(kFltMax / 127.0f - s, kFltMax / 127.0f * 0x1p-22f);
    EXPECT_EQ(static_cast<signed char>(p[4]), 127);
    const std::vector<float> back = Decode(v1::ENCODING_INT8, p, 3);
    EXPECT_TRUE(std::isfinite(back[0]));
    EXPECT_GT(back[0], 0.99f * kFltMax);
  }
}

TEST(CodecTest, Int8MatchesFormulaOnRandomGradients) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1e-2f);
  std::vector<float> x(100000);
  for (float& v : x) v = normal(rng);
  const std::string p = Encode(v1::ENCODING_INT8, x);
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  const float s = m / 127.0f;
  ASSERT_EQ(Word(p, 0), Bits(s));
  const std::vector<float> back = Decode(v1::ENCODING_INT8, p, x.size());
  int at_limit = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float q =
        std::clamp(std::nearbyint(x[i] / s), -127.0f, 127.0f);  // clamped
    ASSERT_EQ(static_cast<signed char>(p[4 + i]), q) << i;
    ASSERT_EQ(back[i], q * s) << i;
    at_limit += std::fabs(q) == 127;
  }
  EXPECT_GE(at_limit, 1);
}

TEST(CodecTest, Int8DecodeMultipliesQByScale) {
  std::string p;
  Put(&p, 0.5f);
  for (signed char q : {-127, 0, 3, 127}) Put(&p, q);
  EXPECT_EQ(Decode(v1::ENCODING_INT8, p, 4),
            (std::vector<float>{-63.5f, 0.0f, 1.5f, 63.5f}));
}

TEST(CodecTest, Int8DecodeRefusesBadScalesAndMinus128) {
  struct Case {
    float scale;
    const char* want;
  };
  const Case cases[] = {
      {0.0f, "(zero)"},        {-0.0f, "(zero)"},
      {-1.0f, "(negative)"},   {std::nanf(""), "(NaN)"},
      {kInf, "(infinite)"},    {-kInf, "(infinite)"},
      {1e-40f, "(subnormal)"}, {kFltMin / 2, "(subnormal)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    std::string p;
    Put(&p, c.scale);
    p.append(3, '\1');
    for (bool allow : {false, true}) {
      absl::Status s = DecodeStatus(v1::ENCODING_INT8, p, 3, allow);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(s.message(), HasSubstr("scale"));
      EXPECT_THAT(s.message(), HasSubstr(c.want));
    }
  }
  // 127 * s overflows: the values could be infinite.
  std::string big;
  Put(&big, 1e37f);
  big.append(3, '\1');
  absl::Status s = DecodeStatus(v1::ENCODING_INT8, big, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("127 * scale"));
  SHARDPS_EXPECT_OK(DecodeStatus(v1::ENCODING_INT8, big, 3, true));
  // The smallest normal scale is fine.
  std::string small;
  Put(&small, kFltMin);
  small.append(3, '\1');
  SHARDPS_EXPECT_OK(DecodeStatus(v1::ENCODING_INT8, small, 3));

  std::string minus;
  Put(&minus, 1.0f);
  for (signed char q : {1, 2, -128, -128}) Put(&minus, q);
  s = DecodeStatus(v1::ENCODING_INT8, minus, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("element 2 is -128"));
}

// The reference top-k: sort by |x| descending, lower index first among
// equals; the first k indices, ascending.
std::vector<uint32_t> ReferenceTopk(const std::vector<float>& x, int64_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return std::fabs(x[a]) > std::fabs(x[b]);
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<uint32_t> TopkIndices(const std::string& p) {
  const uint32_t k = Word(p, 0);
  std::vector<uint32_t> out;
  for (uint32_t j = 0; j < k; ++j) out.push_back(Word(p, 1 + j));
  return out;
}
std::vector<float> TopkValues(const std::string& p) {
  const uint32_t k = Word(p, 0);
  std::vector<float> out;
  for (uint32_t j = 0; j < k; ++j) out.push_back(FromBits(Word(p, 1 + k + j)));
  return out;
}

TEST(CodecTest, TopkKeepsLargestLowerIndexFirst) {
  const std::vector<float> x = {1.0f, -3.0f, 3.0f, 2.0f, -3.0f, 0.5f};
  // k = ceil(0.3 * 6) = 2: three |x| = 3 tie, indices 1 and 2 win.
  std::string p = Encode(v1::ENCODING_TOPK, x, 0.3);
  ASSERT_EQ(p.size(), 4u + 8 * 2);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(TopkValues(p), (std::vector<float>{-3.0f, 3.0f}));
  EXPECT_EQ(Decode(v1::ENCODING_TOPK, p, 6),
            (std::vector<float>{0, -3.0f, 3.0f, 0, 0, 0}));
  // k = 4: every 3, then the 2.
  p = Encode(v1::ENCODING_TOPK, x, 0.6);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{1, 2, 3, 4}));
  // k = 1: the first of the largest.
  p = Encode(v1::ENCODING_TOPK, x, 0.01);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{1}));
  EXPECT_EQ(TopkValues(p), (std::vector<float>{-3.0f}));
  // k = n: everything, in order.
  p = Encode(v1::ENCODING_TOPK, x, 1.0);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(TopkValues(p), x);
  EXPECT_EQ(Decode(v1::ENCODING_TOPK, p, 6), x);
}

TEST(CodecTest, TopkTiesWithinTheLowBits) {
  // Equal high 16 bits: the second histogram decides.
  const std::vector<float> x = {1.0f,
                                FromBits(0x3f800001u),
                                FromBits(0xbf800002u),
                                FromBits(0x3f800001u),
                                0.5f,
                                -0.0f};
  std::string p = Encode(v1::ENCODING_TOPK, x, 2.0 / 6.0 - 1e-9);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{1, 2}));
  // All zero: the first k.
  p = Encode(v1::ENCODING_TOPK, std::vector<float>(10, 0.0f), 0.3);
  EXPECT_EQ(TopkIndices(p), (std::vector<uint32_t>{0, 1, 2}));
}

TEST(CodecTest, TopkMatchesSortOnRandomGradientsWithTies) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 4; ++trial) {
    SCOPED_TRACE(trial);
    const int64_t n = 100000 + trial;
    std::vector<float> x(n);
    // Small integers (many ties) or normal-ish floats.
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    for (float& v : x) {
      v = trial % 2 ? normal(rng)
                    : static_cast<float>(static_cast<int>(rng() % 101) - 50);
    }
    for (double ratio : {0.001, 0.01, 0.3}) {
      const int64_t k = TopkCount(n, ratio);
      const std::string p = Encode(v1::ENCODING_TOPK, x, ratio);
      ASSERT_EQ(p.size(), static_cast<size_t>(4 + 8 * k));
      ASSERT_EQ(TopkIndices(p), ReferenceTopk(x, k));
      const std::vector<float> values = TopkValues(p);
      const std::vector<uint32_t> idx = TopkIndices(p);
      for (int64_t j = 0; j < k; ++j) ASSERT_EQ(values[j], x[idx[j]]);
    }
  }
}

TEST(CodecTest, TopkRefusesBadRatiosAndEmptyChunks) {
  const std::vector<float> x = {1.0f, 2.0f};
  for (double ratio : {0.0, -0.1, 1.5, std::nan("")}) {
    std::string out;
    absl::Status s =
        EncodePayload(v1::ENCODING_TOPK, x.data(), 2, ratio, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << ratio;
    EXPECT_THAT(s.message(), HasSubstr("ratio"));
  }
  std::string out;
  absl::Status s =
      EncodePayload(v1::ENCODING_TOPK, x.data(), 0, 0.5, nullptr, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, TopkDecodeRefusesMalformedPayloads) {
  // A payload of k entries for n = 10, from indices and values.
  auto make = [](uint32_t k, std::vector<uint32_t> indices,
                 std::vector<float> values) {
    std::string p;
    Put(&p, k);
    for (uint32_t i : indices) Put(&p, i);
    for (float v : values) Put(&p, v);
    return p;
  };
  struct Case {
    std::string payload;
    const char* want;
  };
  const float nan = std::nanf("");
  const Case cases[] = {
      {"", "needs at least the 4"},
      {std::string("\1\0", 2), "needs at least the 4"},
      {make(0, {}, {}), "count k is 0"},
      {make(11, {}, {}), "count k is 11"},
      {make(2, {1, 2}, {1.0f}), "index or value list truncated"},
      {make(2, {1}, {}), "index or value list truncated"},
      {make(1, {1}, {1.0f, 2.0f}), "trailing bytes"},
      {make(2, {1, 10}, {1.0f, 2.0f}), "entry 1 has index 10; there are 10"},
      {make(3, {1, 4, 4}, {1, 2, 3}), "entry 2 has index 4, a duplicate"},
      {make(3, {1, 5, 4}, {1, 2, 3}), "entry 2 has index 4, below entry 1's"},
      {make(2, {3, 7}, {1.0f, nan}), "entry 1 (element 7) is nan"},
      {make(2, {3, 7}, {-kInf, 1.0f}), "entry 0 (element 3) is -inf"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    absl::Status s = DecodeStatus(v1::ENCODING_TOPK, c.payload, 10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.want));
  }
  // Non-finite values pass with allow_nonfinite; structure errors do not.
  SHARDPS_EXPECT_OK(
      DecodeStatus(v1::ENCODING_TOPK, make(2, {3, 7}, {1.0f, nan}), 10, true));
  EXPECT_FALSE(
      DecodeStatus(v1::ENCODING_TOPK, make(2, {7, 3}, {1, 2}), 10, true).ok());
  // k = n is fine.
  std::vector<uint32_t> all(10);
  std::iota(all.begin(), all.end(), 0);
  SHARDPS_EXPECT_OK(DecodeStatus(v1::ENCODING_TOPK,
                                 make(10, all, std::vector<float>(10, 1)), 10));
}

TEST(CodecTest, DecodeRefusesWrongLengths) {
  struct Case {
    v1::Encoding encoding;
    size_t bytes;
    const char* want;
  };
  const Case cases[] = {
      {v1::ENCODING_FP32, 15,
       "ENCODING_FP32 payload has 15 bytes; 4 elements need 16"},
      {v1::ENCODING_FP32, 17, "need 16"},
      {v1::ENCODING_BF16, 7,
       "ENCODING_BF16 payload has 7 bytes; 4 elements need 8"},
      {v1::ENCODING_FP16, 10,
       "ENCODING_FP16 payload has 10 bytes; 4 elements need 8"},
      {v1::ENCODING_INT8, 4,
       "ENCODING_INT8 payload has 4 bytes; 4 elements need 8"},
      {v1::ENCODING_INT8, 0, "need 8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    absl::Status s = DecodeStatus(c.encoding, std::string(c.bytes, '\0'), 4);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.want));
  }
  for (v1::Encoding e :
       {v1::ENCODING_UNSPECIFIED, static_cast<v1::Encoding>(42)}) {
    EXPECT_EQ(DecodeStatus(e, std::string(16, '\0'), 4).code(),
              absl::StatusCode::kInvalidArgument);
    std::vector<float> x(4);
    std::string out;
    EXPECT_EQ(EncodePayload(e, x.data(), 4, 1.0, nullptr, &out).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(CodecTest, DecodeRefusesNonFiniteValuesUnlessAllowed) {
  struct Case {
    v1::Encoding encoding;
    std::string payload;
    const char* want;
  };
  auto halves = [](std::vector<uint16_t> h) {
    std::string p;
    for (uint16_t v : h) Put(&p, v);
    return p;
  };
  auto floats = [](std::vector<float> f) {
    std::string p;
    for (float v : f) Put(&p, v);
    return p;
  };
  const Case cases[] = {
      {v1::ENCODING_FP32, floats({1, 2, std::nanf(""), 4}), "element 2 is nan"},
      {v1::ENCODING_FP32, floats({1, 2, 3, -kInf}), "element 3 is -inf"},
      {v1::ENCODING_BF16, halves({0x3f80, 0x7f80, 0, 0}), "element 1 is inf"},
      {v1::ENCODING_BF16, halves({0, 0, 0, 0x7fc1}), "element 3 is nan"},
      {v1::ENCODING_FP16, halves({0x3c00, 0, 0xfc00, 0}), "element 2 is -inf"},
      {v1::ENCODING_FP16, halves({0x7e00, 0, 0, 0}), "element 0 is nan"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    absl::Status s = DecodeStatus(c.encoding, c.payload, 4);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.want));
    SHARDPS_EXPECT_OK(DecodeStatus(c.encoding, c.payload, 4, true));
  }
}

TEST(CodecTest, EncodeRefusesNonFiniteAndChangesNothing) {
  for (v1::Encoding e :
       {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16,
        v1::ENCODING_INT8, v1::ENCODING_TOPK}) {
    SCOPED_TRACE(v1::Encoding_Name(e));
    std::vector<float> x(100, 0.25f);
    x[7] = std::nanf("");
    x[9] = kInf;
    std::vector<float> r(100, 0.5f);
    std::string out = "unchanged";
    absl::Status s = EncodePayload(e, x.data(), 100, 0.1, r.data(), &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("element 7 is nan"));
    EXPECT_THAT(s.message(), HasSubstr("not finite"));
    EXPECT_EQ(out, "unchanged");
    EXPECT_EQ(r, std::vector<float>(100, 0.5f));
    // Finite gradient and residual whose sum overflows.
    x.assign(100, 0.25f);
    x[42] = 3e38f;
    r[42] = 3e38f;
    s = EncodePayload(e, x.data(), 100, 0.1, r.data(), &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("element 42 is inf (gradient"));
    EXPECT_THAT(s.message(), HasSubstr("plus residual"));
    EXPECT_EQ(out, "unchanged");
    r[42] = 0.5f;
    EXPECT_EQ(r, std::vector<float>(100, 0.5f));
  }
}

// Random gradients and residuals of mixed magnitudes, with some exact zeros,
// values below binary16's range and ties.
std::vector<float> MixedValues(std::mt19937* rng, int64_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = normal(*rng);
    if (i % 17 == 0) x[i] = 0.0f;
    if (i % 19 == 0) x[i] *= 1e-5f;
    if (i % 23 == 0) x[i] = FromBits((Bits(x[i]) & 0xffff0000u) | 0x8000u);
  }
  return x;
}

constexpr v1::Encoding kLossy[] = {v1::ENCODING_BF16, v1::ENCODING_FP16,
                                   v1::ENCODING_INT8, v1::ENCODING_TOPK};

TEST(CodecTest, ErrorFeedbackKeepsExactlyWhatWasNotSent) {
  std::mt19937 rng(13);
  for (v1::Encoding e : kLossy) {
    SCOPED_TRACE(v1::Encoding_Name(e));
    const int64_t n = 10000;
    const std::vector<float> x = MixedValues(&rng, n, 1e-2f);
    const std::vector<float> r_old = MixedValues(&rng, n, 1e-3f);
    std::vector<float> r = r_old;
    std::string p;
    SHARDPS_ASSERT_OK(EncodePayload(e, x.data(), n, 0.05, r.data(), &p));
    // Without feedback, the same y gives the same payload.
    std::vector<float> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] + r_old[i];
    EXPECT_EQ(Encode(e, y, 0.05), p);
    const std::vector<float> d = Decode(e, p, n);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(d[i] + r[i], y[i]) << i;
      ASSERT_EQ(r[i], y[i] - d[i]) << i;
      kept += r[i] != 0;
    }
    EXPECT_GT(kept, n / 10);  // lossy: many elements leave something
    if (e == v1::ENCODING_TOPK) {
      // Sent: the value itself, nothing kept; the rest is kept whole.
      for (uint32_t i : TopkIndices(p)) {
        EXPECT_EQ(r[i], 0.0f) << i;
        EXPECT_EQ(d[i], y[i]) << i;
      }
    }
  }
}

// The out-of-place encoder gives EncodePayload's bits, residual and errors.
TEST(CodecTest, OutOfPlaceResidualMatchesInPlace) {
  std::mt19937 rng(29);
  const int64_t n = 4099;  // not a multiple of any vector width
  for (v1::Encoding e :
       {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16,
        v1::ENCODING_INT8, v1::ENCODING_TOPK}) {
    SCOPED_TRACE(v1::Encoding_Name(e));
    const std::vector<float> x = MixedValues(&rng, n, 1e-2f);
    const std::vector<float> r_in = MixedValues(&rng, n, 1e-3f);
    std::vector<float> r_inplace = r_in;
    std::string inplace;
    SHARDPS_ASSERT_OK(
        EncodePayload(e, x.data(), n, 0.05, r_inplace.data(), &inplace));
    std::vector<float> r_out(n, -7.0f);
    std::string to = "stale bytes";
    SHARDPS_ASSERT_OK(
        EncodePayloadTo(e, x.data(), n, 0.05, r_in.data(), r_out.data(), &to));
    EXPECT_EQ(to, inplace);
    EXPECT_EQ(r_out, r_inplace);
    // Without a residual: the plain encoding.
    SHARDPS_ASSERT_OK(
        EncodePayloadTo(e, x.data(), n, 0.05, nullptr, nullptr, &to));
    EXPECT_EQ(to, Encode(e, x, 0.05));

    // Refusals name the same element, and leave residual_in alone.
    std::vector<float> bad = x;
    bad[3001] = std::nanf("");
    std::vector<float> r_copy = r_in;
    const absl::Status want =
        EncodePayload(e, bad.data(), n, 0.05, r_copy.data(), &inplace);
    const absl::Status got =
        EncodePayloadTo(e, bad.data(), n, 0.05, r_in.data(), r_out.data(), &to);
    EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(got.message(), want.message());
    EXPECT_THAT(got.message(), HasSubstr("element 3001 is nan"));
    if (e == v1::ENCODING_FP16) {
      bad = x;
      bad[17] = 65520.0f;
      EXPECT_THAT(EncodePayloadTo(e, bad.data(), n, 0.05, nullptr, nullptr, &to)
                      .message(),
                  HasSubstr("element 17 is 65520, beyond binary16"));
    }
  }
}

// Over many steps, what was sent plus what is still kept is what was pushed:
// exactly for top-k on integers, to within binary32 rounding of each step's
// x + residual otherwise.
TEST(CodecTest, ErrorFeedbackLosesNothingOverManySteps) {
  const int64_t n = 2000;
  const int steps = 200;
  for (v1::Encoding e : kLossy) {
    for (bool integers : {false, true}) {
      if (integers && e != v1::ENCODING_TOPK) continue;
      SCOPED_TRACE(absl::StrCat(v1::Encoding_Name(e), integers ? " ints" : ""));
      std::mt19937 rng(17);
      std::vector<float> r(n, 0.0f);
      std::vector<double> pushed(n, 0.0), sent(n, 0.0), plain(n, 0.0);
      std::vector<double> rounding(n, 0.0);  // sum of |y| over the steps
      for (int t = 0; t < steps; ++t) {
        std::vector<float> x = MixedValues(&rng, n, 1e-2f);
        if (integers) {
          for (float& v : x)
            v = static_cast<float>(static_cast<int>(rng() % 17) - 8);
        }
        for (int64_t i = 0; i < n; ++i) {
          pushed[i] += x[i];
          rounding[i] += std::fabs(static_cast<double>(x[i]) + r[i]);
        }
        std::string p;
        SHARDPS_ASSERT_OK(EncodePayload(e, x.data(), n, 0.01, r.data(), &p));
        const std::vector<float> d = Decode(e, p, n);
        const std::vector<float> without = Decode(e, Encode(e, x, 0.01), n);
        for (int64_t i = 0; i < n; ++i) {
          sent[i] += d[i];
          plain[i] += without[i];
        }
      }
      double worst = 0, worst_plain = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double error = std::fabs(sent[i] + r[i] - pushed[i]);
        // Each step's x + residual is rounded once to binary32 (half an ulp,
        // <= 2^-24 |y|); the double sums here are exact to far less.
        const double tolerance = integers ? 0.0 : 0x1p-24 * rounding[i] * 1.01;
        ASSERT_LE(error, tolerance) << i;
        worst = std::max(worst, error);
        worst_plain = std::max(worst_plain, std::fabs(plain[i] - pushed[i]));
      }
      // Without the residual the loss is far larger: the check has teeth.
      EXPECT_GT(worst_plain, 100 * worst + 1e-6);
    }
  }
}

}  // namespace
}  // namespace shardps
