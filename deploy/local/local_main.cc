// shardps-local: runs a whole shardps job (a coordinator, servers and
// workers; or servers and workers with static lists) on this machine.
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/daemon_flags.h"
#include "common/link_rate.h"
#include "common/log.h"
#include "common/security_flags.h"
#include "common/status.h"
#include "deploy/local/launcher.h"
#include "deploy/local/link_shaping.h"
#include "deploy/local/worker_command.h"
#include "worker/training_flags.h"

ABSL_FLAG(int32_t, servers, 2, "Number of server shards to start.");
ABSL_FLAG(int32_t, workers, 2, "Number of workers to start.");
ABSL_FLAG(std::string, run_dir, "run",
          "Directory for logs/, pids/, ports/, metrics.csv and "
          "model.safetensors; created if missing.");
ABSL_FLAG(std::string, mode, "sync",
          "Consistency, passed to the servers: sync, async or ssp:K.");
ABSL_FLAG(int32_t, timeout_s, 0,
          "Stop every process and fail after this many seconds (0: never).");
ABSL_FLAG(bool, static, false,
          "Static mode: no coordinator; servers get their shape on the "
          "command line and workers the servers' addresses.");
ABSL_FLAG(std::string, coordinator_binary, "",
          "shardps-coordinator to run; default: the one in this build tree, "
          "or beside this binary.");
ABSL_FLAG(std::string, server_binary, "",
          "shardps-server to run; default: the one in this build tree, or "
          "beside this binary.");
ABSL_FLAG(std::string, worker_binary, "",
          "shardps-worker to run; default: the one in this build tree, or "
          "beside this binary.");

ABSL_FLAG(std::string, checkpoint_dir, "",
          "Checkpoint directory, passed to every server; default with "
          "--checkpoint_every_steps: <run_dir>/checkpoints. Servers restore "
          "the newest committed checkpoint there when they start, so reusing "
          "a run directory resumes its job; use a fresh one to start over.");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "Servers write a checkpoint every N steps (0: never).");
ABSL_FLAG(int32_t, keep_checkpoints, 3,
          "Committed checkpoints each server keeps.");
// The policy is Launcher::Run's; this text states it for --help.
ABSL_FLAG(bool, restart_on_crash, false,
          "Restart a process that dies (non-zero exit or signal) before the "
          "workers have finished, as a supervisor would. The coordinator "
          "holds no training state: it alone is restarted, on its port, and "
          "members rejoin it. After a server or a worker, the whole job is "
          "stopped (SIGTERM, then SIGKILL after 5 s) and started again: "
          "servers restore the newest committed checkpoint and workers "
          "resume at its step (without checkpoints: from step 0). Restarted "
          "processes append to their logs; metrics.csv is left as it is.");
ABSL_FLAG(int32_t, max_restarts, 5,
          "With --restart_on_crash: restarts allowed in the whole run; the "
          "next death fails the run.");
ABSL_FLAG(bool, emulate_hosts, false,
          "Root, needs ip and tc (iproute2): run every process (coordinator, "
          "servers, workers or the command after --) on an emulated host of "
          "its own: a network namespace with one link, of --link each way, "
          "to a software switch (a Linux bridge), as if each were a machine "
          "with its own network card. Addresses 10.213.0.0/24; shared "
          "memory off. Prints the bytes that crossed each host's link at "
          "the end; the namespaces (shardps-<pid>-*) are removed at exit, "
          "and those of a launcher that died on the next start. tbf shapes "
          "rate only: there is no added latency.");
ABSL_FLAG(std::string, link, "",
          "With --emulate_hosts: each host's link rate, each way, as tc "
          "writes it: 100mbit, 1gbit, 10gbit, 2.5gbit.");
ABSL_FLAG(std::string, worker_extra_args, "",
          "Testing only: space-separated arguments appended to every "
          "worker's command line, e.g. --fault_step_delay_ms=5.");

