#include "tests/bench/netns_link.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"

namespace shardps::bench {
namespace {

absl::StatusOr<std::string> RunLogged(const std::string& command) {
  LogInfo("link: %s", command);
  return local::RunNetworkCommand(command);
}

}  // namespace

absl::StatusOr<std::unique_ptr<NetnsLink>> NetnsLink::Create(
    int64_t bits_per_second) {
  SHARDPS_ASSIGN_OR_RETURN(local::NetworkTools tools,
                           local::FindNetworkTools("--link"));
  std::unique_ptr<NetnsLink> link(new NetnsLink());
  link->ip_ = tools.ip;
  link->tc_ = tools.tc;
  link->shape_ = local::TbfShapeFor(bits_per_second);
  const pid_t pid = getpid();
  link->server_ns_ = absl::StrCat("shardps-srv-", pid);
  link->worker_ns_ = absl::StrCat("shardps-wrk-", pid);
  // Interface names have at most 15 characters; pids at most 7 digits.
  link->server_veth_ = absl::StrCat("vs", pid);
  link->worker_veth_ = absl::StrCat("vw", pid);

  // From here on SIGINT and SIGTERM wait for WatchSignals, in this thread
  // and in every thread started later (they inherit the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, &link->old_mask_);
  link->blocked_ = true;
  link->signal_fd_ = signalfd(-1, &signals, SFD_CLOEXEC);
  link->stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (link->signal_fd_ < 0 || link->stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("signalfd: ", ErrnoText(errno)));
  }
  link->signal_thread_ =
      std::make_unique<std::thread>([l = link.get()] { l->WatchSignals(); });
  SHARDPS_RETURN_IF_ERROR(link->Setup());
  return link;
}

absl::Status NetnsLink::Setup() {
  absl::MutexLock lock(&mu_);
  SHARDPS_RETURN_IF_ERROR(
      RunLogged(absl::StrCat(ip_, " netns add ", server_ns_)).status());
  made_server_ns_ = true;
  SHARDPS_RETURN_IF_ERROR(
      RunLogged(absl::StrCat(ip_, " netns add ", worker_ns_)).status());
  made_worker_ns_ = true;
  // Made in place, so the names never exist in the caller's namespace.
  SHARDPS_RETURN_IF_ERROR(
      RunLogged(absl::StrCat(ip_, " -n ", server_ns_, " link add ",
                             server_veth_, " type veth peer name ",
                             worker_veth_, " netns ", worker_ns_))
          .status());
  const struct {
    const std::string& ns;
    const std::string& veth;
    const char* address;
  } ends[] = {{server_ns_, server_veth_, kServerHost},
              {worker_ns_, worker_veth_, kWorkerHost}};
  for (const auto& end : ends) {
    const std::string ip = absl::StrCat(ip_, " -n ", end.ns);
    for (const std::string& command :
         {absl::StrCat(ip, " addr add ", end.address, "/30 dev ", end.veth),
          absl::StrCat(ip, " link set lo up"),
          absl::StrCat(ip, " link set ", end.veth, " up"),
          absl::StrCat(tc_, " -n ", end.ns, " qdisc add dev ", end.veth,
                       " root ", local::TbfArgs(shape_))}) {
      SHARDPS_RETURN_IF_ERROR(RunLogged(command).status());
    }
  }
  return absl::OkStatus();
}

void NetnsLink::Teardown() {
  // Servers and peers left behind (this process on a signal, or a child
  // that did not stop) would keep a namespace, and so the veth, alive.
  for (const auto& [made, ns] : {std::pair(made_server_ns_, &server_ns_),
                                 std::pair(made_worker_ns_, &worker_ns_)}) {
    if (!made) continue;
    absl::StatusOr<std::string> pids =
        RunLogged(absl::StrCat(ip_, " netns pids ", *ns));
    if (!pids.ok()) continue;
    for (absl::string_view p : absl::StrSplit(*pids, '\n', absl::SkipEmpty())) {
      pid_t pid = 0;
      if (absl::SimpleAtoi(p, &pid) && pid > 1 && pid != getpid()) {
        kill(pid, SIGKILL);
      }
    }
  }
  if (made_server_ns_) {
    // Deleting one end deletes the pair, even while a process that was
    // not killed still holds the workers' namespace.
    RunLogged(absl::StrCat(ip_, " -n ", server_ns_, " link del ", server_veth_))
        .IgnoreError();
    RunLogged(absl::StrCat(ip_, " netns del ", server_ns_)).IgnoreError();
    made_server_ns_ = false;
  }
  if (made_worker_ns_) {
    RunLogged(absl::StrCat(ip_, " netns del ", worker_ns_)).IgnoreError();
    made_worker_ns_ = false;
  }
}

