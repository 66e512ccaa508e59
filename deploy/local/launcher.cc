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

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

// Upper bounds that catch a typo before it starts hundreds of processes.
constexpr int kMaxServers = 64;
constexpr int kMaxWorkers = 256;
// Servers bind and write their port file within a second or two; 30 s
// allows for a loaded machine.
constexpr absl::Duration kPortTimeout = absl::Seconds(30);
// How long a process gets between SIGTERM and SIGKILL.
constexpr absl::Duration kStopGrace = absl::Seconds(5);
// How often worker 0's log is relayed when nothing else happens.
constexpr absl::Duration kRelayInterval = absl::Milliseconds(100);
constexpr int kTailLines = 20;

std::string SignalName(int sig) {
  const char* name = sigabbrev_np(sig);
  return name != nullptr ? absl::StrCat("SIG", name) : absl::StrCat(sig);
}

// Waits up to `timeout` for SIGINT, SIGTERM or SIGCHLD (all blocked, so they
// wait as pending) and returns it; 0 if none came.
int WaitForSignal(absl::Duration timeout) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGCHLD);
  const timespec wait = absl::ToTimespec(timeout);
  const int sig = sigtimedwait(&signals, nullptr, &wait);
  return sig > 0 ? sig : 0;
}

bool IsExecutable(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) && access(path.c_str(), X_OK) == 0;
}

// `given` if set; else <dir of this executable>/../../`subdir`/`name` (the
// build tree) or <dir of this executable>/`name` (installed side by side).
absl::StatusOr<std::string> FindBinary(const std::string& given,
                                       const std::string& name,
                                       const std::string& subdir,
                                       const std::string& flag) {
  std::vector<fs::path> candidates;
  if (!given.empty()) {
    candidates.push_back(given);
  } else {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) {
      return absl::NotFoundError(absl::StrCat(
          "cannot locate this executable (", ec.message(), "); pass --", flag));
    }
    const fs::path dir = self.parent_path();
    candidates.push_back(
        (dir / ".." / ".." / subdir / name).lexically_normal());
    candidates.push_back(dir / name);
  }
  for (const fs::path& path : candidates) {
    if (IsExecutable(path)) return path.string();
  }
  std::vector<std::string> tried;
  for (const fs::path& path : candidates) tried.push_back(path.string());
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " at ",
                                          absl::StrJoin(tried, " or "),
                                          "; build it or pass --", flag));
}

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
  if (!child.is_server) ++workers_running_;
  children_.push_back(child);
  LogInfo("started %s (pid %d): %s %s", child.name, child.pid, binary,
          absl::StrJoin(args, " "));
  return run_dir_.WritePid(child.name, child.pid);
}

absl::Status Launcher::StartServers() {
  for (int i = 0; i < options_.num_servers; ++i) {
    Child server;
    server.name = absl::StrCat("server-", i);
    server.is_server = true;
    SHARDPS_RETURN_IF_ERROR(
        Start(server, options_.server_binary,
              {absl::StrCat("--shard_index=", i),
               absl::StrCat("--num_shards=", options_.num_servers),
               absl::StrCat("--num_workers=", options_.num_workers),
               absl::StrCat("--mode=", options_.mode), "--port=0",
               absl::StrCat("--port_file=", run_dir_.PortPath(server.name)),
               absl::StrCat("--log_format=", options_.log_format)}));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> Launcher::WaitForPorts() {
  const absl::Time deadline = absl::Now() + kPortTimeout;
  std::vector<int> ports(options_.num_servers, 0);
  while (true) {
    int missing = -1;
    for (int i = 0; i < options_.num_servers; ++i) {
      if (ports[i] != 0) continue;
      ports[i] = run_dir_.ReadPort(children_[i].name);
      if (ports[i] == 0) {
        if (missing < 0) missing = i;
        continue;
      }
      LogInfo("server-%d (pid %d) serving on 127.0.0.1:%d", i, children_[i].pid,
              ports[i]);
    }
    if (missing < 0) return ports;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("server-", missing, " reported no port within ",
                       absl::FormatDuration(kPortTimeout), "; see ",
                       run_dir_.LogPath(children_[missing].name)));
    }
    SHARDPS_RETURN_IF_ERROR(Poll(absl::Milliseconds(10)));
  }
}

