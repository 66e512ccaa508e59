// A Launcher runs a whole shardps job on this machine: a coordinator, S
// server shards and W workers (or, in static mode, the shards and workers with
// static address lists), as child processes with their logs, pids and ports
// in a RunDir, supervised until the job ends or a process fails (or, with
// restart_on_crash, restarted when one dies). Used by shardps-local, from
// one thread; one Launcher per process.
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
#include "deploy/local/emulated_hosts.h"
#include "deploy/local/launch_options.h"
#include "deploy/local/run_dir.h"

namespace shardps::local {

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
  // then every process's peak RSS, with options.emulate_hosts the bytes
  // over each host's link, and a final metrics line. Emulated hosts are
  // made before the first process starts and removed before it returns. OK when
  // every process exited 0 (servers and the coordinator after the workers) and
  // worker 0 wrote metrics (a worker_command need not write any: then the
  // line is left out); otherwise the status names the process that
  // failed (Aborted), the timeout (DeadlineExceeded), the
  // signal that stopped the launcher (Cancelled) or the missing metrics
  // (NotFound). Every child has exited when it returns.
  //
  // With options.restart_on_crash, a process that dies (non-zero exit or a
  // signal) before every worker has finished is restarted instead, at most
  // options.max_restarts times in all; one more death fails as above:
  //  - the coordinator alone, on the port it had: it holds no training
  //    state, so servers and workers rejoin it and training goes on;
  //  - after a server or a worker, the whole job: the others are stopped
  //    (SIGTERM, SIGKILL 5 s later), the coordinator too (a fresh one holds
  //    no stale members), and everything starts again with the same flags.
  //    Servers restore the newest committed checkpoint, workers resume at
  //    its step; without one the job starts over from step 0. A
  //    worker_command starts again as every rank, each with its rank.
  // Restarted processes append to their logs (after a line saying so) and
  // rewrite their pid files; the launcher leaves metrics.csv alone, so a
  // resumed epoch may have two rows (worker 0 starts the file over when it
  // resumes in epoch 1); the peak RSS is each name's largest over its lives.
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
    int64_t max_rss_kib = 0;  // the largest over its restarts
  };

  explicit Launcher(LaunchOptions options)
      : options_(std::move(options)), run_dir_(options_.run_dir) {}

  // Starts the child `name`: a new one, or again (appending to its log) the
  // one of that name that exited.
  // `env`: the child's environment; null: this process's.
  absl::Status Start(const std::string& name, Role role,
                     const std::string& binary,
                     const std::vector<std::string>& args,
                     const std::vector<std::string>* env = nullptr);
  // On `port` (0: any), and waits for it to serve.
  absl::Status StartCoordinator(int port);
  absl::Status StartServers();
  // Waits for the port files of `children_[first, first + count)`.
  absl::StatusOr<std::vector<int>> WaitForPorts(size_t first, size_t count);
  // Static mode: `servers` are the shards' addresses; else the workers ask
  // the coordinator. Runs options_.worker_command when set, without waiting
  // for anything: the command joins the job itself.
  absl::Status StartWorkers(const std::vector<std::string>& servers);
  absl::Status StartJob();
  // Starts the job and waits until every worker has exited, restarting
  // after a crash (see Run).
  absl::Status Supervise();
  // Whether a process that died now may be restarted.
  bool MayRestart() const;
  // Restarts after the deaths in crashed_; what StartJob or
  // StartCoordinator returns, or Cancelled by a signal meanwhile.
  absl::Status Restart();
  // After the workers: waits (bounded) for the servers and the coordinator
  // to exit by themselves, and warns about any that did not (Run stops them).
  absl::Status AwaitSelfExit();
  // Waits up to `timeout` for a signal, then relays worker 0's log and reaps
  // exited children. Aborted if one failed or (restart_on_crash) died,
  // Cancelled on SIGINT or SIGTERM, DeadlineExceeded past the job's timeout.
  absl::Status Poll(absl::Duration timeout);
  absl::Status Reap();
  // Whether `child`'s exit is a failure, given every exit reaped so far;
  // Aborted, with `child` added to crashed_, for a death to restart after.
  absl::Status CheckExit(const Child& child);
  // A server or the coordinator exited 0 while workers ran, and they still
  // run after kEarlyExitGrace: that is a failure.
  absl::Status CheckEarlyExit() const;
  // Logs the end of `child`'s log and returns Aborted naming it.
  absl::Status Failure(const Child& child, bool early) const;
  bool AnyDaemonRunning() const;
  // Sends `sig` to every running child, SIGKILLs those still running 5 s
  // later (or at once on a SIGINT or SIGTERM, which it returns; else 0) and
  // reaps them all.
  int StopAll(int sig);
  absl::Status CheckDaemonsStopped() const;
  void PrintPeakRss() const;
  // With options_.emulate_hosts: makes hosts_ (the processes' namespaces).
  absl::Status MakeHosts();
  void PrintLinkBytes() const;
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
  int workers_finished_ = 0;  // exited 0 since the job (re)started
  bool job_started_ = false;  // StartJob completed since the last restart
  int coordinator_port_ = 0;
  std::vector<size_t> crashed_;  // indices in children_; see Restart
  int restarts_ = 0;
  bool stopping_ = false;
  int stop_signal_ = 0;
  // With options_.emulate_hosts, during Run. Last: removed after the
  // destructor has killed the children.
  std::unique_ptr<EmulatedHosts> hosts_;
};

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_LAUNCHER_H_
