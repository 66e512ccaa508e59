// An emulated network link: its rate, parsed as tc writes it, the tc tbf
// bucket and queue that reach that rate, and the ip and tc tools (root) that
// make namespaces, veths and qdiscs. Used by shardps-local --emulate_hosts
// and shardps-bench transport --link. Pure functions, but for the two that
// look at the system.
#ifndef SHARDPS_DEPLOY_LOCAL_LINK_SHAPING_H_
#define SHARDPS_DEPLOY_LOCAL_LINK_SHAPING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardps::local {

// One direction of a link: a tc tbf of this rate, bucket and queue.
struct TbfShape {
  int64_t bits_per_second = 0;
  // The bucket: at least a kernel tick's worth of the rate, and two of the
  // 64 KiB TSO packets veth hands tbf.
  int64_t burst_bytes = 0;
  // How long a packet may queue before tbf drops it.
  int latency_ms = 0;
};
TbfShape TbfShapeFor(int64_t bits_per_second);

// "tbf rate 1000000000bit burst 524288 latency 5ms": what follows
// `tc qdisc add dev DEV root`.
std::string TbfArgs(const TbfShape& shape);

// Absolute paths of the tools that make emulated links.
struct NetworkTools {
  std::string ip;
  std::string tc;
};
// The tools, found in $PATH or the sbin directories (root's PATH may lack
// them under sudo). FailedPrecondition naming `what` (the flag that needs
// them) when this process is not root or a tool is missing.
absl::StatusOr<NetworkTools> FindNetworkTools(absl::string_view what);

// Runs `command` through the shell: its stdout, or Internal with the
// command, its exit status and its output.
absl::StatusOr<std::string> RunShellCommand(const std::string& command);
// RunShellCommand with stderr in the output too (what ip and tc say).
inline absl::StatusOr<std::string> RunNetworkCommand(
    const std::string& command) {
  return RunShellCommand(command + " 2>&1");
}

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_LINK_SHAPING_H_
