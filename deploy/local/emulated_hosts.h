// Emulated hosts for shardps-local --emulate_hosts: each process of a job in
// a network namespace of its own, whose one network card (eth0) is a veth to
// a port of a Linux bridge in a switch namespace, shaped by a tc tbf both
// ways, so every host has a full-duplex link of one rate. Used by the
// Launcher and shardps-bench train --emulate_hosts, from one thread.
#ifndef SHARDPS_DEPLOY_LOCAL_EMULATED_HOSTS_H_
#define SHARDPS_DEPLOY_LOCAL_EMULATED_HOSTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "deploy/local/launch_options.h"
#include "deploy/local/link_shaping.h"

namespace shardps::local {

// The most hosts one job can have: addresses 10.213.0.1 to .253.
inline constexpr int kMaxEmulatedHosts = 253;

// One emulated host: the name of the process that runs there (a Launcher
// child: coordinator, server-0, worker-1) and its address.
struct EmulatedHost {
  std::string name;
  std::string address;
};

// The job's hosts with their addresses in 10.213.0.0/24: the coordinator
// .1 (when options.use_coordinator), server i .(2 + i), worker r
// .(2 + num_servers + r). REQUIRES: 1 + num_servers + num_workers <=
// kMaxEmulatedHosts (ResolveLaunchOptions checks it).
std::vector<EmulatedHost> JobHosts(const LaunchOptions& options);

// The address daemon `name` binds and is reached at: its host's above with
// options.emulate_hosts, else 127.0.0.1.
std::string DaemonHost(const LaunchOptions& options, const std::string& name);

// What crossed one host's link, counted at its switch port.
struct HostLinkBytes {
  std::string name;
  std::string address;
  int64_t sent = 0;      // from the host into the switch
  int64_t received = 0;  // from the switch to the host
  // TCP segments the host's own stack sent, and how many of them were
  // retransmissions (lost where flows converge on a port); -1: unknown.
  int64_t tcp_segments = -1;
  int64_t tcp_retransmitted = -1;
};

// "512 B", "3.2 KiB", "12.3 MiB", "1.16 GiB".
std::string FormatBytes(int64_t bytes);

// One line per host: "  worker-0     10.213.0.4   sent  12.3 MiB
// received  45.6 MiB  TCP retransmitted 0.42 %" (the last part when its
// TCP counters are known), after a heading naming the rate.
std::string FormatLinkBytes(const std::vector<HostLinkBytes>& bytes,
                            const TbfShape& shape);

// TCP's OutSegs and RetransSegs from the text of a /proc/net/snmp (a
// "Tcp:" line of names, then one of values); false when they are not there.
bool ParseTcpSegments(absl::string_view snmp, int64_t* segments,
                      int64_t* retransmitted);

// The namespaces shardps-<pid>-switch (bridge br0, one port per host, named
// as the host) and shardps-<pid>-<host name> (lo, and eth0 with the host's
// address/24), where <pid> is this process's. Nothing is made in the
// caller's namespace; deleting the namespaces deletes every link.
class EmulatedHosts {
 public:
  // First removes what launchers that died left behind (namespaces
  // shardps-<pid>-* of a pid that is no running shardps-local or
  // shardps-bench), then makes
  // the switch and `hosts`, with a tbf of `shape` on each eth0 (what the
  // host sends) and each switch port (what it receives).
  //   Internal: a command failed; the message has its output. Whatever
  //   was made before it is removed again.
  static absl::StatusOr<std::unique_ptr<EmulatedHosts>> Create(
      std::vector<EmulatedHost> hosts, const TbfShape& shape,
      const NetworkTools& tools);
  // Kills what still runs in the namespaces and deletes them.
  ~EmulatedHosts();
  EmulatedHosts(const EmulatedHosts&) = delete;
  EmulatedHosts& operator=(const EmulatedHosts&) = delete;

  // The namespace of host `name` (for setns(2); owned, close-on-exec), or
  // -1 when there is no such host.
  int NamespaceFd(const std::string& name) const;
  // "shardps-<pid>-": what every namespace of these hosts starts with.
  const std::string& prefix() const { return prefix_; }
  const TbfShape& shape() const { return shape_; }
  // TCP's congestion control on every host: "cubic", or "reno" where
  // net.ipv4.tcp_allowed_congestion_control does not list cubic.
  const std::string& congestion_control() const { return congestion_control_; }

  // Bytes each host's link has carried so far, and its TCP segments, in
  // the order of `hosts`. Internal when the switch's counters cannot be
  // read.
  absl::StatusOr<std::vector<HostLinkBytes>> Bytes() const;

 private:
  EmulatedHosts() = default;
  absl::Status MakeSwitch();
  static absl::Status SwitchWithoutNetfilter(const std::string& ns);
  absl::Status MakeHost(const EmulatedHost& host);
  // Sets TCP's congestion control in the namespace `ns_fd` (named `ns`)
  // to CUBIC, or to Reno where this machine does not allow namespaces
  // CUBIC, into *congestion_control, and opens its /proc/net/snmp into
  // *snmp_fd (from a thread that enters it).
  static absl::Status SetUpHostStack(int ns_fd, const std::string& ns,
                                     std::string* congestion_control,
                                     int* snmp_fd);
  // Opens the switch namespace's /proc/net/dev (from a thread that enters
  // it, as setns(2) changes only the calling thread).
  absl::Status OpenSwitchCounters();
  void Teardown();

  NetworkTools tools_;
  TbfShape shape_;
  std::string congestion_control_;
  std::string prefix_;
  std::string switch_ns_;
  bool made_switch_ = false;
  std::vector<EmulatedHost> hosts_;
  // Made so far, in the order of hosts_, and their namespaces' fds.
  std::vector<std::string> host_namespaces_;
  std::vector<int> host_fds_;
  std::vector<int> host_snmp_fds_;  // each host's /proc/net/snmp
  int switch_net_dev_fd_ = -1;
};

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_EMULATED_HOSTS_H_
