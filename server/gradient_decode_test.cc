#include "server/gradient_decode.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::server {
namespace {

std::string Fp32(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

TEST(GradientDecodeTest, Fp32PayloadIsCopiedExactly) {
  const std::vector<float> want = {1.5f, -0.0f, 3e-38f, 1e30f};
  const std::string bytes = Fp32(want);
  SHARDPS_ASSERT_OK(CheckGradientPayload(v1::ENCODING_FP32, bytes.size(), 4));
  ChunkSpec spec;
  spec.id = 3;
  spec.num_elements = 4;
  std::vector<float> got(4);
  SHARDPS_ASSERT_OK(DecodeGradient(v1::ENCODING_FP32, StringByteSource(bytes),
                                   {0, &spec, "w"}, false, got.data()));
  EXPECT_EQ(std::memcmp(got.data(), want.data(), 16), 0);
}

TEST(GradientDecodeTest, ANonFiniteValueInTheLastPieceOfALargePayloadIsFound) {
  // Larger than one piece of StringByteSource: checked piece by piece.
  std::vector<float> values(300000, 0.25f);
  values[299999] = std::nanf("");
  const std::string bytes = Fp32(values);
  ChunkSpec spec;
  spec.id = 1;
  spec.offset = 10;
  spec.num_elements = 300000;
  std::vector<float> got(300000);
  const absl::Status s =
      DecodeGradient(v1::ENCODING_FP32, StringByteSource(bytes),
                     {2, &spec, "w"}, false, got.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("non-finite value at element 300009"),
            std::string::npos)
      << s;
  values[299999] = 1;
  const std::string fine = Fp32(values);
  SHARDPS_ASSERT_OK(DecodeGradient(v1::ENCODING_FP32, StringByteSource(fine),
                                   {2, &spec, "w"}, false, got.data()));
  EXPECT_EQ(got, values);
}

TEST(GradientDecodeTest, WrongLengthOrEncodingIsInvalidArgument) {
  EXPECT_EQ(CheckGradientPayload(v1::ENCODING_FP32, 15, 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckGradientPayload(static_cast<v1::Encoding>(7), 16, 4).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GradientDecodeTest, NonFiniteValueIsNamedUnlessAllowed) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::string bytes = Fp32({0, 1, inf, 2});
  ChunkSpec spec;
  spec.id = 5;
  spec.offset = 100;
  spec.num_elements = 4;
  std::vector<float> got(4);
  const absl::Status s =
      DecodeGradient(v1::ENCODING_FP32, StringByteSource(bytes),
                     {2, &spec, "fc1.weight"}, false, got.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("chunk 5 (fc1.weight) from rank 2"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("element 102"), std::string::npos) << s;
  SHARDPS_EXPECT_OK(DecodeGradient(v1::ENCODING_FP32, StringByteSource(bytes),
                                   {2, &spec, "fc1.weight"}, true, got.data()));
  EXPECT_EQ(got[2], inf);
}

}  // namespace
}  // namespace shardps::server
