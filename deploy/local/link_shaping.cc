#include "deploy/local/link_shaping.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace shardps::local {
namespace {

// tc-tbf(8): to reach its rate the bucket must hold at least rate / HZ
// bytes. tbf adds tokens for the time since its last dequeue, capped at the
// bucket, and a dequeue can come a tick late; what overflows meanwhile is
// lost and the rate falls short. Debian's kernels run at HZ=250.
constexpr int64_t kTicksPerSecond = 250;
// veth hands tbf TSO packets of up to 64 KiB; a bucket smaller than one
// would make tbf cut each into MTU segments (CPU) or stall it. Two of them.
constexpr int64_t kMinBurstBytes = 128 << 10;
// How long a packet may queue before tbf drops it: the queue then holds
// this much of the rate (625 KB at 1 Gbit/s), orders of magnitude above
// the veth's own bandwidth-delay product (~30 us), so TCP keeps the link
// busy after it backs off on a drop, and the round trip stays that of a
// shallow-buffered switch rather than of a bloated queue.
constexpr int kLatencyMs = 5;

std::string FindTool(const std::string& name) {
  const char* path = getenv("PATH");
  std::vector<std::string> dirs =
      absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty());
  for (const char* d : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    dirs.push_back(d);
  }
  for (const std::string& d : dirs) {
    const std::string candidate = d + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

}  // namespace

TbfShape TbfShapeFor(int64_t bits_per_second) {
  TbfShape shape;
  shape.bits_per_second = bits_per_second;
  const int64_t tick_bytes =
      (bits_per_second / 8 + kTicksPerSecond - 1) / kTicksPerSecond;
  shape.burst_bytes =
      std::max(kMinBurstBytes, (tick_bytes + 1023) / 1024 * 1024);
  shape.latency_ms = kLatencyMs;
  return shape;
}

std::string TbfArgs(const TbfShape& shape) {
  return absl::StrCat("tbf rate ", shape.bits_per_second, "bit burst ",
                      shape.burst_bytes, " latency ", shape.latency_ms, "ms");
}

absl::StatusOr<NetworkTools> FindNetworkTools(absl::string_view what) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        " needs root (it makes network namespaces, veth pairs and tc "
        "qdiscs); this is uid ",
        geteuid()));
  }
  NetworkTools tools{FindTool("ip"), FindTool("tc")};
  if (tools.ip.empty() || tools.tc.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " needs ip and tc (Debian package iproute2); not found: ",
        tools.ip.empty() ? "ip " : "", tools.tc.empty() ? "tc" : ""));
  }
  return tools;
}

absl::StatusOr<std::string> RunShellCommand(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::InternalError(
        absl::StrCat("`", command, "` exited with ", status, ":\n", out));
  }
  return out;
}

}  // namespace shardps::local