void NetnsLink::WatchSignals() {
  pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    signalfd_siginfo info;
    if (read(signal_fd_, &info, sizeof(info)) != sizeof(info)) continue;
    LogWarning("link: signal %d, removing %s and %s", info.ssi_signo,
               server_ns_, worker_ns_);
    absl::MutexLock lock(&mu_);
    Teardown();
    _exit(128 + static_cast<int>(info.ssi_signo));
  }
}

NetnsLink::~NetnsLink() {
  if (home_ns_fd_ >= 0) {
    // Leave the workers' namespace, so that deleting it is its end.
    setns(home_ns_fd_, CLONE_NEWNET);
    close(home_ns_fd_);
  }
  if (net_dev_fd_ >= 0) close(net_dev_fd_);
  {
    absl::MutexLock lock(&mu_);
    Teardown();
  }
  if (signal_thread_ != nullptr) {
    const uint64_t one = 1;
    ssize_t ignored = write(stop_fd_, &one, sizeof(one));
    (void)ignored;
    signal_thread_->join();
  }
  if (signal_fd_ >= 0) close(signal_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
  if (blocked_) pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

std::vector<std::string> NetnsLink::ServerArgs(
    const std::string& binary, std::vector<std::string> args) const {
  std::vector<std::string> argv = {"netns", "exec", server_ns_, binary};
  argv.insert(argv.end(), std::make_move_iterator(args.begin()),
              std::make_move_iterator(args.end()));
  return argv;
}

absl::Status NetnsLink::EnterWorkerNamespace() {
  home_ns_fd_ = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  const std::string path = "/run/netns/" + worker_ns_;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (home_ns_fd_ < 0 || fd < 0) {
    return absl::InternalError(
        absl::StrCat("open ", path, ": ", ErrnoText(errno)));
  }
  const int rc = setns(fd, CLONE_NEWNET);
  close(fd);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("setns(", path, "): ", ErrnoText(errno)));
  }
  // Opened here, the file keeps showing this namespace's devices to any
  // thread that reads it.
  net_dev_fd_ = open("/proc/thread-self/net/dev", O_RDONLY | O_CLOEXEC);
  if (net_dev_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat("open /proc/thread-self/net/dev: ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<LinkBytes> NetnsLink::Bytes() const {
  std::string text;
  char buf[4096];
  if (lseek(net_dev_fd_, 0, SEEK_SET) != 0) {
    return absl::InternalError(
        absl::StrCat("/proc/net/dev: ", ErrnoText(errno)));
  }
  for (ssize_t n; (n = read(net_dev_fd_, buf, sizeof(buf))) > 0;) {
    text.append(buf, n);
  }
  // "  vw123: rx_bytes rx_packets ... (8 receive fields) tx_bytes ..."
  const std::string name = worker_veth_ + ":";
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripLeadingAsciiWhitespace(line);
    if (!absl::StartsWith(line, name)) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line.substr(name.size()), ' ', absl::SkipWhitespace());
    LinkBytes bytes;
    if (fields.size() >= 9 && absl::SimpleAtoi(fields[0], &bytes.to_workers) &&
        absl::SimpleAtoi(fields[8], &bytes.to_servers)) {
      return bytes;
    }
  }
  return absl::InternalError(
      absl::StrCat(worker_veth_, " not in ", worker_ns_, "'s /proc/net/dev"));
}

std::string NetnsLink::QdiscStats() const {
  std::vector<std::string> lines;
  for (const auto& [ns, veth] : {std::pair(&server_ns_, &server_veth_),
                                 std::pair(&worker_ns_, &worker_veth_)}) {
    absl::StatusOr<std::string> out =
        RunLogged(absl::StrCat(tc_, " -n ", *ns, " -s qdisc show dev ", *veth));
    const std::string text = out.ok() ? *out : out.status().ToString();
    lines.push_back(absl::StrCat(
        *veth, ": ",
        absl::StrJoin(
            absl::StrSplit(text, absl::ByAnyChar(" \n"), absl::SkipEmpty()),
            " ")));
  }
  return absl::StrJoin(lines, "\n");
}

}  // namespace shardps::bench
