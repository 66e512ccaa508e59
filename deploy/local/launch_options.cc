#include "deploy/local/launch_options.h"

#include <stdlib.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_steps.h"
#include "common/status.h"
#include "deploy/local/binaries.h"
#include "deploy/local/emulated_hosts.h"
#include "deploy/local/run_dir.h"
#include "deploy/local/worker_command.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

// Upper bounds that catch a typo before it starts hundreds of processes.
constexpr int kMaxServers = 64;
constexpr int kMaxWorkers = 256;

// `*path` made absolute and normal; InvalidArgument naming `flag` if the
// current directory cannot be read.
absl::Status MakeAbsolute(const char* flag, std::string* path) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(*path, ec).lexically_normal();
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", *path, " is not a usable path: ", ec.message()));
  }
  *path = absolute.string();
  return absl::OkStatus();
}

absl::Status CheckNumbers(const LaunchOptions& o) {
  if (o.num_servers < 1 || o.num_servers > kMaxServers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--servers=", o.num_servers, " must be in [1, ", kMaxServers, "]"));
  }
  if (o.num_workers < 1 || o.num_workers > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--workers=", o.num_workers, " must be in [1, ", kMaxWorkers, "]"));
  }
  int64_t staleness = 0;
  if (o.mode != "sync" && o.mode != "async" &&
      !(absl::StartsWith(o.mode, "ssp:") &&
        absl::SimpleAtoi(o.mode.substr(4), &staleness) && staleness >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode=", o.mode, " is not one of: sync, async, ssp:K (K >= 0)"));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the timeout must be positive");
  }
  if (o.checkpoint_every_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_every_steps=", o.checkpoint_every_steps, " is negative"));
  }
  if (o.keep_checkpoints < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--keep_checkpoints=", o.keep_checkpoints, " must be at least 1"));
  }
  if (o.max_restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_restarts=", o.max_restarts, " is negative"));
  }
  return absl::OkStatus();
}

absl::Status CheckEmulatedHosts(const LaunchOptions& o) {
  if (!o.emulate_hosts) {
    if (o.link_bits_per_second != 0) {
      return absl::InvalidArgumentError(
          "--link shapes the links of --emulate_hosts; give both");
    }
    return absl::OkStatus();
  }
  if (o.link_bits_per_second <= 0) {
    return absl::InvalidArgumentError(
        "--emulate_hosts needs --link=RATE, each host's link (e.g. 1gbit or "
        "10gbit)");
  }
  // The coordinator's slot is kept in static mode too.
  if (1 + o.num_servers + o.num_workers > kMaxEmulatedHosts) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate_hosts: ", o.num_servers, " servers and ",
                     o.num_workers, " workers are more than the ",
                     kMaxEmulatedHosts - 1, " hosts its /24 leaves them"));
  }
  return absl::OkStatus();
}

// The options that configure shardps-worker have nothing to act on when a
// command runs as the workers.
absl::Status CheckWorkerCommand(const LaunchOptions& o) {
  if (!o.training_args.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training flags (", o.training_args.front(),
        ") are shardps-worker's; a command after -- trains by itself"));
  }
  if (!o.worker_extra_args.empty() || !o.worker_binary.empty()) {
    return absl::InvalidArgumentError(
        "--worker_binary and --worker_extra_args mean nothing with a command "
        "after --");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ResolveLaunchOptions(LaunchOptions* o) {
  SHARDPS_RETURN_IF_ERROR(CheckNumbers(*o));
  SHARDPS_RETURN_IF_ERROR(CheckEmulatedHosts(*o));
  if (o->run_dir.empty()) {
    return absl::InvalidArgumentError("--run_dir is empty");
  }
  if (o->use_coordinator) {
    SHARDPS_ASSIGN_OR_RETURN(
        o->coordinator_binary,
        FindBinary(o->coordinator_binary, "shardps-coordinator", "server",
                   "coordinator_binary"));
  }
  SHARDPS_ASSIGN_OR_RETURN(
      o->server_binary, FindBinary(o->server_binary, "shardps-server", "server",
                                   "server_binary"));
  if (o->worker_command.empty()) {
    SHARDPS_ASSIGN_OR_RETURN(o->worker_binary,
                             FindBinary(o->worker_binary, "shardps-worker",
                                        "worker", "worker_binary"));
  } else {
    SHARDPS_RETURN_IF_ERROR(CheckWorkerCommand(*o));
    const char* path = getenv("PATH");
    // With no PATH a shell searches its default one.
    SHARDPS_ASSIGN_OR_RETURN(
        o->worker_command[0],
        FindCommand(o->worker_command[0],
                    path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin"));
    if (o->python_dir.empty()) o->python_dir = BuildTreePythonDir();
  }
  // Absolute, so that the paths handed to the daemons and printed in
  // messages do not depend on anyone's working directory.
  SHARDPS_RETURN_IF_ERROR(MakeAbsolute("run_dir", &o->run_dir));
  if (o->checkpoint_dir.empty() && o->checkpoint_every_steps > 0) {
    o->checkpoint_dir = (fs::path(o->run_dir) / "checkpoints").string();
  }
  if (!o->checkpoint_dir.empty()) {
    SHARDPS_RETURN_IF_ERROR(MakeAbsolute("checkpoint_dir", &o->checkpoint_dir));
  }
  if (o->emulate_hosts) {
    SHARDPS_ASSIGN_OR_RETURN(o->network_tools,
                             FindNetworkTools("--emulate_hosts"));
  }
  return absl::OkStatus();
}

std::string ResumePoint(const LaunchOptions& o) {
  if (o.checkpoint_dir.empty()) {
    return "step 0 (no checkpoints: --checkpoint_every_steps=0)";
  }
  // A directory that cannot be listed holds no checkpoint the servers
  // could restore either.
  const int64_t step =
      NewestCommittedStep(o.checkpoint_dir).value_or(kNoCommittedStep);
  if (step == kNoCommittedStep) {
    return absl::StrCat("step 0 (no committed checkpoint in ", o.checkpoint_dir,
                        ")");
  }
  return absl::StrCat("the checkpoint of step ", step, " in ",
                      o.checkpoint_dir);
}

}  // namespace shardps::local