absl::Status Launcher::StartWorkers(const std::vector<int>& ports) {
  std::vector<std::string> addresses;
  for (int port : ports) addresses.push_back(absl::StrCat("127.0.0.1:", port));
  for (int rank = 0; rank < options_.num_workers; ++rank) {
    Child worker;
    worker.name = absl::StrCat("worker-", rank);
    std::vector<std::string> args = {
        absl::StrCat("--servers=", absl::StrJoin(addresses, ",")),
        absl::StrCat("--rank=", rank),
        absl::StrCat("--num_workers=", options_.num_workers)};
    args.insert(args.end(), options_.training_args.begin(),
                options_.training_args.end());
    if (rank == 0) {
      args.push_back(absl::StrCat("--metrics_csv=", run_dir_.MetricsPath()));
      args.push_back(absl::StrCat("--model_out=", run_dir_.ModelPath()));
    }
    args.push_back(absl::StrCat("--log_format=", options_.log_format));
    SHARDPS_RETURN_IF_ERROR(Start(worker, options_.worker_binary, args));
    if (rank == 0) {
      SHARDPS_RETURN_IF_ERROR(
          worker0_log_.Open(run_dir_.LogPath(worker.name), STDOUT_FILENO));
    }
  }
  return absl::OkStatus();
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
  absl::Status first_failure;
  int wait_status = 0;
  rusage usage{};
  pid_t pid;
  while ((pid = wait4(-1, &wait_status, WNOHANG, &usage)) > 0) {
    auto it = std::find_if(children_.begin(), children_.end(),
                           [pid](const Child& c) { return c.pid == pid; });
    if (it == children_.end()) continue;
    Child& child = *it;
    child.running = false;
    child.wait_status = wait_status;
    child.max_rss_kib = usage.ru_maxrss;  // KiB on Linux
    if (!child.is_server) --workers_running_;
    const std::string how = DescribeExit(wait_status);
    // Until the launcher stops them, servers run for as long as workers do.
    if (stopping_ || (!child.is_server && ExitedCleanly(wait_status))) {
      LogInfo("%s (pid %d) exited (%s)", child.name, child.pid, how);
      continue;
    }
    const std::string log = run_dir_.LogPath(child.name);
    const char* early = child.is_server && ExitedCleanly(wait_status)
                            ? " before the workers finished"
                            : "";
    LogError("%s failed (%s)%s; last lines of %s:", child.name, how, early,
             log);
    for (const std::string& line : LastLines(log, kTailLines)) {
      WriteAll(STDERR_FILENO, absl::StrCat("  ", line, "\n"));
    }
    if (first_failure.ok()) {
      first_failure = absl::AbortedError(absl::StrCat(
          child.name, " failed (", how, ")", early, "; see ", log));
    }
  }
  return first_failure;
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
      if (!child.is_server) --workers_running_;
    }
  }
}

absl::Status Launcher::CheckServersStopped() const {
  for (const Child& child : children_) {
    if (child.is_server && !ExitedCleanly(child.wait_status)) {
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
  LogInfo("run directory %s: %d server(s), %d worker(s), mode %s",
          options_.run_dir, options_.num_servers, options_.num_workers,
          options_.mode);

  absl::Status status = StartServers();
  absl::StatusOr<std::vector<int>> ports;
  if (status.ok()) {
    ports = WaitForPorts();
    status = ports.status();
  }
  if (status.ok()) status = StartWorkers(*ports);
  if (status.ok()) status = Supervise();
  if (status.ok()) {
    LogInfo("all %d worker(s) finished: stopping the servers",
            options_.num_workers);
    StopAll(SIGTERM);
    status = CheckServersStopped();
  } else {
    StopAll(stop_signal_ != 0 ? stop_signal_ : SIGTERM);
  }
  worker0_log_.Finish();
  PrintPeakRss();
  if (status.ok()) status = PrintFinalMetrics();
  return status;
}

}  // namespace shardps::local
