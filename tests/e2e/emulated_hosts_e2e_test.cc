// shardps-local --emulate_hosts end to end: a short job with every process on
// an emulated host of its own, whose link carried that process's traffic,
// and nothing of the run's left afterwards (needs root, ip and tc); and the
// clean refusals: a bad --link, one flag without the other, no root.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "deploy/local/link_shaping.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::CommandResult;
using ::shardps::testing::MustRun;

constexpr int64_t kKiB = 1024;

// "12.3 MiB" as bytes; -1 if it is not a number and a unit.
int64_t ParseBytes(absl::string_view number, absl::string_view unit) {
  double value = 0;
  if (!absl::SimpleAtod(number, &value)) return -1;
  if (unit == "B") return static_cast<int64_t>(value);
  if (unit == "KiB") return static_cast<int64_t>(value * kKiB);
  if (unit == "MiB") return static_cast<int64_t>(value * kKiB * kKiB);
  if (unit == "GiB") return static_cast<int64_t>(value * kKiB * kKiB * kKiB);
  return -1;
}

struct LinkLine {
  int64_t sent = -1;
  int64_t received = -1;
  double retransmitted_percent = -1;
};

// The launcher's line for `host`: "  server-0  10.213.0.2  sent 3.3 MiB
// received 3.1 MiB  TCP retransmitted 0.00 %"; -1s when there is none.
LinkLine FindLinkLine(const std::string& output, const std::string& host) {
  LinkLine found;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    const std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.size() >= 8 && f[0] == host && f[2] == "sent" && f[5] == "received") {
      found.sent = ParseBytes(f[3], f[4]);
      found.received = ParseBytes(f[6], f[7]);
      if (f.size() == 12 && f[8] == "TCP" && f[9] == "retransmitted" &&
          f[11] == "%" &&
          !absl::SimpleAtod(f[10], &found.retransmitted_percent)) {
        found.retransmitted_percent = -1;
      }
    }
  }
  return found;
}

// "shardps-<pid>-", from the launcher's line naming its namespaces.
std::string NamespacePrefix(const std::string& output) {
  const std::string before = "network namespace ";
  const size_t at = output.find(before);
  if (at == std::string::npos) return "";
  const size_t start = at + before.size();
  const size_t end = output.find("<name>", start);
  return end == std::string::npos ? "" : output.substr(start, end - start);
}

