// The parts of emulated hosts that need no root: reading a host's TCP
// counters and the lines the launcher prints. Making hosts is tested as root
// by tests/e2e/emulated_hosts_e2e_test.cc.
#include "deploy/local/emulated_hosts.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "deploy/local/link_shaping.h"
#include "gtest/gtest.h"

namespace shardps::local {
namespace {

// As Linux 6.1 writes it (Ip, Icmp and Udp lines around Tcp's).
constexpr char kSnmp[] =
    "Ip: Forwarding DefaultTTL InReceives\n"
    "Ip: 1 64 123\n"
    "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens "
    "AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs "
    "OutRsts InCsumErrors\n"
    "Tcp: 1 200 120000 -1 70479 62406 7778 7904 0 34921214 34870853 51681 0 "
    "15273 0\n"
    "Udp: InDatagrams NoPorts\n"
    "Udp: 5 6\n";

TEST(EmulatedHostsTest, ReadsTcpSegmentsByName) {
  int64_t segments = -1, retransmitted = -1;
  ASSERT_TRUE(ParseTcpSegments(kSnmp, &segments, &retransmitted));
  EXPECT_EQ(segments, 34870853);
  EXPECT_EQ(retransmitted, 51681);
}

TEST(EmulatedHostsTest, SaysSoWhenTcpCountersAreMissing) {
  int64_t segments = -1, retransmitted = -1;
  EXPECT_FALSE(ParseTcpSegments("", &segments, &retransmitted));
  EXPECT_FALSE(
      ParseTcpSegments("Ip: Forwarding\nIp: 1\n", &segments, &retransmitted));
  // Names without values, and values without RetransSegs.
  EXPECT_FALSE(ParseTcpSegments("Tcp: OutSegs RetransSegs\n", &segments,
                                &retransmitted));
  EXPECT_FALSE(ParseTcpSegments("Tcp: OutSegs InSegs\nTcp: 5 6\n", &segments,
                                &retransmitted));
  EXPECT_FALSE(ParseTcpSegments("Tcp: OutSegs RetransSegs\nTcp: 5 x\n",
                                &segments, &retransmitted));
}

TEST(EmulatedHostsTest, PrintsEachHostsBytesAndRetransmissions) {
  std::vector<HostLinkBytes> bytes(2);
  bytes[0] = {"server-0", "10.213.0.2", 3 << 20, 1 << 20, 2000, 30};
  bytes[1] = {"worker-0", "10.213.0.3", 2048, 4096, -1, -1};
  const std::string text = FormatLinkBytes(bytes, TbfShapeFor(1000000000));
  EXPECT_TRUE(absl::StartsWith(
      text, "bytes over each host's link (1 Gbit/s each way):\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "  server-0     10.213.0.2   sent    3.0 MiB  received    1.0 MiB  TCP "
      "retransmitted 1.50 %\n"))
      << text;
  // Unknown counters: the line stops after the bytes.
  EXPECT_TRUE(absl::StrContains(
      text,
      "  worker-0     10.213.0.3   sent    2.0 KiB  received    4.0 KiB\n"))
      << text;
}

}  // namespace
}  // namespace shardps::local
