#include "deploy/local/emulated_hosts.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/status.h"

namespace shardps::local {
namespace {

constexpr char kSubnet[] = "10.213.0.";
constexpr char kPrefixLength[] = "/24";
constexpr char kNamespacePrefix[] = "shardps-";
constexpr char kBridge[] = "br0";
// The host's end of its veth: its one network card.
constexpr char kHostCard[] = "eth0";
// The queue of what a host sends, under its card's tbf: packets, as a
// Linux network card's default txqueuelen.
constexpr char kHostQueue[] = "pfifo limit 1000";

// The host slot of `name`: 0 for the coordinator, 1 + i for server-i,
// 1 + num_servers + r for worker-r; -1 for another name.
int Slot(const LaunchOptions& o, const std::string& name) {
  if (name == "coordinator") return 0;
  int index = 0;
  absl::string_view rest = name;
  if (absl::ConsumePrefix(&rest, "server-") && absl::SimpleAtoi(rest, &index)) {
    return 1 + index;
  }
  if (absl::ConsumePrefix(&rest, "worker-") && absl::SimpleAtoi(rest, &index)) {
    return 1 + o.num_servers + index;
  }
  return -1;
}

std::string SlotAddress(int slot) { return absl::StrCat(kSubnet, slot + 1); }

// Whether `pid` is a running program that makes emulated hosts:
// shardps-local, or shardps-bench (train --emulate_hosts), not a pid reused
// by another program since the one that made a namespace died.
bool IsRunningLauncher(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream comm(absl::StrCat("/proc/", pid, "/comm"));
  std::string name;
  std::getline(comm, name);
  return name == "shardps-local" || name == "shardps-bench";
}

// The pid of a namespace named shardps-<pid>-..., or 0.
pid_t NamespacePid(absl::string_view ns) {
  if (!absl::ConsumePrefix(&ns, kNamespacePrefix)) return 0;
  const size_t dash = ns.find('-');
  pid_t pid = 0;
  if (dash == absl::string_view::npos ||
      !absl::SimpleAtoi(ns.substr(0, dash), &pid)) {
    return 0;
  }
  return pid;
}

// SIGKILLs every process in namespace `ns` but this one.
void KillProcessesIn(const NetworkTools& tools, const std::string& ns) {
  absl::StatusOr<std::string> pids =
      RunNetworkCommand(absl::StrCat(tools.ip, " netns pids ", ns));
  if (!pids.ok()) return;
  for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
    pid_t pid = 0;
    if (absl::SimpleAtoi(p, &pid) && pid > 1 && pid != getpid()) {
      kill(pid, SIGKILL);
    }
  }
}

// Deletes the namespaces of launchers that died without doing it.
void RemoveLeftovers(const NetworkTools& tools) {
  absl::StatusOr<std::string> list =
      RunNetworkCommand(absl::StrCat(tools.ip, " netns list"));
  if (!list.ok()) return;
  // "shardps-123-worker-0 (id: 4)": the name is the first word.
  std::map<pid_t, std::vector<std::string>> leftovers;
  for (absl::string_view line :
       absl::StrSplit(*list, '\n', absl::SkipEmpty())) {
    const std::string ns(line.substr(0, line.find(' ')));
    const pid_t pid = NamespacePid(ns);
    if (pid > 0 && pid != getpid() && !IsRunningLauncher(pid)) {
      leftovers[pid].push_back(ns);
    }
  }
  for (const auto& [pid, namespaces] : leftovers) {
    LogWarning(
        "removing %d network namespace(s) %s%d-* left by shardps-local pid "
        "%d, which died",
        namespaces.size(), kNamespacePrefix, pid, pid);
    for (const std::string& ns : namespaces) {
      KillProcessesIn(tools, ns);
      RunNetworkCommand(absl::StrCat(tools.ip, " netns del ", ns))
          .IgnoreError();
    }
  }
}

absl::Status RunAll(const std::vector<std::string>& commands) {
  for (const std::string& command : commands) {
    SHARDPS_RETURN_IF_ERROR(RunNetworkCommand(command).status());
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  if (bytes < (1 << 10)) return absl::StrCat(bytes, " B");
  if (bytes < (1 << 20)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  if (bytes < (int64_t{1} << 30)) {
    return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  }
  return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
}

std::vector<EmulatedHost> JobHosts(const LaunchOptions& o) {
  std::vector<EmulatedHost> hosts;
  if (o.use_coordinator) hosts.push_back({"coordinator", SlotAddress(0)});
  for (int i = 0; i < o.num_servers; ++i) {
    const std::string name = absl::StrCat("server-", i);
    hosts.push_back({name, SlotAddress(Slot(o, name))});
  }
  for (int r = 0; r < o.num_workers; ++r) {
    const std::string name = absl::StrCat("worker-", r);
    hosts.push_back({name, SlotAddress(Slot(o, name))});
  }
  return hosts;
}

std::string DaemonHost(const LaunchOptions& o, const std::string& name) {
  const int slot = Slot(o, name);
  if (!o.emulate_hosts || slot < 0) return "127.0.0.1";
  return SlotAddress(slot);
}

std::string FormatLinkBytes(const std::vector<HostLinkBytes>& bytes,
                            const TbfShape& shape) {
  std::string text =
      absl::StrCat("bytes over each host's link (",
                   FormatLinkRate(shape.bits_per_second), " each way):\n");
  for (const HostLinkBytes& b : bytes) {
    absl::StrAppendFormat(&text, "  %-12s %-12s sent %10s  received %10s",
                          b.name, b.address, FormatBytes(b.sent),
                          FormatBytes(b.received));
    if (b.tcp_segments > 0 && b.tcp_retransmitted >= 0) {
      absl::StrAppendFormat(&text, "  TCP retransmitted %.2f %%",
                            100.0 * b.tcp_retransmitted / b.tcp_segments);
    }
    text += '\n';
  }
  return text;
}

bool ParseTcpSegments(absl::string_view snmp, int64_t* segments,
                      int64_t* retransmitted) {
  std::vector<absl::string_view> names;
  for (absl::string_view line : absl::StrSplit(snmp, '\n')) {
    if (!absl::ConsumePrefix(&line, "Tcp:")) continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (names.empty()) {
      names = fields;
      continue;
    }
    bool found_segments = false, found_retransmitted = false;
    for (size_t i = 0; i < names.size() && i < fields.size(); ++i) {
      if (names[i] == "OutSegs") {
        found_segments = absl::SimpleAtoi(fields[i], segments);
      } else if (names[i] == "RetransSegs") {
        found_retransmitted = absl::SimpleAtoi(fields[i], retransmitted);
      }
    }
    return found_segments && found_retransmitted;
  }
  return false;
}

namespace {

// Runs `body` on a thread that entered the network namespace `ns_fd`
// (named `ns`): setns(2) changes only the calling thread, and
// /proc/sys/net and /proc/thread-self/net show the namespace of the thread
// that opens them (and keep showing it through the descriptor).
absl::Status InNamespace(int ns_fd, const std::string& ns,
                         const std::function<absl::Status()>& body) {
  absl::Status status;
  std::thread enter([&] {
    if (setns(ns_fd, CLONE_NEWNET) != 0) {
      status = absl::InternalError(
          absl::StrCat("entering ", ns, ": ", ErrnoText(errno)));
      return;
    }
    status = body();
  });
  enter.join();
  return status;
}

// InNamespace for the namespace named `ns` (/run/netns/ns).
absl::Status InNamedNamespace(const std::string& ns,
                              const std::function<absl::Status()>& body) {
  const std::string path = "/run/netns/" + ns;
  const int ns_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (ns_fd < 0) {
    return absl::InternalError(
        absl::StrCat("open ", path, ": ", ErrnoText(errno)));
  }
  const absl::Status status = InNamespace(ns_fd, ns, body);
  close(ns_fd);
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EmulatedHosts>> EmulatedHosts::Create(
    std::vector<EmulatedHost> hosts, const TbfShape& shape,
    const NetworkTools& tools) {
  RemoveLeftovers(tools);
  std::unique_ptr<EmulatedHosts> made(new EmulatedHosts());
  made->tools_ = tools;
  made->shape_ = shape;
  made->prefix_ = absl::StrCat(kNamespacePrefix, getpid(), "-");
  made->switch_ns_ = made->prefix_ + "switch";
  made->hosts_ = std::move(hosts);
  // On an error the destructor removes what was made.
  SHARDPS_RETURN_IF_ERROR(made->MakeSwitch());
  for (const EmulatedHost& host : made->hosts_) {
    SHARDPS_RETURN_IF_ERROR(made->MakeHost(host));
  }
  SHARDPS_RETURN_IF_ERROR(made->OpenSwitchCounters());
  return made;
}

absl::Status EmulatedHosts::MakeSwitch() {
  SHARDPS_RETURN_IF_ERROR(
      RunNetworkCommand(absl::StrCat(tools_.ip, " netns add ", switch_ns_))
          .status());
  made_switch_ = true;
  SHARDPS_RETURN_IF_ERROR(SwitchWithoutNetfilter(switch_ns_));
  const std::string ip = absl::StrCat(tools_.ip, " -n ", switch_ns_);
  return RunAll({absl::StrCat(ip, " link add ", kBridge, " type bridge"),
                 absl::StrCat(ip, " link set ", kBridge, " up")});
}

// A switch forwards frames; it does not run the hosts' firewall on them.
// With br_netfilter loaded (Docker loads it), a new namespace's bridges
// pass every frame through iptables, ip6tables and arptables, on the CPU
// the emulated hosts share: the 4 x 4 main job with bf16 at 1 Gbit/s took
// 8.2-8.3 s with them off against 8.4-8.7 s on (3 alternated pairs, AMD
// EPYC, 2 cores). Off in the switch's namespace only; without br_netfilter
// there is nothing to turn off.
absl::Status EmulatedHosts::SwitchWithoutNetfilter(const std::string& ns) {
  return InNamedNamespace(ns, [&] {
    absl::Status status;
    for (const char* table : {"iptables", "ip6tables", "arptables"}) {
      const std::string file =
          absl::StrCat("/proc/sys/net/bridge/bridge-nf-call-", table);
      const int fd = open(file.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0 && errno == ENOENT) continue;
      if (fd < 0 || write(fd, "0", 1) != 1) {
        status = absl::InternalError(absl::StrCat("turning off ", file, " in ",
                                                  ns, ": ", ErrnoText(errno)));
      }
      if (fd >= 0) close(fd);
    }
    return status;
  });
}

// TCP congestion control on an emulated host: CUBIC, Linux's default, not
// whatever this machine chose (a new namespace inherits it). With BBR, 4
// workers x 4 servers at 100 Mbit/s took 598 ms an exchange where CUBIC
// takes 246 ms (the link-bound ideal: 171 ms): several flows converging on
// a shaped port lose 1-2 % of their segments and BBR keeps its rate.
// A namespace other than the machine's may choose only what
// net.ipv4.tcp_allowed_congestion_control lists (EPERM otherwise); Reno is
// always allowed and loss-based as CUBIC (the same 4 x 4 at 100 Mbit/s on
// kernel 6.18: 267 ms an exchange with Reno, 249 ms with CUBIC).
absl::Status EmulatedHosts::SetUpHostStack(int ns_fd, const std::string& ns,
                                           std::string* congestion_control,
                                           int* snmp_fd) {
  return InNamespace(ns_fd, ns, [&] {
    absl::Status status;
    const char* path = "/proc/sys/net/ipv4/tcp_congestion_control";
    const int fd = open(path, O_WRONLY | O_CLOEXEC);
    int error = fd < 0 ? errno : EPERM;
    for (const char* algorithm : {"cubic", "reno"}) {
      if (fd < 0 || error != EPERM) break;
      if (write(fd, algorithm, strlen(algorithm)) >= 0) {
        *congestion_control = algorithm;
        error = 0;
      } else {
        error = errno;
      }
    }
    if (error != 0) {
      status =
          absl::InternalError(absl::StrCat("setting cubic (or reno) in ", path,
                                           " of ", ns, ": ", ErrnoText(error)));
    }
    if (fd >= 0) close(fd);
    // As the switch's /proc/net/dev: it keeps showing this namespace.
    *snmp_fd = open("/proc/thread-self/net/snmp", O_RDONLY | O_CLOEXEC);
    if (*snmp_fd < 0 && status.ok()) {
      status = absl::InternalError(absl::StrCat(
          "open /proc/thread-self/net/snmp in ", ns, ": ", ErrnoText(errno)));
    }
    return status;
  });
}

absl::Status EmulatedHosts::MakeHost(const EmulatedHost& host) {
  const std::string ns = prefix_ + host.name;
  SHARDPS_RETURN_IF_ERROR(
      RunNetworkCommand(absl::StrCat(tools_.ip, " netns add ", ns)).status());
  host_namespaces_.push_back(ns);
  const std::string path = "/run/netns/" + ns;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("open ", path, ": ", ErrnoText(errno)));
  }
  host_fds_.push_back(fd);
  int snmp_fd = -1;
  const absl::Status stack =
      SetUpHostStack(fd, ns, &congestion_control_, &snmp_fd);
  if (snmp_fd >= 0) host_snmp_fds_.push_back(snmp_fd);
  SHARDPS_RETURN_IF_ERROR(stack);
  const std::string sw = absl::StrCat(tools_.ip, " -n ", switch_ns_);
  const std::string on_host = absl::StrCat(tools_.ip, " -n ", ns);
  const std::string tbf = absl::StrCat(" root ", TbfArgs(shape_));
  const std::string host_tc = absl::StrCat(tools_.tc, " -n ", ns);
  // The port is named as the host (at most 15 characters: "worker-255").
  return RunAll({
      absl::StrCat(sw, " link add ", host.name, " type veth peer name ",
                   kHostCard, " netns ", ns),
      absl::StrCat(sw, " link set ", host.name, " master ", kBridge),
      absl::StrCat(sw, " link set ", host.name, " up"),
      // The switch port's egress is what the host receives.
      absl::StrCat(tools_.tc, " -n ", switch_ns_, " qdisc add dev ", host.name,
                   tbf),
      absl::StrCat(on_host, " addr add ", host.address, kPrefixLength, " dev ",
                   kHostCard),
      absl::StrCat(on_host, " link set lo up"),
      absl::StrCat(on_host, " link set ", kHostCard, " up"),
      // eth0's egress is what the host sends. A card queues what its own
      // host sends (txqueuelen 1000) rather than dropping it: a 5 ms tbf
      // queue alone dropped first transmissions where a sender's flows
      // converged on its own card, and TCP then waited ~200 ms for its probe
      // timer. The switch port keeps the shallow queue, where a real
      // switch drops when several senders converge on one receiver.
      absl::StrCat(host_tc, " qdisc add dev ", kHostCard,
                   " root handle 1: ", TbfArgs(shape_)),
      absl::StrCat(host_tc, " qdisc add dev ", kHostCard, " parent 1:1 ",
                   kHostQueue),
  });
}

absl::Status EmulatedHosts::OpenSwitchCounters() {
  return InNamedNamespace(switch_ns_, [&] {
    switch_net_dev_fd_ =
        open("/proc/thread-self/net/dev", O_RDONLY | O_CLOEXEC);
    if (switch_net_dev_fd_ >= 0) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("open /proc/thread-self/net/dev in ", switch_ns_, ": ",
                     ErrnoText(errno)));
  });
}

int EmulatedHosts::NamespaceFd(const std::string& name) const {
  for (size_t i = 0; i < host_fds_.size(); ++i) {
    if (hosts_[i].name == name) return host_fds_[i];
  }
  return -1;
}

absl::StatusOr<std::vector<HostLinkBytes>> EmulatedHosts::Bytes() const {
  std::string text;
  char buf[4096];
  if (lseek(switch_net_dev_fd_, 0, SEEK_SET) != 0) {
    return absl::InternalError(
        absl::StrCat(switch_ns_, "'s /proc/net/dev: ", ErrnoText(errno)));
  }
  for (ssize_t n; (n = read(switch_net_dev_fd_, buf, sizeof(buf))) > 0;) {
    text.append(buf, static_cast<size_t>(n));
  }
  std::vector<HostLinkBytes> bytes;
  for (const EmulatedHost& host : hosts_) {
    bytes.push_back({host.name, host.address, -1, -1});
  }
  // "  worker-0: rx_bytes rx_packets ... (8 receive fields) tx_bytes ...":
  // the port receives what the host sends.
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripLeadingAsciiWhitespace(line);
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    auto it =
        std::find_if(bytes.begin(), bytes.end(), [&](const HostLinkBytes& b) {
          return b.name == line.substr(0, colon);
        });
    if (it == bytes.end()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line.substr(colon + 1), ' ', absl::SkipWhitespace());
    if (fields.size() < 9 || !absl::SimpleAtoi(fields[0], &it->sent) ||
        !absl::SimpleAtoi(fields[8], &it->received)) {
      return absl::InternalError(absl::StrCat("cannot read the counters of ",
                                              it->name, " in ", switch_ns_,
                                              ": ", line));
    }
  }
  for (const HostLinkBytes& b : bytes) {
    if (b.sent < 0) {
      return absl::InternalError(
          absl::StrCat("no switch port ", b.name, " in ", switch_ns_));
    }
  }
  // Each host's TCP counters: a host whose file cannot be read keeps -1s.
  for (size_t i = 0; i < host_snmp_fds_.size() && i < bytes.size(); ++i) {
    std::string snmp;
    if (lseek(host_snmp_fds_[i], 0, SEEK_SET) != 0) continue;
    for (ssize_t n; (n = read(host_snmp_fds_[i], buf, sizeof(buf))) > 0;) {
      snmp.append(buf, static_cast<size_t>(n));
    }
    int64_t segments = 0, retransmitted = 0;
    if (ParseTcpSegments(snmp, &segments, &retransmitted)) {
      bytes[i].tcp_segments = segments;
      bytes[i].tcp_retransmitted = retransmitted;
    }
  }
  return bytes;
}

void EmulatedHosts::Teardown() {
  // A process left in a host's namespace (a torch worker's data loader)
  // would keep it alive after its name is deleted.
  for (const std::string& ns : host_namespaces_) KillProcessesIn(tools_, ns);
  // Deleting the switch deletes every port, and with each its host's eth0.
  if (made_switch_) {
    RunNetworkCommand(absl::StrCat(tools_.ip, " netns del ", switch_ns_))
        .IgnoreError();
    made_switch_ = false;
  }
  for (const std::string& ns : host_namespaces_) {
    RunNetworkCommand(absl::StrCat(tools_.ip, " netns del ", ns)).IgnoreError();
  }
  host_namespaces_.clear();
}

EmulatedHosts::~EmulatedHosts() {
  if (switch_net_dev_fd_ >= 0) close(switch_net_dev_fd_);
  for (int fd : host_fds_) close(fd);
  for (int fd : host_snmp_fds_) close(fd);
  Teardown();
}

}  // namespace shardps::local