TEST(EmulatedHostsE2eTest, EveryProcessTrainsOverItsOwnLink) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  absl::StatusOr<local::NetworkTools> tools =
      local::FindNetworkTools("this test");
  if (!tools.ok()) GTEST_SKIP() << tools.status().message();
  const std::string run_dir = testing::MakeTempDir("shardps-hosts") + "/run";
  // 64 KiB chunks spread the first layer over both servers.
  const CommandResult done =
      MustRun(SHARDPS_LOCAL_BIN,
              {"--emulate_hosts", "--link=1gbit", "--servers=2", "--workers=2",
               "--dataset=fashion-mnist", "--model=mlp:784-32-10", "--epochs=1",
               "--train_limit=2048", "--test_limit=1000", "--batch_size=128",
               "--chunk_kib=64", "--timeout_s=240", "--run_dir=" + run_dir},
              absl::Minutes(5));
  const std::string& output = done.output;
  ASSERT_EQ(done.code, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "\nfinal: epoch=1 step=16 ")) << output;
  EXPECT_TRUE(absl::StrContains(output, "(1 Gbit/s each way):")) << output;
  // CUBIC where this machine lets namespaces choose it, else Reno, said.
  std::ifstream allowed_file(
      "/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  const std::string allowed(std::istreambuf_iterator<char>(allowed_file), {});
  const bool cubic_allowed = absl::c_linear_search(
      absl::StrSplit(allowed, absl::ByAnyChar(" \n")), "cubic");
  EXPECT_TRUE(absl::StrContains(output, cubic_allowed
                                            ? "TCP congestion control cubic;"
                                            : "TCP congestion control reno;"))
      << allowed << output;
  EXPECT_EQ(
      absl::StrContains(output, "net.ipv4.tcp_allowed_congestion_control"),
      !cubic_allowed)
      << output;

  // Each server and worker was given the link's rate and sized its
  // connections' receive buffers by it (2.5 ms of 1 Gbit/s).
  for (const char* worker : {"worker-0", "worker-1"}) {
    const std::string log =
        testing::ReadFile(absl::StrCat(run_dir, "/logs/", worker, ".log"));
    EXPECT_TRUE(absl::StrContains(
        log, "every connection to a server has a 305.2 KiB TCP receive buffer"))
        << worker << ": " << log;
  }
  // Over gRPC each step but the epoch's last computed the next batch's
  // first layer while its replies came (the lead logs the epoch).
  const std::string lead_log =
      testing::ReadFile(absl::StrCat(run_dir, "/logs/worker-0.log"));
  EXPECT_TRUE(absl::StrContains(
      lead_log,
      "epoch 1: the next batch's first layer was computed while the "
      "replies came in 15 of 16 steps\n"))
      << lead_log;
  for (const char* server : {"server-0", "server-1"}) {
    const std::string log =
        testing::ReadFile(absl::StrCat(run_dir, "/logs/", server, ".log"));
    EXPECT_TRUE(absl::StrContains(
        log,
        "link 1 Gbit/s: every connection's TCP receive buffer is 305.2 "
        "KiB"))
        << server << ": " << log;
  }

  // 16 steps of 25450 fp32 gradients out and weights back per worker: 1.6
  // MB each way; each server holds part of the model. The coordinator's
  // joins and heartbeats are a few KiB.
  const LinkLine coordinator = FindLinkLine(output, "coordinator");
  EXPECT_GT(coordinator.sent, 0) << output;
  EXPECT_GT(coordinator.received, 0) << output;
  for (const char* host : {"server-0", "server-1", "worker-0", "worker-1"}) {
    SCOPED_TRACE(host);
    const LinkLine link = FindLinkLine(output, host);
    EXPECT_GT(link.sent, 256 * kKiB) << output;
    EXPECT_GT(link.received, 256 * kKiB) << output;
    // Its own TCP stack's counters: a share, read in its namespace.
    EXPECT_GE(link.retransmitted_percent, 0) << output;
    EXPECT_LT(link.retransmitted_percent, 100) << output;
  }

  // Every link lives in the run's namespaces, and those are gone.
  const std::string prefix = NamespacePrefix(output);
  ASSERT_TRUE(absl::StartsWith(prefix, "shardps-")) << output;
  const CommandResult namespaces =
      MustRun(tools->ip, {"netns", "list"}, absl::Seconds(10));
  ASSERT_EQ(namespaces.code, 0) << namespaces.output;
  EXPECT_FALSE(absl::StrContains(namespaces.output, prefix))
      << namespaces.output;
}

TEST(EmulatedHostsE2eTest, BadLinkFlagsAreRefusedWithOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--emulate_hosts", "--link=fast"},
       "--link=fast: not a number and a unit"},
      {{"--emulate_hosts", "--link=1gbps"}, "unknown unit \"gbps\""},
      {{"--emulate_hosts"}, "--emulate_hosts needs --link=RATE"},
      {{"--link=1gbit"}, "--link shapes the links of --emulate_hosts"},
  };
  const std::string run_dir = testing::MakeTempDir("shardps-hosts") + "/run";
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args.back());
    std::vector<std::string> args = c.args;
    args.push_back("--run_dir=" + run_dir);
    const CommandResult done = MustRun(SHARDPS_LOCAL_BIN, args);
    EXPECT_EQ(done.code, 1) << done.output;
    EXPECT_TRUE(absl::StrContains(done.output, c.message)) << done.output;
    EXPECT_EQ(std::count(done.output.begin(), done.output.end(), '\n'), 1)
        << done.output;
  }
  EXPECT_FALSE(std::filesystem::exists(run_dir));
}

TEST(EmulatedHostsE2eTest, WithoutRootNothingStarts) {
  std::vector<std::string> args = {"--emulate_hosts", "--link=1gbit",
                                   "--run_dir=/nonexistent/run"};
  std::string binary = SHARDPS_LOCAL_BIN;
  if (geteuid() == 0) {
    // As nobody, the way a user without root would run it.
    binary = "/usr/bin/setpriv";
    if (access(binary.c_str(), X_OK) != 0) {
      GTEST_SKIP() << "root, and no /usr/bin/setpriv to drop it";
    }
    args.insert(args.begin(), {"--reuid=65534", "--regid=65534",
                               "--clear-groups", SHARDPS_LOCAL_BIN});
  }
  const CommandResult done = MustRun(binary, args);
  EXPECT_EQ(done.code, 1) << done.output;
  EXPECT_TRUE(absl::StrContains(done.output, "--emulate_hosts needs root"))
      << done.output;
  EXPECT_EQ(std::count(done.output.begin(), done.output.end(), '\n'), 1)
      << done.output;
}

}  // namespace
}  // namespace shardps
