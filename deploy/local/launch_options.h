// The options of a shardps-local job and their checks: filled by
// shardps-local from its flags, read by the Launcher and by the functions
// that build the daemons' command lines. Plain data.
#ifndef SHARDPS_DEPLOY_LOCAL_LAUNCH_OPTIONS_H_
#define SHARDPS_DEPLOY_LOCAL_LAUNCH_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "deploy/local/link_shaping.h"

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
  // Non-empty: run this command (argv, argv[0] a path or a name on PATH) as
  // each worker instead of worker_binary, with the environment of
  // WorkerCommandEnv (deploy/local/worker_command.h); training_args and
  // worker_extra_args must then be empty.
  std::vector<std::string> worker_command;
  // With worker_command: put in front of the command's PYTHONPATH. Empty:
  // the build tree's shardps package (BuildTreePythonDir), if any.
  std::string python_dir;
  // "--name=value" TLS and token flags (absolute paths) passed to every
  // daemon, so the whole job runs with the same security.
  std::vector<std::string> security_args;
  // "--name=value" training flags passed to every worker.
  std::vector<std::string> training_args;
  // With worker_command: "--name=value" of the wire flags given
  // (--compression, --error_feedback, --weight_encoding, ...), passed to the
  // command as SHARDPS_NAME=value.
  std::vector<std::string> compression_args;
  // Raw arguments appended to every worker's command line, last (so they
  // win): for tests, e.g. --fault_step_delay_ms=5.
  std::vector<std::string> worker_extra_args;

  // Passed to every server when checkpoint_dir is set. Empty checkpoint_dir
  // with checkpoint_every_steps > 0: <run_dir>/checkpoints. Servers restore
  // the newest committed checkpoint there when they start.
  std::string checkpoint_dir;
  int64_t checkpoint_every_steps = 0;  // 0: write none
  int keep_checkpoints = 3;
  // Restart a process that died (Launcher::Run says how), at most
  // max_restarts times in the whole run.
  bool restart_on_crash = false;
  int max_restarts = 5;

  // Every process on an emulated host of its own (deploy/local/
  // emulated_hosts.h): its own network namespace, address and link of
  // link_bits_per_second each way; shared memory off, as between machines.
  bool emulate_hosts = false;
  int64_t link_bits_per_second = 0;  // > 0 with emulate_hosts, else 0
  // With emulate_hosts: ip and tc, found by ResolveLaunchOptions.
  NetworkTools network_tools;
};

// Checks `options` and completes them: run_dir and checkpoint_dir made
// absolute (the paths are handed to other processes), the default
// checkpoint_dir filled in, each binary found (see FindBinary), a
// worker_command's program found on PATH and python_dir filled in, and
// with emulate_hosts the network tools found. InvalidArgument for a bad
// option, NotFound for a binary or program that is missing or not
// executable, FailedPrecondition for emulate_hosts without root, ip or tc.
absl::Status ResolveLaunchOptions(LaunchOptions* options);

// Where servers started now resume: "the checkpoint of step N in DIR" (the
// newest committed one in options.checkpoint_dir), or "step 0" and why.
std::string ResumePoint(const LaunchOptions& options);

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_LAUNCH_OPTIONS_H_
