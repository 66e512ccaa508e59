// DecodePayload from bytes in pieces (a message's slices) against
// DecodePayload of the bytes joined: the same bits and the same errors,
// wherever the pieces cut the payload, elements included.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

// The bytes, cut after each offset in `cuts` (ascending).
class CutSource final : public ByteSource {
 public:
  CutSource(absl::string_view bytes, std::vector<size_t> cuts)
      : bytes_(bytes), cuts_(std::move(cuts)) {}
  uint64_t size() const override { return bytes_.size(); }
  void ForEachPiece(
      absl::FunctionRef<void(absl::string_view)> piece) const override {
    size_t at = 0;
    for (size_t cut : cuts_) {
      if (cut <= at || cut >= bytes_.size()) continue;
      piece(bytes_.substr(at, cut - at));
      at = cut;
    }
    if (at < bytes_.size()) piece(bytes_.substr(at));
  }

 private:
  absl::string_view bytes_;
  std::vector<size_t> cuts_;
};

// Ways to cut `size` bytes: every byte, every 3 or 7 bytes, at random
// offsets, and not at all.
std::vector<std::vector<size_t>> Cuts(size_t size, uint32_t seed) {
  std::vector<std::vector<size_t>> all;
  for (size_t every : {1, 3, 7}) {
    std::vector<size_t> cuts;
    for (size_t at = every; at < size; at += every) cuts.push_back(at);
    all.push_back(std::move(cuts));
  }
  std::mt19937 rng(seed);
  std::vector<size_t> random;
  for (size_t at = 1 + rng() % 5; at < size; at += 1 + rng() % 97) {
    random.push_back(at);
  }
  all.push_back(std::move(random));
  all.push_back({});
  return all;
}

std::string Label(const std::vector<size_t>& cuts) {
  return cuts.empty()
             ? std::string("uncut")
             : absl::StrCat(cuts.size() + 1, " pieces, first cut at ", cuts[0]);
}

// Decodes `payload` both ways and expects the same status and, when OK,
// the same bits, for every way of cutting it.
void ExpectSameBothWays(v1::Encoding encoding, const std::string& payload,
                        int64_t n, bool allow_nonfinite) {
  std::vector<float> joined(n, -1.0f);
  const absl::Status want = DecodePayload(encoding, absl::string_view(payload),
                                          n, allow_nonfinite, joined.data());
  for (const std::vector<size_t>& cuts : Cuts(payload.size(), n)) {
    SCOPED_TRACE(absl::StrCat(EncodingName(encoding), ", ", Label(cuts)));
    std::vector<float> pieces(n, -2.0f);
    const absl::Status got = DecodePayload(encoding, CutSource(payload, cuts),
                                           n, allow_nonfinite, pieces.data());
    EXPECT_EQ(got, want);
    if (want.ok() && got.ok()) {
      EXPECT_EQ(std::memcmp(pieces.data(), joined.data(), n * 4), 0);
    }
  }
}

