#include "deploy/local/link_shaping.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/link_rate.h"
#include "gtest/gtest.h"

namespace shardps::local {
namespace {

TEST(LinkShapingTest, ParsesRatesAsTcWritesThem) {
  const struct {
    std::string rate;
    int64_t bits;
  } cases[] = {{"1gbit", 1000000000},   {"10GBit", 10000000000},
               {"2.5gbit", 2500000000}, {"500mbit", 500000000},
               {"1000kbit", 1000000},   {"400gbit", 400000000000}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.rate);
    absl::StatusOr<int64_t> bits = ParseLinkRate(c.rate);
    ASSERT_TRUE(bits.ok()) << bits.status();
    EXPECT_EQ(*bits, c.bits);
  }
}

TEST(LinkShapingTest, RefusesWhatIsNotARateNamingIt) {
  for (const std::string rate :
       {"", "fast", "gbit", "1", "1gbps", "1gb", "0.5mbit", "401gbit", "1.x"}) {
    SCOPED_TRACE(rate);
    absl::StatusOr<int64_t> bits = ParseLinkRate(rate);
    ASSERT_FALSE(bits.ok());
    EXPECT_EQ(bits.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bits.status().message().find("--link=" + rate + ":"),
              std::string::npos)
        << bits.status();
  }
}

TEST(LinkShapingTest, FormatsRates) {
  EXPECT_EQ(FormatLinkRate(1000000000), "1 Gbit/s");
  EXPECT_EQ(FormatLinkRate(2500000000), "2.5 Gbit/s");
  EXPECT_EQ(FormatLinkRate(500000000), "500 Mbit/s");
}

TEST(LinkShapingTest, BucketHoldsATickAndTwoTsoPackets) {
  // 1 Gbit/s: 125 MB/s over 250 ticks is 500000 bytes, rounded up to KiB.
  const TbfShape gbit = TbfShapeFor(1000000000);
  EXPECT_EQ(gbit.burst_bytes, 489 * 1024);
  EXPECT_EQ(gbit.latency_ms, 5);
  EXPECT_EQ(TbfArgs(gbit), "tbf rate 1000000000bit burst 500736 latency 5ms");
  // 100 Mbit/s: a tick is 50000 bytes, less than two 64 KiB packets.
  EXPECT_EQ(TbfShapeFor(100000000).burst_bytes, 128 * 1024);
}

}  // namespace
}  // namespace shardps::local
