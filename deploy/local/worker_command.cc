#include "deploy/local/worker_command.h"

#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

// Set by the launcher alone: an inherited value (from a shell that ran
// another job, say) would point the command at the wrong job.
constexpr const char* kLauncherVariables[] = {
    "SHARDPS_COORDINATOR",     "SHARDPS_SERVERS",
    "SHARDPS_JOB_ID",          "SHARDPS_RANK",
    "SHARDPS_NUM_WORKERS",     "SHARDPS_RUN_DIR",
    "SHARDPS_TLS_CERT",        "SHARDPS_TLS_KEY",
    "SHARDPS_TLS_CA",          "SHARDPS_AUTH_TOKEN_FILE",
    "SHARDPS_TLS_SERVER_NAME", "SHARDPS_CHECKPOINT_DIR"};

absl::string_view VariableName(absl::string_view entry) {
  return entry.substr(0, entry.find('='));
}

// The value of `name` in `env` ("NAME=value" strings), or null.
const std::string* Find(const std::vector<std::string>& env,
                        absl::string_view name) {
  for (const std::string& entry : env) {
    if (VariableName(entry) == name && entry.size() > name.size()) {
      return &entry;
    }
  }
  return nullptr;
}

bool IsExecutableFile(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

CommandLine SplitAtCommand(int argc, char** argv) {
  CommandLine line;
  int i = 0;
  for (; i < argc; ++i) {
    if (i > 0 && absl::string_view(argv[i]) == "--") break;
    line.flags.push_back(argv[i]);
  }
  line.has_command = i < argc;
  for (++i; i < argc; ++i) line.command.emplace_back(argv[i]);
  return line;
}

absl::Status CheckNoWorkerFlags(const std::vector<std::string>& args,
                                const std::vector<std::string>& names) {
  for (const std::string& arg : args) {
    absl::string_view name = arg;
    // "--epochs 3": the value is not a flag; "--epochs" was checked.
    if (!absl::ConsumePrefix(&name, "-")) continue;
    absl::ConsumePrefix(&name, "-");
    name = name.substr(0, name.find('='));
    absl::string_view negated = name;
    const bool is_negated = absl::ConsumePrefix(&negated, "no");
    for (const std::string& banned : names) {
      if (name != banned && !(is_negated && negated == banned)) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          arg, ": --", banned,
          " is a shardps-worker flag, and with a command after -- no "
          "shardps-worker runs; give the command its own arguments instead "
          "(shardps-local ... -- /usr/bin/python3 train.py --epochs=3)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FindCommand(const std::string& name,
                                        const std::string& path) {
  if (name.empty()) {
    return absl::InvalidArgumentError(
        "no command after --: shardps-local [flags] -- CMD ARGS...");
  }
  if (absl::StrContains(name, '/')) {
    std::error_code ec;
    const fs::path absolute = fs::absolute(name, ec).lexically_normal();
    if (ec || !IsExecutableFile(absolute)) {
      return absl::NotFoundError(
          absl::StrCat("the command ", name, " is not an executable file"));
    }
    return absolute.string();
  }
  for (absl::string_view dir : absl::StrSplit(path, ':')) {
    // An empty entry is the current directory, as for a shell.
    const fs::path candidate =
        fs::path(dir.empty() ? "." : std::string(dir)) / name;
    if (IsExecutableFile(candidate)) {
      std::error_code ec;
      const fs::path absolute = fs::absolute(candidate, ec).lexically_normal();
      return ec ? candidate.string() : absolute.string();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("the command ", name, " is not on PATH (", path, ")"));
}

std::string BuildTreePythonDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path dir = (self.parent_path() / ".." / ".." / "worker" / "python")
                           .lexically_normal();
  return fs::is_directory(dir, ec) ? dir.string() : "";
}

std::vector<std::string> WorkerCommandEnv(
    const LaunchOptions& o, const RunDir& dir, int rank,
    const std::string& coordinator, const std::vector<std::string>& servers,
    const std::vector<std::string>& inherited) {
  std::vector<std::string> flag_args = o.security_args;
  flag_args.insert(flag_args.end(), o.compression_args.begin(),
                   o.compression_args.end());
  // SHARDPS_NAME of each flag passed on: an inherited one must not win.
  std::vector<std::string> flag_variables;
  for (const std::string& arg : flag_args) {
    absl::string_view flag = arg;
    absl::ConsumePrefix(&flag, "--");
    flag_variables.push_back(absl::StrCat(
        "SHARDPS_", absl::AsciiStrToUpper(flag.substr(0, flag.find('=')))));
  }
  std::vector<std::string> env;
  for (const std::string& entry : inherited) {
    const absl::string_view name = VariableName(entry);
    const bool ours =
        name == "PYTHONPATH" ||
        (o.emulate_hosts && name == "SHARDPS_SHARED_MEMORY") ||
        std::any_of(std::begin(kLauncherVariables),
                    std::end(kLauncherVariables),
                    [name](const char* v) { return name == v; }) ||
        std::find(flag_variables.begin(), flag_variables.end(), name) !=
            flag_variables.end();
    if (!ours) env.push_back(entry);
  }
  if (coordinator.empty()) {
    env.push_back(
        absl::StrCat("SHARDPS_SERVERS=", absl::StrJoin(servers, ",")));
  } else {
    env.push_back(absl::StrCat("SHARDPS_COORDINATOR=", coordinator));
  }
  env.push_back(absl::StrCat("SHARDPS_JOB_ID=", kDefaultJobId));
  env.push_back(absl::StrCat("SHARDPS_RANK=", rank));
  env.push_back(absl::StrCat("SHARDPS_NUM_WORKERS=", o.num_workers));
  env.push_back(absl::StrCat("SHARDPS_RUN_DIR=", dir.root()));
  for (const std::string& arg : flag_args) {
    absl::string_view flag = arg;
    absl::ConsumePrefix(&flag, "--");
    const size_t eq = flag.find('=');
    if (eq == absl::string_view::npos) continue;
    env.push_back(absl::StrCat("SHARDPS_",
                               absl::AsciiStrToUpper(flag.substr(0, eq)), "=",
                               flag.substr(eq + 1)));
  }
  if (!o.checkpoint_dir.empty()) {
    env.push_back(absl::StrCat("SHARDPS_CHECKPOINT_DIR=", o.checkpoint_dir));
  }
  // Emulated hosts share this machine's /proc; machines would not. Their
  // links' rate sizes automatic chunks, unless the user set one.
  if (o.emulate_hosts) {
    env.push_back("SHARDPS_SHARED_MEMORY=0");
    if (Find(inherited, "SHARDPS_LINK_RATE") == nullptr) {
      env.push_back(
          absl::StrCat("SHARDPS_LINK_RATE=", o.link_bits_per_second, "bit"));
    }
  }
  const std::string* python_path = Find(inherited, "PYTHONPATH");
  std::vector<std::string> python_dirs;
  if (!o.python_dir.empty()) python_dirs.push_back(o.python_dir);
  if (python_path != nullptr && python_path->size() > strlen("PYTHONPATH=")) {
    python_dirs.push_back(python_path->substr(strlen("PYTHONPATH=")));
  }
  if (!python_dirs.empty()) {
    env.push_back(absl::StrCat("PYTHONPATH=", absl::StrJoin(python_dirs, ":")));
  }
  if (Find(inherited, "PYTHONUNBUFFERED") == nullptr) {
    env.push_back("PYTHONUNBUFFERED=1");
  }
  // The workers share this machine's cores: as torchrun does, each one's
  // math libraries get its share (OpenBLAS and OpenMP otherwise start a
  // thread per core in every worker, which then spin against each other).
  const int share =
      std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) /
                           std::max(1, o.num_workers));
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
    if (Find(inherited, name) == nullptr) {
      env.push_back(absl::StrCat(name, "=", share));
    }
  }
  return env;
}

}  // namespace shardps::local
