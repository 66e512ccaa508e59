// A Launcher runs a whole shardps job on this machine: a coordinator, S
// server shards and W workers (or, in static mode, the shards and workers with
// static address lists), as child processes with their logs, pids and ports
// in a RunDir, supervised until the job ends or a process fails. Used by
// shardps-local, from one thread; one Launcher per process.
#ifndef SHARDPS_DEPLOY_LOCAL_LAUNCHER_H_
#define SHARDPS_DEPLOY_LOCAL_LAUNCHER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "deploy/local/child_process.h"
#include "deploy/local/run_dir.h"

namespace shardps::local {

struct LaunchOptions {
  int num_servers = 2;
  int num_workers = 2;
  // Holds logs/, pids/, ports/, metrics.csv and model.safetensors; created
  // if missing.
  std::string run_dir = "run";
  std::string mode = "sync";  // passed to the servers: sync or async
  // Stop everything and fail after this long; InfiniteDuration: never.
  absl::Duration timeout = absl::InfiniteDuration();
  std::string log_format = "text";  // passed to every daemon
  // True: start shardps-coordinator first and give servers and workers
  // --coordinator; they exit by themselves when the job ends. False (static
  // mode): servers get --shard_index/--num_shards, workers --servers, and
  // the launcher stops the servers when the workers are done.
  bool use_coordinator = true;
  // Empty: look beside this executable (build tree, then installed).
  std::string coordinator_binary;
  std::string server_binary;
  std::string worker_binary;
  // "--name=value" training flags passed to every worker.
  std::vector<std::string> training_args;
};

class Launcher {
 public:
  // Checks the options and finds the binaries. InvalidArgument for a bad
  // option, NotFound for a binary that is missing or not executable.
  static absl::StatusOr<std::unique_ptr<Launcher>> Create(
      LaunchOptions options);
  // SIGKILLs and reaps any child still running (Run() normally stops them).
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Runs the job, once: prints worker 0's log lines to stdout as they appear,
  // then every process's peak RSS and a final metrics line. OK when every
  // process exited 0 (servers and the coordinator after the workers) and
  // worker 0 wrote metrics; otherwise the status names the process that
  // failed (Aborted), the timeout (DeadlineExceeded), the
  // signal that stopped the launcher (Cancelled) or the missing metrics
  // (NotFound). Every child has exited when it returns.
  // REQUIRES: SIGINT and SIGTERM blocked in every thread
  // (BlockTerminationSignals()), and no other thread reaps children.
  absl::Status Run();

  // The SIGINT or SIGTERM that stopped Run(), or 0.
  int stop_signal() const { return stop_signal_; }

 private:
  enum class Role { kCoordinator, kServer, kWorker };
  struct Child {
    // coordinator, server-0, worker-1: names its log, pid, port files
    std::string name;
    Role role = Role::kWorker;
    pid_t pid = -1;
    bool running = false;
    int wait_status = 0;
    int64_t max_rss_kib = 0;
  };

  explicit Launcher(LaunchOptions options)
      : options_(std::move(options)), run_dir_(options_.run_dir) {}

  absl::Status Start(Child child, const std::string& binary,
                     const std::vector<std::string>& args);
  absl::Status StartCoordinator();
  absl::Status StartServers();
  // Waits for the port files of `children_[first, first + count)`.
  absl::StatusOr<std::vector<int>> WaitForPorts(size_t first, size_t count);
  // Static mode: `servers` are the shards' addresses; else the workers ask
  // the coordinator.
  absl::Status StartWorkers(const std::vector<std::string>& servers);
  absl::Status StartJob();
  absl::Status Supervise();
  // After the workers: waits (bounded) for the servers and the coordinator
  // to exit by themselves, and warns about any that did not (Run stops them).
  absl::Status AwaitSelfExit();
  // Waits up to `timeout` for a signal, then relays worker 0's log and reaps
  // exited children. Aborted if one failed, Cancelled on SIGINT or SIGTERM,
  // DeadlineExceeded past the job's timeout.
  absl::Status Poll(absl::Duration timeout);
  absl::Status Reap();
  // Whether `child`'s exit is a failure, given every exit reaped so far.
  absl::Status CheckExit(const Child& child);
  // A server or the coordinator exited 0 while workers ran, and they still
  // run after kEarlyExitGrace: that is a failure.
  absl::Status CheckEarlyExit() const;
  // Logs the end of `child`'s log and returns Aborted naming it.
  absl::Status Failure(const Child& child, bool early) const;
  bool AnyDaemonRunning() const;
  // Sends `sig` to every running child, SIGKILLs those still running 5 s
  // later (or at once on a second SIGINT or SIGTERM) and reaps them all.
  void StopAll(int sig);
  absl::Status CheckDaemonsStopped() const;
  void PrintPeakRss() const;
  absl::Status PrintFinalMetrics() const;

  const LaunchOptions options_;
  const RunDir run_dir_;
  absl::Time start_time_;
  absl::Time deadline_ = absl::InfiniteFuture();
  // In start order: the coordinator, servers, then workers.
  std::vector<Child> children_;
  std::string coordinator_address_;  // empty in static mode
  LogFollower worker0_log_;          // relayed to stdout
  bool workers_started_ = false;
  int early_exit_ = -1;  // index in children_; see CheckEarlyExit
  absl::Time early_exit_time_;
  int workers_running_ = 0;
  bool stopping_ = false;
  int stop_signal_ = 0;
};

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_LAUNCHER_H_
