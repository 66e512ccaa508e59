#include "common/crc32c.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(Crc32cTest, MatchesTheStandardCheckValue) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(Crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
}

TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  // Lengths around the 8-byte slices, and a long tail.
  std::string bytes;
  for (int i = 0; i < 1000; ++i) bytes.push_back(static_cast<char>(i * 37));
  for (const size_t split : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    SCOPED_TRACE(split);
    const uint32_t a = Crc32c(0, bytes.data(), split);
    const uint32_t b = Crc32c(0, bytes.data() + split, bytes.size() - split);
    EXPECT_EQ(Crc32cCombine(a, b, bytes.size() - split),
              Crc32c(0, bytes.data(), bytes.size()));
  }
}

}  // namespace
}  // namespace shardps
