#include "deploy/local/launcher.h"

#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "deploy/local/binaries.h"
#include "deploy/local/daemon_args.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

// Upper bounds that catch a typo before it starts hundreds of processes.
constexpr int kMaxServers = 64;
constexpr int kMaxWorkers = 256;
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
  if (options.num_servers < 1 || options.num_servers > kMaxServers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--servers=", options.num_servers, " must be in [1, ",
                     kMaxServers, "]"));
  }
  if (options.num_workers < 1 || options.num_workers > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers=", options.num_workers, " must be in [1, ",
                     kMaxWorkers, "]"));
  }
  if (options.mode != "sync" && options.mode != "async") {
    return absl::InvalidArgumentError(
        absl::StrCat("--mode=", options.mode, " is not one of: sync, async"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the timeout must be positive");
  }
  if (options.run_dir.empty()) {
    return absl::InvalidArgumentError("--run_dir is empty");
  }
  if (options.use_coordinator) {
    SHARDPS_ASSIGN_OR_RETURN(
        options.coordinator_binary,
        FindBinary(options.coordinator_binary, "shardps-coordinator", "server",
                   "coordinator_binary"));
  }
  SHARDPS_ASSIGN_OR_RETURN(options.server_binary,
                           FindBinary(options.server_binary, "shardps-server",
                                      "server", "server_binary"));
  SHARDPS_ASSIGN_OR_RETURN(options.worker_binary,
                           FindBinary(options.worker_binary, "shardps-worker",
                                      "worker", "worker_binary"));
  // Absolute, so that the paths handed to the daemons and printed in
  // messages do not depend on anyone's working directory.
  std::error_code ec;
  options.run_dir = fs::absolute(options.run_dir, ec).lexically_normal();
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--run_dir=", options.run_dir,
                     " is not a usable path: ", ec.message()));
  }
  return std::unique_ptr<Launcher>(new Launcher(std::move(options)));
}

Launcher::~Launcher() {
  for (Child& child : children_) {
    if (!child.running) continue;
    kill(child.pid, SIGKILL);
    waitpid(child.pid, nullptr, 0);
  }
}

absl::Status Launcher::Start(Child child, const std::string& binary,
                             const std::vector<std::string>& args) {
  SHARDPS_ASSIGN_OR_RETURN(
      child.pid, SpawnWithLog(binary, args, run_dir_.LogPath(child.name)));
  child.running = true;
  if (child.role == Role::kWorker) ++workers_running_;
  children_.push_back(child);
  LogInfo("started %s (pid %d): %s %s", child.name, child.pid, binary,
          absl::StrJoin(args, " "));
  return run_dir_.WritePid(child.name, child.pid);
}

absl::Status Launcher::StartCoordinator() {
  Child coordinator;
  coordinator.name = "coordinator";
  coordinator.role = Role::kCoordinator;
  SHARDPS_RETURN_IF_ERROR(Start(coordinator, options_.coordinator_binary,
                                CoordinatorArgs(options_, run_dir_)));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<int> port, WaitForPorts(0, 1));
  coordinator_address_ = absl::StrCat("127.0.0.1:", port[0]);
  return absl::OkStatus();
}

absl::Status Launcher::StartServers() {
  for (int i = 0; i < options_.num_servers; ++i) {
    Child server;
    server.name = absl::StrCat("server-", i);
    server.role = Role::kServer;
    SHARDPS_RETURN_IF_ERROR(
        Start(server, options_.server_binary,
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
      LogInfo("%s (pid %d) serving on 127.0.0.1:%d", child.name, child.pid,
              ports[i]);
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
  for (int rank = 0; rank < options_.num_workers; ++rank) {
    Child worker;
    worker.name = absl::StrCat("worker-", rank);
    SHARDPS_RETURN_IF_ERROR(Start(
        worker, options_.worker_binary,
        WorkerArgs(options_, run_dir_, rank, coordinator_address_, servers)));
    if (rank == 0) {
      SHARDPS_RETURN_IF_ERROR(
          worker0_log_.Open(run_dir_.LogPath(worker.name), STDOUT_FILENO));
    }
  }
  workers_started_ = true;
  return absl::OkStatus();
}

absl::Status Launcher::StartJob() {
  if (options_.use_coordinator) {
    SHARDPS_RETURN_IF_ERROR(StartCoordinator());
    // Workers need not wait for the servers: they wait for the coordinator's
    // view to be complete.
    SHARDPS_RETURN_IF_ERROR(StartServers());
    return StartWorkers({});
  }
  SHARDPS_RETURN_IF_ERROR(StartServers());
  SHARDPS_ASSIGN_OR_RETURN(std::vector<int> ports,
                           WaitForPorts(0, options_.num_servers));
  std::vector<std::string> servers;
  for (int port : ports) servers.push_back(absl::StrCat("127.0.0.1:", port));
  return StartWorkers(servers);
}

absl::Status Launcher::Supervise() {
  while (workers_running_ > 0) SHARDPS_RETURN_IF_ERROR(Poll(kRelayInterval));
  return absl::OkStatus();
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
    it->max_rss_kib = usage.ru_maxrss;  // KiB on Linux
    if (it->role == Role::kWorker) --workers_running_;
    exited.push_back(&*it);
  }
  absl::Status first_failure;
  for (const Child* child : exited) {
    absl::Status s = CheckExit(*child);
    if (first_failure.ok()) first_failure = std::move(s);
  }
  return first_failure;
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
  for (const Child& child : children_) {
    if (!child.running) continue;
    LogWarning("%s (pid %d) still running %s after the workers finished",
               child.name, child.pid, absl::FormatDuration(kSelfExitTimeout));
  }
  return absl::OkStatus();
}

void Launcher::StopAll(int sig) {
  stopping_ = true;
  int running = 0;
  for (const Child& child : children_) {
    if (!child.running) continue;
    kill(child.pid, sig);
    ++running;
  }
  if (running == 0) return;
  LogInfo("sent %s to %d process(es)", SignalName(sig), running);
  const absl::Time deadline = absl::Now() + kStopGrace;
  const auto any_running = [this] {
    return std::any_of(children_.begin(), children_.end(),
                       [](const Child& c) { return c.running; });
  };
  while (any_running() && absl::Now() < deadline) {
    const int got = WaitForSignal(kRelayInterval);
    worker0_log_.Relay();
    Reap().IgnoreError();  // stopping_: exits are expected, not failures
    if (got == SIGINT || got == SIGTERM) {
      LogWarning("received %s again: killing every process", SignalName(got));
      break;
    }
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
      child.max_rss_kib = usage.ru_maxrss;
      if (child.role == Role::kWorker) --workers_running_;
    }
  }
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
  LogInfo("run directory %s: %s%d server(s), %d worker(s), mode %s",
          options_.run_dir,
          options_.use_coordinator ? "a coordinator, " : "static lists, ",
          options_.num_servers, options_.num_workers, options_.mode);

  absl::Status status = StartJob();
  if (status.ok()) status = Supervise();
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
  if (status.ok()) status = PrintFinalMetrics();
  return status;
}

}  // namespace shardps::local
