// A worker command: what `shardps-local [flags] -- CMD ARGS...` runs as each
// worker instead of shardps-worker (a torch script, say), and the
// environment it runs in, which tells it where the job is and which rank it
// is, as torchrun does. Pure functions, but for the one that reads
// /proc/self/exe.
#ifndef SHARDPS_DEPLOY_LOCAL_WORKER_COMMAND_H_
#define SHARDPS_DEPLOY_LOCAL_WORKER_COMMAND_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "deploy/local/launch_options.h"
#include "deploy/local/run_dir.h"

namespace shardps::local {

// shardps-local starts the coordinator and the servers without --job_id,
// so the job is their default one.
inline constexpr char kDefaultJobId[] = "shardps";

// argv split at the first "--" after argv[0]: `flags` is argv[0] and the
// arguments before it (for the flag parser), `command` those after it.
// `has_command`: there was a "--" (the command may still be empty).
struct CommandLine {
  std::vector<char*> flags;
  std::vector<std::string> command;
  bool has_command = false;
};
CommandLine SplitAtCommand(int argc, char** argv);

// InvalidArgument naming the first of `args` (flag arguments as typed:
// --name=value, --name value, -name, --noname for a bool) that sets a flag
// in `names`, for flags that mean nothing when a command runs as the
// workers; OK if none does.
absl::Status CheckNoWorkerFlags(const std::vector<std::string>& args,
                                const std::vector<std::string>& names);

// `name` itself if it holds a '/' (made absolute), else the first
// executable `name` in the ':'-separated `path` (as a shell finds it).
// InvalidArgument for an empty name; NotFound naming `name` and `path`.
absl::StatusOr<std::string> FindCommand(const std::string& name,
                                        const std::string& path);

// <dir of this executable>/../../worker/python (the shardps Python package
// of the build tree this shardps-local belongs to) if that is a directory;
// else empty.
std::string BuildTreePythonDir();

// The environment of worker `rank`'s command, as "NAME=value" strings:
// `inherited` (this process's, same form) without the variables below,
// then SHARDPS_COORDINATOR=`coordinator` (with a coordinator) or
// SHARDPS_SERVERS=`servers` joined by ',' (static mode), SHARDPS_JOB_ID,
// SHARDPS_RANK, SHARDPS_NUM_WORKERS, SHARDPS_RUN_DIR (dir's root), one
// SHARDPS_<FLAG> for each of options.security_args (--tls_cert=/a becomes
// SHARDPS_TLS_CERT=/a), SHARDPS_CHECKPOINT_DIR when checkpoints are on,
// SHARDPS_SHARED_MEMORY=0 (replacing an inherited one) with emulate_hosts,
// PYTHONPATH with options.python_dir in front (when set), and
// PYTHONUNBUFFERED=1 unless inherited, so that rank 0's prints are relayed
// as they happen, and OMP_NUM_THREADS and OPENBLAS_NUM_THREADS (unless
// inherited) of the workers' share of the cores.
std::vector<std::string> WorkerCommandEnv(
    const LaunchOptions& options, const RunDir& dir, int rank,
    const std::string& coordinator, const std::vector<std::string>& servers,
    const std::vector<std::string>& inherited);

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_WORKER_COMMAND_H_