std::vector<float> Gradient(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// x encoded without error feedback; the test fails on an error.
std::string Payload(v1::Encoding encoding, const std::vector<float>& x,
                    double topk_ratio) {
  std::string payload;
  EXPECT_TRUE(EncodePayload(encoding, x.data(), static_cast<int64_t>(x.size()),
                            topk_ratio, nullptr, &payload)
                  .ok());
  return payload;
}

constexpr v1::Encoding kEncodings[] = {v1::ENCODING_FP32, v1::ENCODING_BF16,
                                       v1::ENCODING_FP16, v1::ENCODING_INT8,
                                       v1::ENCODING_TOPK};

TEST(CodecPiecesTest, EveryEncodingDecodesTheSameBitsWhereverItIsCut) {
  const int64_t n = 1001;
  const std::vector<float> x = Gradient(n, 7);
  for (v1::Encoding encoding : kEncodings) {
    const std::string payload = Payload(encoding, x, 0.1);
    ExpectSameBothWays(encoding, payload, n, /*allow_nonfinite=*/false);
    ExpectSameBothWays(encoding, payload, n, /*allow_nonfinite=*/true);
  }
}

TEST(CodecPiecesTest, ANonFiniteValueIsRefusedNamingItsElementEvenWhenCut) {
  const int64_t n = 333;
  const std::vector<float> x = Gradient(n, 11);
  for (v1::Encoding encoding :
       {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16}) {
    const std::string payload = Payload(encoding, x, 1.0);
    // Element 101 becomes a NaN (FP32: all ones; BF16 and FP16: exponent
    // all ones, mantissa nonzero), then infinity.
    const int width = encoding == v1::ENCODING_FP32 ? 4 : 2;
    for (uint32_t bits : {0xffffffffu, 0x7f800000u}) {
      if (width == 2) {
        bits = encoding == v1::ENCODING_BF16
                   ? bits >> 16
                   : (bits == 0x7f800000u ? 0x7c00u : 0xffffu);
      }
      std::string bad = payload;
      std::memcpy(bad.data() + 101 * width, &bits, width);
      std::vector<float> out(n);
      const absl::Status joined =
          DecodePayload(encoding, absl::string_view(bad), n, false, out.data());
      ASSERT_FALSE(joined.ok());
      EXPECT_NE(joined.message().find("element 101"), std::string::npos)
          << joined;
      ExpectSameBothWays(encoding, bad, n, /*allow_nonfinite=*/false);
      ExpectSameBothWays(encoding, bad, n, /*allow_nonfinite=*/true);
    }
  }
}

TEST(CodecPiecesTest, AWrongLengthIsRefusedAsWhenJoined) {
  const int64_t n = 64;
  const std::vector<float> x = Gradient(n, 3);
  for (v1::Encoding encoding : kEncodings) {
    const std::string payload = Payload(encoding, x, 0.5);
    for (const std::string& wrong : {payload.substr(0, payload.size() - 1),
                                     payload + "x", std::string()}) {
      std::vector<float> out(n);
      ASSERT_FALSE(DecodePayload(encoding, absl::string_view(wrong), n, false,
                                 out.data())
                       .ok());
      ExpectSameBothWays(encoding, wrong, n, /*allow_nonfinite=*/false);
    }
  }
}

// AddDecodedPayload against DecodePayload and a binary32 add, for every way
// of cutting `payload`: the same status, the same sum when OK, and the sum
// untouched on error.
void ExpectAddedAsDecoded(v1::Encoding encoding, const std::string& payload,
                          int64_t n, bool allow_nonfinite,
                          const std::vector<float>& start) {
  std::vector<float> decoded(n);
  const absl::Status want = DecodePayload(encoding, absl::string_view(payload),
                                          n, allow_nonfinite, decoded.data());
  std::vector<float> want_sum = start;
  for (int64_t i = 0; i < n; ++i) want_sum[i] += decoded[i];
  for (const std::vector<size_t>& cuts : Cuts(payload.size(), n + 1)) {
    SCOPED_TRACE(absl::StrCat(EncodingName(encoding), ", ", Label(cuts)));
    std::vector<float> sum = start;
    const absl::Status got = AddDecodedPayload(
        encoding, CutSource(payload, cuts), n, allow_nonfinite, sum.data());
    EXPECT_EQ(got, want);
    const std::vector<float>& expected = want.ok() ? want_sum : start;
    EXPECT_EQ(std::memcmp(sum.data(), expected.data(), n * 4), 0);
  }
}

TEST(CodecPiecesTest, AddingADecodedPayloadIsDecodingThenOneAddPerElement) {
  const int64_t n = 777;
  const std::vector<float> x = Gradient(n, 5);
  // A running sum with signed zeros, large and tiny values.
  std::vector<float> start = Gradient(n, 6);
  start[0] = -0.0f;
  start[1] = 0.0f;
  start[2] = 3e38f;
  start[3] = 1e-40f;
  for (v1::Encoding encoding : kEncodings) {
    const std::string payload = Payload(encoding, x, 0.1);
    ExpectAddedAsDecoded(encoding, payload, n, false, start);
    ExpectAddedAsDecoded(encoding, payload, n, true, start);
    // Refused: a wrong length, and (FP32, BF16, FP16) an infinity at
    // element 500; accepted with allow_nonfinite.
    ExpectAddedAsDecoded(encoding, payload.substr(1), n, false, start);
    if (encoding == v1::ENCODING_FP32 || encoding == v1::ENCODING_BF16 ||
        encoding == v1::ENCODING_FP16) {
      const int width = encoding == v1::ENCODING_FP32 ? 4 : 2;
      const uint32_t inf = encoding == v1::ENCODING_FP32   ? 0x7f800000u
                           : encoding == v1::ENCODING_BF16 ? 0x7f80u
                                                           : 0x7c00u;
      std::string bad = payload;
      std::memcpy(bad.data() + 500 * width, &inf, width);
      ExpectAddedAsDecoded(encoding, bad, n, false, start);
      ExpectAddedAsDecoded(encoding, bad, n, true, start);
    }
  }
}

}  // namespace
}  // namespace shardps
