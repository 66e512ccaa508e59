#include "deploy/local/launcher.h"

#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/status.h"
#include "deploy/local/binaries.h"
#include "deploy/local/daemon_args.h"
#include "deploy/local/worker_command.h"

namespace shardps::local {
namespace {

// Daemons bind and write their port file within a second or two; 30 s
// allows for a loaded machine.
constexpr absl::Duration kPortTimeout = absl::Seconds(30);
// Once the workers finished, servers and the coordinator learn it from the
// coordinator and exit within a second or so; past this they are stopped.
constexpr absl::Duration kSelfExitTimeout = absl::Seconds(30);
// A server or the coordinator that exits 0 while workers still run has
// failed unless the workers finish within this (they were about to).
constexpr absl::Duration kEarlyExitGrace = absl::Seconds(10);
// How long a process gets between SIGTERM and SIGKILL.
constexpr absl::Duration kStopGrace = absl::Seconds(5);
// How often worker 0's log is relayed when nothing else happens.
constexpr absl::Duration kRelayInterval = absl::Milliseconds(100);
constexpr int kTailLines = 20;

}  // namespace

absl::StatusOr<std::unique_ptr<Launcher>> Launcher::Create(
    LaunchOptions options) {
  SHARDPS_RETURN_IF_ERROR(ResolveLaunchOptions(&options));
  return std::unique_ptr<Launcher>(new Launcher(std::move(options)));
}

Launcher::~Launcher() {
  for (Child& child : children_) {
    if (!child.running) continue;
    kill(child.pid, SIGKILL);
    waitpid(child.pid, nullptr, 0);
  }
}

absl::Status Launcher::Start(const std::string& name, Role role,
                             const std::string& binary,
                             const std::vector<std::string>& args,
                             const std::vector<std::string>* env) {
  auto it = std::find_if(children_.begin(), children_.end(),
                         [&name](const Child& c) { return c.name == name; });
  const bool again = it != children_.end();
  if (!again) it = children_.insert(children_.end(), Child{name, role});
  Child& child = *it;
  const std::string log = run_dir_.LogPath(name);
  if (again) {
    // Appending keeps the earlier life's output (and worker 0's relay).
    std::ofstream(log, std::ios::app)
        << "---- shardps-local: restart " << restarts_ << ": starting " << name
        << " again ----\n";
  }
  run_dir_.RemovePort(name);
  const int netns_fd = hosts_ != nullptr ? hosts_->NamespaceFd(name) : -1;
  SHARDPS_ASSIGN_OR_RETURN(
      child.pid,
      SpawnWithLog(binary, args, log, /*append=*/again, env, netns_fd));
  child.running = true;
  child.wait_status = 0;
  if (role == Role::kWorker) ++workers_running_;
  LogInfo("started %s (pid %d): %s %s", name, child.pid, binary,
          absl::StrJoin(args, " "));
  return run_dir_.WritePid(name, child.pid);
}

absl::Status Launcher::StartCoordinator(int port) {
  SHARDPS_RETURN_IF_ERROR(Start("coordinator", Role::kCoordinator,
                                options_.coordinator_binary,
                                CoordinatorArgs(options_, run_dir_, port)));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<int> ports, WaitForPorts(0, 1));
  coordinator_port_ = ports[0];
  coordinator_address_ =
      absl::StrCat(DaemonHost(options_, "coordinator"), ":", coordinator_port_);
  return absl::OkStatus();
}

