// shardps-local: runs a whole shardps job (a coordinator, servers and
// workers; or servers and workers with static lists) on this machine.
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/status.h"
#include "deploy/local/launcher.h"
#include "worker/training_flags.h"

ABSL_FLAG(int32_t, servers, 2, "Number of server shards to start.");
ABSL_FLAG(int32_t, workers, 2, "Number of workers to start.");
ABSL_FLAG(std::string, run_dir, "run",
          "Directory for logs/, pids/, ports/, metrics.csv and "
          "model.safetensors; created if missing.");
ABSL_FLAG(std::string, mode, "sync",
          "Consistency, passed to the servers: sync or async.");
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

namespace shardps::local {
namespace {

absl::StatusOr<LaunchOptions> OptionsFromFlags(
    const std::vector<char*>& positional) {
  // --host, --port and --port_file mean nothing here; --log_format is
  // checked with them and passed on to every daemon.
  SHARDPS_RETURN_IF_ERROR(CheckDaemonFlags());
  if (positional.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument: ", positional[1]));
  }
  LaunchOptions o;
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
  o.training_args = worker::TrainingFlagArgs();
  return o;
}

int Main(const std::vector<char*>& positional) {
  InitLog("local", -1, absl::GetFlag(FLAGS_log_format) == "json");
  absl::StatusOr<LaunchOptions> options = OptionsFromFlags(positional);
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
  std::vector<char*> positional = shardps::ParseDaemonFlags(
      argc, argv,
      "runs a shardps job on this machine: a coordinator, --servers shards "
      "and --workers workers training with the flags below, each logging to "
      "<run_dir>/logs/; the job ends when every worker has finished.\n"
      "  shardps-local --servers=2 --workers=2 --epochs=1 --run_dir=run");
  return shardps::local::Main(positional);
}
