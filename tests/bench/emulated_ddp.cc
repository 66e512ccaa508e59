// The pieces the emulated-host benchmarks share; see emulated_ddp.h.
#include "tests/bench/emulated_ddp.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "deploy/local/child_process.h"
#include "deploy/local/emulated_hosts.h"
#include "tests/bench/run_command.h"
#include "tests/testing/daemon.h"

namespace shardps::bench {
namespace {

// Where rank 0 listens for the others (its own namespace: always free).
constexpr int kMasterPort = 29500;

// "1.16 GiB" as shardps-local prints it (FormatLinkBytes), in bytes.
bool ParseBytes(absl::string_view number, absl::string_view unit,
                int64_t* bytes) {
  double v = 0;
  if (!absl::SimpleAtod(number, &v)) return false;
  const std::map<absl::string_view, double> units = {
      {"B", 1}, {"KiB", 1024}, {"MiB", 1 << 20}, {"GiB", 1 << 30}};
  const auto it = units.find(unit);
  if (it == units.end()) return false;
  *bytes = static_cast<int64_t>(v * it->second);
  return true;
}

// Kills and reaps the ranks whose `done` is false.
void KillRanks(const std::vector<pid_t>& pids, const std::vector<bool>& done) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (done[r]) continue;
    kill(pids[r], SIGKILL);
    waitpid(pids[r], nullptr, 0);
  }
}

// Waits for every rank; the first that fails has the others killed.
absl::Status WaitForRanks(std::vector<pid_t> pids,
                          const std::vector<std::string>& logs,
                          absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<bool> done(pids.size(), false);
  absl::Status status;
  for (size_t left = pids.size(); left > 0 && status.ok();) {
    for (size_t r = 0; r < pids.size() && status.ok(); ++r) {
      int wait_status = 0;
      if (done[r] || waitpid(pids[r], &wait_status, WNOHANG) != pids[r]) {
        continue;
      }
      done[r] = true;
      --left;
      if (!local::ExitedCleanly(wait_status)) {
        status = absl::InternalError(absl::StrCat(
            "DDP rank ", r, " ended with ", local::DescribeExit(wait_status),
            "; the end of ", logs[r], ":\n",
            absl::StrJoin(local::LastLines(logs[r], 20), "\n")));
      }
    }
    if (status.ok() && left > 0 && absl::Now() > deadline) {
      status = absl::InternalError(
          absl::StrCat("DDP ranks still running after ",
                       absl::FormatDuration(timeout), "; logs: ", logs[0]));
    }
    // Polled: the ranks are children of this thread alone, and a tenth of
    // a second is nothing against a run of many seconds.
    if (status.ok() && left > 0) absl::SleepFor(absl::Milliseconds(100));
  }
  KillRanks(pids, done);
  return status;
}

}  // namespace

std::vector<HostBytes> ParseLinkBytes(const std::string& out) {
  std::vector<HostBytes> hosts;
  bool in_table = false;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "bytes over each host's link")) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    std::vector<absl::string_view> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    HostBytes h;
    if (f.size() < 8 || f[2] != "sent" || f[5] != "received" ||
        !ParseBytes(f[3], f[4], &h.sent) ||
        !ParseBytes(f[6], f[7], &h.received)) {
      break;
    }
    if (f.size() >= 12 && f[8] == "TCP" && f[9] == "retransmitted" &&
        !absl::SimpleAtod(f[10], &h.retransmitted_percent)) {
      h.retransmitted_percent = -1;
    }
    h.name = std::string(f[0]);
    hosts.push_back(h);
  }
  return hosts;
}

int64_t BusiestBytes(const std::vector<HostBytes>& bytes, std::string* name) {
  int64_t most = 0;
  for (const HostBytes& b : bytes) {
    if (std::max(b.sent, b.received) > most) {
      most = std::max(b.sent, b.received);
      *name = b.name;
    }
  }
  return most;
}

std::string HostBytesText(const std::vector<HostBytes>& bytes) {
  std::vector<std::string> parts;
  for (const HostBytes& b : bytes) {
    parts.push_back(absl::StrCat(b.name, " ", local::FormatBytes(b.sent), " / ",
                                 local::FormatBytes(b.received)));
    if (b.retransmitted_percent >= 0) {
      absl::StrAppendFormat(&parts.back(), " (TCP retransmitted %.2f %%)",
                            b.retransmitted_percent);
    }
  }
  return absl::StrJoin(parts, ", ");
}