namespace shardps::local {
namespace {

// The flags that configure shardps-worker: the training flags, which
// TrainingFlagArgs lists as --name=value, and the launcher's own.
std::vector<std::string> WorkerFlagNames() {
  std::vector<std::string> names = {"worker_binary", "worker_extra_args"};
  for (const std::string& arg : worker::TrainingFlagArgs()) {
    names.push_back(arg.substr(2, arg.find('=') - 2));
  }
  return names;
}

absl::StatusOr<LaunchOptions> OptionsFromFlags(
    const std::vector<char*>& positional, const CommandLine& line) {
  // --host, --port and --port_file mean nothing here; --log_format is
  // checked with them and passed on to every daemon.
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  if (positional.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument: ", positional[1],
                     " (a command to run as the workers follows --)"));
  }
  LaunchOptions o;
  if (line.has_command) {
    if (line.command.empty()) {
      return absl::InvalidArgumentError(
          "no command after --: shardps-local [flags] -- CMD ARGS...");
    }
    SHARDPS_RETURN_IF_ERROR(CheckNoWorkerFlags(
        std::vector<std::string>(line.flags.begin() + 1, line.flags.end()),
        WorkerFlagNames()));
    o.worker_command = line.command;
  }
  o.num_servers = absl::GetFlag(FLAGS_servers);
  o.num_workers = absl::GetFlag(FLAGS_workers);
  o.run_dir = absl::GetFlag(FLAGS_run_dir);
  o.mode = absl::GetFlag(FLAGS_mode);
  const int32_t timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (timeout_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout_s=", timeout_s, " is negative"));
  }
  if (timeout_s > 0) o.timeout = absl::Seconds(timeout_s);
  o.log_format = absl::GetFlag(FLAGS_log_format);
  o.use_coordinator = !absl::GetFlag(FLAGS_static);
  o.coordinator_binary = absl::GetFlag(FLAGS_coordinator_binary);
  o.server_binary = absl::GetFlag(FLAGS_server_binary);
  o.worker_binary = absl::GetFlag(FLAGS_worker_binary);
  // The coordinator and the servers serve with these: check them here, so a
  // bad flag fails before any process starts.
  SHARDPS_RETURN_IF_ERROR(ServerSecurityOptionsFromFlags().status());
  o.security_args = SecurityFlagArgs();
  // Checked here too: a bad value fails before any process starts.
  SHARDPS_RETURN_IF_ERROR(worker::CompressionFromFlags().status());
  SHARDPS_RETURN_IF_ERROR(worker::TrainingFlagValuesFromFlags().status());
  if (!o.worker_command.empty()) {
    // A command after -- reads the ones changed from SHARDPS_COMPRESSION
    // and the like.
    for (const char* name :
         {"compression", "error_feedback", "topk_warmup_steps",
          "compression_min_elements", "weight_encoding"}) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag != nullptr && flag->CurrentValue() != flag->DefaultValue()) {
        o.compression_args.push_back(
            absl::StrCat("--", name, "=", flag->CurrentValue()));
      }
    }
  }
  if (o.worker_command.empty()) {
    o.training_args = worker::TrainingFlagArgs();
    o.worker_extra_args = absl::StrSplit(absl::GetFlag(FLAGS_worker_extra_args),
                                         ' ', absl::SkipWhitespace());
  }
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  o.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  o.restart_on_crash = absl::GetFlag(FLAGS_restart_on_crash);
  o.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  o.emulate_hosts = absl::GetFlag(FLAGS_emulate_hosts);
  if (const std::string link = absl::GetFlag(FLAGS_link); !link.empty()) {
    SHARDPS_ASSIGN_OR_RETURN(o.link_bits_per_second, ParseLinkRate(link));
  }
  return o;
}

int Main(const std::vector<char*>& positional, const CommandLine& line) {
  InitLog("local", -1, absl::GetFlag(FLAGS_log_format) == "json");
  absl::StatusOr<LaunchOptions> options = OptionsFromFlags(positional, line);
  if (!options.ok()) return ExitCode(options.status());
  absl::StatusOr<std::unique_ptr<Launcher>> launcher =
      Launcher::Create(*std::move(options));
  if (!launcher.ok()) return ExitCode(launcher.status());
  const int code = ExitCode((*launcher)->Run());
  // The shell's convention for a process stopped by a signal.
  const int sig = (*launcher)->stop_signal();
  return sig != 0 ? 128 + sig : code;
}

}  // namespace
}  // namespace shardps::local

int main(int argc, char** argv) {
  shardps::BlockTerminationSignals();
  // What follows "--" is the workers' command, never flags.
  const shardps::local::CommandLine line =
      shardps::local::SplitAtCommand(argc, argv);
  std::vector<char*> flags = line.flags;
  const int flag_count = static_cast<int>(flags.size());
  flags.push_back(nullptr);  // argv[argc], as main's
  std::vector<char*> positional = shardps::ParseDaemonFlags(
      flag_count, flags.data(),
      "runs a shardps job on this machine: a coordinator, --servers shards "
      "and --workers workers training with the flags below, each logging to "
      "<run_dir>/logs/; the job ends when every worker has finished.\n"
      "  shardps-local --servers=2 --workers=2 --epochs=1 --run_dir=run\n"
      "  shardps-local --checkpoint_every_steps=100 --restart_on_crash\n"
      "  shardps-local --emulate_hosts --link=1gbit   (root: a machine per "
      "process, 1 Gbit/s each)\n"
      "With a command after --, that command runs as each worker instead of "
      "shardps-worker (the training flags are then refused), in the "
      "environment SHARDPS_COORDINATOR=127.0.0.1:PORT (static mode: "
      "SHARDPS_SERVERS=a,b,...), SHARDPS_JOB_ID, SHARDPS_RANK, "
      "SHARDPS_NUM_WORKERS, SHARDPS_RUN_DIR, SHARDPS_TLS_CERT, "
      "SHARDPS_TLS_KEY, SHARDPS_TLS_CA, SHARDPS_AUTH_TOKEN_FILE (as the "
      "--tls_* flags say), SHARDPS_CHECKPOINT_DIR (with checkpoints), "
      "SHARDPS_SHARED_MEMORY=0 and SHARDPS_LINK_RATE=<--link>bit (with "
      "--emulate_hosts, which also gives the hosts' addresses instead of "
      "127.0.0.1) and PYTHONPATH starting with "
      "this build tree's worker/python:\n"
      "  shardps-local --servers=2 --workers=2 -- /usr/bin/python3 "
      "worker/python/examples/cnn_fashion_mnist.py");
  return shardps::local::Main(positional, line);
}
