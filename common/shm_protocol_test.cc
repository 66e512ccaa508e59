#include "common/shm_protocol.h"

#include <cstdint>
#include <random>
#include <vector>

#include "common/message_ring.h"
#include "common/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardps::shm {
namespace {

using ::testing::HasSubstr;

TEST(ShmProtocolTest, RegionNamesRoundTrip) {
  const std::string text = FormatRegion("/proc/12/fd/7", 4096);
  EXPECT_EQ(text, "/proc/12/fd/7 4096");
  SHARDPS_ASSERT_OK_AND_ASSIGN(RegionName name,
                               ParseRegion(kStreamRegionKey, text));
  EXPECT_EQ(name.path, "/proc/12/fd/7");
  EXPECT_EQ(name.bytes, 4096u);
}

TEST(ShmProtocolTest, MalformedNamesAreRefusedNamingTheKey) {
  for (const char* bad :
       {"", "/proc/1/fd/2", "/proc/1/fd/2 -1", "/proc/1/fd/2 12x", " 12"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<RegionName> name = ParseRegion(kGradientRegionKey, bad);
    ASSERT_FALSE(name.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(name.status()));
    EXPECT_THAT(std::string(name.status().message()),
                HasSubstr(kGradientRegionKey));
  }
}

TEST(ShmProtocolTest, RingPlacesRoundTripAndRefuseMalformedText) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(RingPlace place,
                               ParseRings(FormatRings({128, 8192})));
  EXPECT_EQ(place.offset, 128u);
  EXPECT_EQ(place.bytes, 8192u);
  for (const char* bad : {"", "1", "1 2 3", "a 2"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(ParseRings(bad).status()));
  }
}

TEST(ShmProtocolTest, StreamRegionPlacesGradientsThenWeightsThenRings) {
  const std::vector<int64_t> bytes = {4, 100, 64};
  const StreamLayout layout = PlanStreamRegion(bytes);
  EXPECT_EQ(layout.gradient_at, (std::vector<uint64_t>{0, 64, 192}));
  EXPECT_EQ(layout.weights_at, (std::vector<uint64_t>{256, 320, 448}));
  EXPECT_EQ(layout.payload_bytes, 512u);
  EXPECT_EQ(layout.rings.offset, 512u);
  EXPECT_EQ(layout.rings.bytes, MessageRing::BytesFor(3, kRingMessageBytes));
  EXPECT_EQ(layout.bytes(false), 512u);
  EXPECT_EQ(layout.bytes(true), 512u + 2 * layout.rings.bytes);
}

// The shard's limit holds for every region a worker plans for any of its
// chunks: the two sides cannot drift apart.
TEST(ShmProtocolTest, ShardLimitsBoundEveryPlannedRegion) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> owned(1 + random() % 40);
    uint64_t owned_bytes = 0;
    for (int64_t& b : owned) {
      b = 4 * (1 + random() % 300000);
      owned_bytes += b;
    }
    // A lane carries a subset of the shard's chunks.
    std::vector<int64_t> lane;
    for (int64_t b : owned) {
      if (random() % 2 == 0) lane.push_back(b);
    }
    EXPECT_LE(PlanStreamRegion(lane).bytes(true),
              MaxStreamRegionBytes(owned_bytes, owned.size()));
    EXPECT_LE(PlanStreamRegion(owned).bytes(true),
              MaxStreamRegionBytes(owned_bytes, owned.size()));
    uint64_t buffer_bytes = 0;
    const std::vector<uint64_t> at = PlanBufferRegion(owned, &buffer_bytes);
    EXPECT_LE(buffer_bytes, MaxBufferRegionBytes(owned_bytes, owned.size()));
    for (size_t i = 0; i < at.size(); ++i) {
      EXPECT_EQ(at[i] % kAlignment, 0u);
      if (i + 1 < at.size()) {
        EXPECT_GE(at[i + 1] - at[i], static_cast<uint64_t>(owned[i]));
      }
    }
  }
}

TEST(ShmProtocolTest, FallbackIsUnavailableWithThePrefixOnly) {
  EXPECT_TRUE(IsFallback(Unavailable("cannot map")));
  EXPECT_EQ(Unavailable("x").message(), std::string(kErrorPrefix) + "x");
  EXPECT_FALSE(IsFallback(absl::UnavailableError("shard restarting")));
  EXPECT_FALSE(
      IsFallback(absl::InvalidArgumentError(std::string(kErrorPrefix) + "x")));
  // Context prefixed later hides it: test where the shard's status arrives.
  EXPECT_FALSE(IsFallback(WithPrefix("step 3", Unavailable("x"))));
}

}  // namespace
}  // namespace shardps::shm
