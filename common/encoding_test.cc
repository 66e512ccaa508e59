#include "common/encoding.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(EncodingTest, CheckPayloadWantsExactFp32Length) {
  const uint64_t payload = 12;
  EXPECT_TRUE(CheckPayload(v1::ENCODING_FP32, payload, 3).ok());
  absl::Status s = CheckPayload(v1::ENCODING_FP32, payload, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs 16"), absl::string_view::npos) << s;
  EXPECT_EQ(CheckPayload(v1::ENCODING_UNSPECIFIED, payload, 3).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckPayload(static_cast<v1::Encoding>(42), payload, 3).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EncodingTest, FindsFirstNonFiniteValue) {
  std::vector<float> x(5000, 1.5f);
  EXPECT_EQ(FirstNonFinite(x.data(), x.size()), -1);
  x[4097] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FirstNonFinite(x.data(), x.size()), 4097);
  x[3] = std::nanf("");
  EXPECT_EQ(FirstNonFinite(x.data(), x.size()), 3);
  x[3] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(FirstNonFinite(x.data(), x.size()), 3);
  EXPECT_EQ(FirstNonFinite(x.data(), 0), -1);
}

TEST(EncodingTest, StringByteSourceCopiesInPiecesThatFitInCache) {
  std::string bytes(200 << 10, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i);
  std::string out(bytes.size(), 'x');
  std::vector<uint64_t> reports;
  StringByteSource(bytes).CopyTo(out.data(), [&](uint64_t copied) {
    // What is reported is already there.
    EXPECT_EQ(out.compare(0, copied, bytes, 0, copied), 0);
    reports.push_back(copied);
  });
  EXPECT_EQ(out, bytes);
  EXPECT_EQ(reports,
            std::vector<uint64_t>({64 << 10, 128 << 10, 192 << 10, 200 << 10}));
  // Nothing to copy: no piece, no report.
  reports.clear();
  StringByteSource("").CopyTo(out.data(),
                              [&](uint64_t c) { reports.push_back(c); });
  EXPECT_TRUE(reports.empty());
  // The pieces themselves, where the bytes lie.
  std::vector<const char*> starts;
  StringByteSource(bytes).ForEachPiece(
      [&](absl::string_view piece) { starts.push_back(piece.data()); });
  EXPECT_EQ(starts,
            std::vector<const char*>({bytes.data(), bytes.data() + (64 << 10),
                                      bytes.data() + (128 << 10),
                                      bytes.data() + (192 << 10)}));
}

}  // namespace
}  // namespace shardps