absl::StatusOr<std::vector<double>> CsvColumn(const std::string& path,
                                              const std::string& name,
                                              const std::string& kind,
                                              const std::string& kind_value) {
  std::ifstream csv(path);
  std::string line;
  if (!std::getline(csv, line)) {
    return absl::InternalError(absl::StrCat("no header line in ", path));
  }
  const std::vector<std::string> header = absl::StrSplit(line, ',');
  auto index = [&](const std::string& column) -> absl::StatusOr<size_t> {
    const auto at = std::find(header.begin(), header.end(), column);
    if (at == header.end()) {
      return absl::InternalError(absl::StrCat(path, " has no column ", column));
    }
    return at - header.begin();
  };
  SHARDPS_ASSIGN_OR_RETURN(const size_t i, index(name));
  size_t k = 0;
  if (!kind.empty()) {
    SHARDPS_ASSIGN_OR_RETURN(k, index(kind));
  }
  std::vector<double> values;
  while (std::getline(csv, line)) {
    const std::vector<std::string> f = absl::StrSplit(line, ',');
    if (!kind.empty() && (k >= f.size() || f[k] != kind_value)) continue;
    double v = 0;
    if (i < f.size() && absl::SimpleAtod(f[i], &v)) values.push_back(v);
  }
  return values;
}

absl::StatusOr<local::NetworkTools> CheckEmulatedBench(
    const std::string& what, const std::string& local_binary) {
#if !defined(NDEBUG) || !defined(__OPTIMIZE__)
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": this build is unoptimized or has assertions on; its times would not "
      "be the job's. Build with deploy/local/build.sh "
      "(CMAKE_BUILD_TYPE=Release)"));
#endif
  SHARDPS_ASSIGN_OR_RETURN(local::NetworkTools tools,
                           local::FindNetworkTools(what));
  if (access(local_binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(local_binary, " is not there: build shardps-local"));
  }
  if (!RunCommand("/usr/bin/python3 -c 'import torch' 2>&1").ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " compares with PyTorch DDP: apt-get install python3-torch"));
  }
  return tools;
}

absl::StatusOr<RanksRun> RunRanksOnHosts(
    const std::string& program, int64_t rate, int ranks,
    const local::NetworkTools& tools,
    const std::function<
        std::vector<std::string>(int rank, const std::string& master)>& argv,
    absl::Duration timeout, const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view var = *e;
    const absl::string_view name = var.substr(0, var.find('='));
    if (std::none_of(extra_env.begin(), extra_env.end(),
                     [&](const std::string& x) {
                       return absl::StartsWith(x, absl::StrCat(name, "="));
                     })) {
      env.push_back(*e);
    }
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<local::EmulatedHost> hosts;
  for (int r = 0; r < ranks; ++r) {
    hosts.push_back(
        {absl::StrCat("rank-", r), absl::StrCat("10.213.0.", 1 + r)});
  }
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<local::EmulatedHosts> made,
      local::EmulatedHosts::Create(hosts, local::TbfShapeFor(rate), tools));
  const std::string dir = testing::MakeTempDir("shardps-bench-ddp");
  const std::string master = absl::StrCat(hosts[0].address, ":", kMasterPort);
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  absl::Status spawned;
  for (int r = 0; r < ranks && spawned.ok(); ++r) {
    logs.push_back(absl::StrCat(dir, "/rank-", r, ".log"));
    absl::StatusOr<pid_t> pid = local::SpawnWithLog(
        program, argv(r, master), logs.back(), /*append=*/false, &env,
        made->NamespaceFd(hosts[r].name));
    if (pid.ok()) {
      pids.push_back(*pid);
    } else {
      spawned = pid.status();
    }
  }
  if (!spawned.ok()) {
    // The ranks started would wait for the missing one.
    KillRanks(pids, std::vector<bool>(pids.size(), false));
    return spawned;
  }
  SHARDPS_RETURN_IF_ERROR(WaitForRanks(pids, logs, timeout));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<local::HostLinkBytes> link_bytes,
                           made->Bytes());
  RanksRun run;
  for (const local::HostLinkBytes& b : link_bytes) {
    run.bytes.push_back({b.name, b.sent, b.received, -1});
    if (b.tcp_segments > 0 && b.tcp_retransmitted >= 0) {
      run.bytes.back().retransmitted_percent =
          100.0 * b.tcp_retransmitted / b.tcp_segments;
    }
  }
  const std::vector<std::string> last = local::LastLines(logs[0], 1);
  run.result = last.empty() ? "" : last.back();
  run.log0 = logs[0];
  return run;
}

}  // namespace shardps::bench