absl::Status Launcher::StartServers() {
  for (int i = 0; i < options_.num_servers; ++i) {
    SHARDPS_RETURN_IF_ERROR(
        Start(absl::StrCat("server-", i), Role::kServer, options_.server_binary,
              ServerArgs(options_, run_dir_, i, coordinator_address_)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> Launcher::WaitForPorts(size_t first,
                                                        size_t count) {
  const absl::Time deadline = absl::Now() + kPortTimeout;
  std::vector<int> ports(count, 0);
  while (true) {
    int missing = -1;
    for (size_t i = 0; i < count; ++i) {
      if (ports[i] != 0) continue;
      const Child& child = children_[first + i];
      ports[i] = run_dir_.ReadPort(child.name);
      if (ports[i] == 0) {
        if (missing < 0) missing = static_cast<int>(first + i);
        continue;
      }
      LogInfo("%s (pid %d) serving on %s:%d", child.name, child.pid,
              DaemonHost(options_, child.name), ports[i]);
    }
    if (missing < 0) return ports;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(children_[missing].name, " reported no port within ",
                       absl::FormatDuration(kPortTimeout), "; see ",
                       run_dir_.LogPath(children_[missing].name)));
    }
    SHARDPS_RETURN_IF_ERROR(Poll(absl::Milliseconds(10)));
  }
}

absl::Status Launcher::StartWorkers(const std::vector<std::string>& servers) {
  const std::vector<std::string>& command = options_.worker_command;
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) inherited.emplace_back(*e);
  for (int rank = 0; rank < options_.num_workers; ++rank) {
    const std::string name = absl::StrCat("worker-", rank);
    if (command.empty()) {
      SHARDPS_RETURN_IF_ERROR(Start(
          name, Role::kWorker, options_.worker_binary,
          WorkerArgs(options_, run_dir_, rank, coordinator_address_, servers)));
    } else {
      const std::vector<std::string> env = WorkerCommandEnv(
          options_, run_dir_, rank, coordinator_address_, servers, inherited);
      SHARDPS_RETURN_IF_ERROR(Start(
          name, Role::kWorker, command[0],
          std::vector<std::string>(command.begin() + 1, command.end()), &env));
    }
    // A restarted worker 0 appends to the log already followed.
    if (rank == 0 && !worker0_log_.is_open()) {
      SHARDPS_RETURN_IF_ERROR(
          worker0_log_.Open(run_dir_.LogPath(name), STDOUT_FILENO));
    }
  }
  workers_started_ = true;
  return absl::OkStatus();
}

absl::Status Launcher::StartJob() {
  job_started_ = false;
  if (options_.use_coordinator) {
    // A fresh port: every member starts again with its address.
    SHARDPS_RETURN_IF_ERROR(StartCoordinator(0));
    // Workers need not wait for the servers: they wait for the coordinator's
    // view to be complete.
    SHARDPS_RETURN_IF_ERROR(StartServers());
    SHARDPS_RETURN_IF_ERROR(StartWorkers({}));
  } else {
    SHARDPS_RETURN_IF_ERROR(StartServers());
    SHARDPS_ASSIGN_OR_RETURN(std::vector<int> ports,
                             WaitForPorts(0, options_.num_servers));
    std::vector<std::string> servers;
    for (int i = 0; i < options_.num_servers; ++i) {
      servers.push_back(absl::StrCat(
          DaemonHost(options_, absl::StrCat("server-", i)), ":", ports[i]));
    }
    SHARDPS_RETURN_IF_ERROR(StartWorkers(servers));
  }
  job_started_ = true;
  return absl::OkStatus();
}

absl::Status Launcher::Supervise() {
  absl::Status status = StartJob();
  while (true) {
    while (status.ok() && workers_running_ > 0) status = Poll(kRelayInterval);
    if (status.ok() || crashed_.empty()) return status;
    status = Restart();
  }
}

bool Launcher::MayRestart() const {
  // Once every worker has finished, the model is written: nothing is left
  // to redo, and a death then is a failure.
  return options_.restart_on_crash && restarts_ < options_.max_restarts &&
         workers_finished_ < options_.num_workers;
}

absl::Status Launcher::Restart() {
  ++restarts_;
  std::vector<std::string> died;
  // Before the job is up, members may not know the coordinator's port yet.
  bool whole_job = !job_started_;
  for (size_t i : crashed_) {
    const Child& child = children_[i];
    died.push_back(
        absl::StrCat(child.name, " (", DescribeExit(child.wait_status), ")"));
    whole_job = whole_job || child.role != Role::kCoordinator;
  }
  crashed_.clear();
  const std::string count = absl::StrCat("restart ", restarts_, " of at most ",
                                         options_.max_restarts);
  if (!whole_job) {
    LogWarning(
        "%s died: restarting it on port %d, where servers and workers rejoin; "
        "training goes on (%s)",
        absl::StrJoin(died, ", "), coordinator_port_, count);
    return StartCoordinator(coordinator_port_);
  }
  const int sig = StopAll(SIGTERM);
  if (sig != 0) {
    stop_signal_ = sig;
    return absl::CancelledError(absl::StrCat("stopped by ", SignalName(sig)));
  }
  stopping_ = false;
  early_exit_ = -1;
  workers_finished_ = 0;
  // Read once every server has stopped: none commits a checkpoint now.
  LogWarning("%s died: stopped the job; restarting it from %s (%s)",
             absl::StrJoin(died, ", "), ResumePoint(options_), count);
  return StartJob();
}

absl::Status Launcher::Poll(absl::Duration timeout) {
  const int sig = WaitForSignal(timeout);
  worker0_log_.Relay();
  if (sig == SIGINT || sig == SIGTERM) {
    stop_signal_ = sig;
    LogWarning("received %s: stopping every process", SignalName(sig));
    return absl::CancelledError(absl::StrCat("stopped by ", SignalName(sig)));
  }
  SHARDPS_RETURN_IF_ERROR(Reap());
  SHARDPS_RETURN_IF_ERROR(CheckEarlyExit());
  if (absl::Now() > deadline_) {
    LogError("timed out after %s: stopping every process",
             absl::FormatDuration(options_.timeout));
    return absl::DeadlineExceededError(
        absl::StrCat("timed out after ", absl::FormatDuration(options_.timeout),
                     " (--timeout_s)"));
  }
  return absl::OkStatus();
}

absl::Status Launcher::Reap() {
  // Take every exit first, then judge them: a server that exits right after
  // the last worker is fine even when it is reaped first.
  std::vector<const Child*> exited;
  int wait_status = 0;
  rusage usage{};
  pid_t pid;
  while ((pid = wait4(-1, &wait_status, WNOHANG, &usage)) > 0) {
    auto it = std::find_if(children_.begin(), children_.end(),
                           [pid](const Child& c) { return c.pid == pid; });
    if (it == children_.end()) continue;
    it->running = false;
    it->wait_status = wait_status;
    // KiB on Linux
    it->max_rss_kib = std::max<int64_t>(it->max_rss_kib, usage.ru_maxrss);
    if (it->role == Role::kWorker) {
      --workers_running_;
      if (ExitedCleanly(wait_status)) ++workers_finished_;
    }
    exited.push_back(&*it);
  }
  // A failure that no restart cures wins over deaths that one would.
  absl::Status failure;
  for (const Child* child : exited) {
    const size_t crashes = crashed_.size();
    absl::Status s = CheckExit(*child);
    if (failure.ok() && crashed_.size() == crashes) failure = std::move(s);
  }
  if (!failure.ok()) crashed_.clear();
  if (!failure.ok() || crashed_.empty()) return failure;
  return absl::AbortedError(
      absl::StrCat(children_[crashed_.front()].name, " died"));
}

absl::Status Launcher::CheckExit(const Child& child) {
  const std::string how = DescribeExit(child.wait_status);
  const bool clean = ExitedCleanly(child.wait_status);
  // Workers end the job. Servers and the coordinator run until the launcher
  // stops them, or (coordinator mode) exit by themselves after the workers.
  const bool workers_done = workers_started_ && workers_running_ == 0;
  if (stopping_ || (clean && (child.role == Role::kWorker || workers_done))) {
    LogInfo("%s (pid %d) exited (%s)", child.name, child.pid, how);
    return absl::OkStatus();
  }
  if (clean && options_.use_coordinator) {
    // The last worker tells the coordinator it finished just before its
    // process exits, so servers may exit first. CheckEarlyExit judges this
    // once the workers had time to follow.
    LogInfo("%s (pid %d) exited (%s) while workers still run", child.name,
            child.pid, how);
    if (early_exit_ < 0) {
      early_exit_ = static_cast<int>(&child - children_.data());
      early_exit_time_ = absl::Now();
    }
    return absl::OkStatus();
  }
  if (!clean && MayRestart()) {
    crashed_.push_back(static_cast<size_t>(&child - children_.data()));
    return absl::AbortedError(absl::StrCat(child.name, " died"));
  }
  if (!clean && options_.restart_on_crash &&
      restarts_ >= options_.max_restarts) {
    LogError("%s died after %d restart(s) (--max_restarts=%d): giving up",
             child.name, restarts_, options_.max_restarts);
  }
  return Failure(child, clean);
}

absl::Status Launcher::CheckEarlyExit() const {
  if (early_exit_ < 0 || workers_running_ == 0 ||
      absl::Now() < early_exit_time_ + kEarlyExitGrace) {
    return absl::OkStatus();
  }
  return Failure(children_[early_exit_], /*early=*/true);
}

absl::Status Launcher::Failure(const Child& child, bool early) const {
  const std::string how = DescribeExit(child.wait_status);
  const std::string log = run_dir_.LogPath(child.name);
  const char* before = early ? " before the workers finished" : "";
  LogError("%s failed (%s)%s; last lines of %s:", child.name, how, before, log);
  for (const std::string& line : LastLines(log, kTailLines)) {
    WriteAll(STDERR_FILENO, absl::StrCat("  ", line, "\n"));
  }
  return absl::AbortedError(
      absl::StrCat(child.name, " failed (", how, ")", before, "; see ", log));
}

bool Launcher::AnyDaemonRunning() const {
  return std::any_of(children_.begin(), children_.end(), [](const Child& c) {
    return c.running && c.role != Role::kWorker;
  });
}

absl::Status Launcher::AwaitSelfExit() {
  const absl::Time deadline = absl::Now() + kSelfExitTimeout;
  while (AnyDaemonRunning() && absl::Now() < deadline) {
    SHARDPS_RETURN_IF_ERROR(Poll(kRelayInterval));
  }
  // They learn the end from the workers' finish calls, which a command
  // that never joined the job does not make.
  const char* hint = options_.worker_command.empty()
                         ? ""
                         : " (did every command join the job and finish?)";
  for (const Child& child : children_) {
    if (!child.running) continue;
    LogWarning("%s (pid %d) still running %s after the workers finished%s",
               child.name, child.pid, absl::FormatDuration(kSelfExitTimeout),
               hint);
  }
  return absl::OkStatus();
}

int Launcher::StopAll(int sig) {
  stopping_ = true;
  int running = 0;
  for (const Child& child : children_) {
    if (!child.running) continue;
    kill(child.pid, sig);
    ++running;
  }
  if (running == 0) return 0;
  LogInfo("sent %s to %d process(es)", SignalName(sig), running);
  const absl::Time deadline = absl::Now() + kStopGrace;
  const auto any_running = [this] {
    return std::any_of(children_.begin(), children_.end(),
                       [](const Child& c) { return c.running; });
  };
  int got = 0;
  while (any_running() && absl::Now() < deadline) {
    got = WaitForSignal(kRelayInterval);
    worker0_log_.Relay();
    Reap().IgnoreError();  // stopping_: exits are expected, not failures
    if (got == SIGINT || got == SIGTERM) {
      LogWarning("received %s%s: killing every process", SignalName(got),
                 stop_signal_ != 0 ? " again" : "");
      break;
    }
    got = 0;
  }
  for (Child& child : children_) {
    if (!child.running) continue;
    LogWarning("%s (pid %d) is still running: SIGKILL", child.name, child.pid);
    kill(child.pid, SIGKILL);
    int wait_status = 0;
    rusage usage{};
    if (wait4(child.pid, &wait_status, 0, &usage) == child.pid) {
      child.running = false;
      child.wait_status = wait_status;
      child.max_rss_kib = std::max<int64_t>(child.max_rss_kib, usage.ru_maxrss);
      if (child.role == Role::kWorker) --workers_running_;
    }
  }
  return got;
}

absl::Status Launcher::CheckDaemonsStopped() const {
  for (const Child& child : children_) {
    if (child.role != Role::kWorker && !ExitedCleanly(child.wait_status)) {
      return absl::AbortedError(
          absl::StrCat(child.name, " did not stop cleanly (",
                       DescribeExit(child.wait_status), "); see ",
                       run_dir_.LogPath(child.name)));
    }
  }
  return absl::OkStatus();
}

void Launcher::PrintLinkBytes() const {
  if (hosts_ == nullptr) return;
  absl::StatusOr<std::vector<HostLinkBytes>> bytes = hosts_->Bytes();
  if (!bytes.ok()) {
    LogWarning("cannot read the bytes over the hosts' links: %s",
               bytes.status().ToString());
    return;
  }
  WriteAll(STDOUT_FILENO, FormatLinkBytes(*bytes, hosts_->shape()));
}

absl::Status Launcher::MakeHosts() {
  const TbfShape shape = TbfShapeFor(options_.link_bits_per_second);
  SHARDPS_ASSIGN_OR_RETURN(
      hosts_,
      EmulatedHosts::Create(JobHosts(options_), shape, options_.network_tools));
  LogInfo(
      "emulated hosts: each process in a network namespace %s<name> with "
      "its address in 10.213.0.0/24 and a link of %s each way to a bridge "
      "in %sswitch (tc tbf: burst %d bytes; a card queues 1000 packets, a "
      "switch port %d ms); TCP congestion "
      "control %s; shared memory off",
      hosts_->prefix(), FormatLinkRate(shape.bits_per_second), hosts_->prefix(),
      shape.burst_bytes, shape.latency_ms, hosts_->congestion_control());
  if (hosts_->congestion_control() != "cubic") {
    LogWarning(
        "emulated hosts: TCP congestion control %s, not cubic: this machine "
        "lets network namespaces choose only what "
        "net.ipv4.tcp_allowed_congestion_control lists; for cubic: sysctl -w "
        "net.ipv4.tcp_allowed_congestion_control=\"$(sysctl -n "
        "net.ipv4.tcp_allowed_congestion_control) cubic\"",
        hosts_->congestion_control());
  }
  return absl::OkStatus();
}

void Launcher::PrintPeakRss() const {
  std::vector<std::string> parts;
  for (const Child& child : children_) {
    parts.push_back(
        absl::StrFormat("%s %.1f MiB", child.name, child.max_rss_kib / 1024.0));
  }
  if (parts.empty()) return;
  WriteAll(STDOUT_FILENO,
           absl::StrCat("peak RSS: ", absl::StrJoin(parts, ", "), "\n"));
}

absl::Status Launcher::PrintFinalMetrics() const {
  SHARDPS_ASSIGN_OR_RETURN(
      std::string line,
      FinalMetricsLine(run_dir_.MetricsPath(), absl::Now() - start_time_));
  WriteAll(STDOUT_FILENO, line);
  return absl::OkStatus();
}

absl::Status Launcher::Run() {
  start_time_ = absl::Now();
  if (options_.timeout != absl::InfiniteDuration()) {
    deadline_ = start_time_ + options_.timeout;
  }
  // Child exits are taken with sigtimedwait, like SIGINT and SIGTERM: a
  // blocked SIGCHLD stays pending until then.
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &chld, nullptr);
  SHARDPS_RETURN_IF_ERROR(run_dir_.Prepare());
  if (options_.emulate_hosts) SHARDPS_RETURN_IF_ERROR(MakeHosts());
  LogInfo("run directory %s: %s%d server(s), %d worker(s), mode %s",
          options_.run_dir,
          options_.use_coordinator ? "a coordinator, " : "static lists, ",
          options_.num_servers, options_.num_workers, options_.mode);
  if (!options_.worker_command.empty()) {
    LogInfo("workers run: %s%s", absl::StrJoin(options_.worker_command, " "),
            options_.python_dir.empty()
                ? " (no shardps package in this build tree)"
                : absl::StrCat(" (PYTHONPATH starts with ", options_.python_dir,
                               ")"));
  }
  if (!options_.checkpoint_dir.empty()) {
    LogInfo("checkpoints every %d steps in %s, keeping %d; starting from %s",
            options_.checkpoint_every_steps, options_.checkpoint_dir,
            options_.keep_checkpoints, ResumePoint(options_));
  } else if (options_.restart_on_crash) {
    LogWarning(
        "no checkpoints (--checkpoint_every_steps=0): a job restarted after a "
        "server or a worker died starts over from step 0");
  }

  absl::Status status = Supervise();
  if (status.ok() && options_.use_coordinator) {
    LogInfo(
        "all %d worker(s) finished: waiting for the servers and the "
        "coordinator to exit",
        options_.num_workers);
    status = AwaitSelfExit();
  } else if (status.ok()) {
    LogInfo("all %d worker(s) finished: stopping the servers",
            options_.num_workers);
  }
  if (status.ok()) {
    StopAll(SIGTERM);
    status = CheckDaemonsStopped();
  } else {
    StopAll(stop_signal_ != 0 ? stop_signal_ : SIGTERM);
  }
  worker0_log_.Finish();
  PrintPeakRss();
  PrintLinkBytes();
  hosts_.reset();
  // Prepare() removed any older metrics.csv: one there now is this run's.
  const bool want_metrics = options_.worker_command.empty() ||
                            access(run_dir_.MetricsPath().c_str(), F_OK) == 0;
  if (status.ok() && want_metrics) status = PrintFinalMetrics();
  return status;
}

}  // namespace shardps::local
