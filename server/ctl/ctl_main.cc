// shardps-ctl: inspects a running shardps job from the shell. Exit code 0 on
// success, 1 on any failure (with a one-line reason on stderr).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/security_flags.h"
#include "server/ctl/ctl.h"

ABSL_FLAG(std::string, coordinator, "",
          "status, checkpoint: host:port of the shardps-coordinator.");
ABSL_FLAG(std::string, addr, "", "health: host:port of the daemon to check.");
ABSL_FLAG(std::string, service, "",
          "health: service name to check, e.g. shardps.v1.Coordinator; "
          "empty checks the whole server.");
ABSL_FLAG(std::vector<std::string>, servers, {},
          "shards, checkpoint: comma-separated host:port of the parameter "
          "shards (checkpoint: every shard of the job, instead of "
          "--coordinator).");
ABSL_FLAG(int64_t, step, 0,
          "checkpoint: the step to checkpoint at; 0 picks the next one every "
          "shard can still take.");
ABSL_FLAG(int32_t, checkpoint_timeout_s, 600,
          "checkpoint: how long to wait for the checkpoint to be committed.");
ABSL_FLAG(int32_t, timeout_ms, 5000, "Deadline of every RPC in milliseconds.");

namespace shardps::ctl {
namespace {

constexpr char kUsage[] =
    "inspects a running shardps job.\n"
    "usage: shardps-ctl <subcommand> [flags]\n"
    "  status --coordinator=host:port           job view: generation, "
    "servers, workers, progress, each shard's load and checkpoint\n"
    "  health --addr=host:port [--service=NAME]  exit 0 only when SERVING\n"
    "  shards --servers=host:port,...           each parameter shard's "
    "status\n"
    "  checkpoint --coordinator=host:port | --servers=host:port,... "
    "[--step=N]\n"
    "                                           checkpoint now; exit 0 once "
    "committed\n"
    "every RPC has a deadline: --timeout_ms (default 5000)\n"
    "TLS: --tls_ca (and --tls_cert --tls_key for mutual TLS), bearer token: "
    "--auth_token_file, as given to the daemons";

int Fail(const std::string& reason) {
  absl::FPrintF(stderr, "shardps-ctl: %s\n", reason);
  return 1;
}

int Status(const SecurityOptions& security, absl::Duration timeout) {
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) return Fail("status needs --coordinator=host:port");
  absl::StatusOr<v1::JobStatus> status =
      FetchJobStatus(coordinator, security, timeout);
  if (!status.ok()) return Fail(status.status().ToString());
  absl::PrintF("%s", FormatJobStatus(*status));
  // The coordinator answered: shards that do not show in their rows, and
  // status still succeeds.
  const std::vector<std::string> servers = LiveServers(*status);
  if (!servers.empty()) {
    absl::PrintF(
        "\n%s", FormatShardLoad(FetchShardReports(servers, security, timeout)));
  }
  return 0;
}

int CheckpointNow(const SecurityOptions& security, absl::Duration timeout) {
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  std::vector<std::string> servers = absl::GetFlag(FLAGS_servers);
  if (coordinator.empty() == servers.empty()) {
    return Fail(
        "checkpoint needs either --coordinator=host:port or "
        "--servers=host:port,...");
  }
  CheckpointOptions options;
  options.step = absl::GetFlag(FLAGS_step);
  options.rpc_timeout = timeout;
  const int32_t wait_s = absl::GetFlag(FLAGS_checkpoint_timeout_s);
  if (wait_s <= 0) {
    return Fail(
        absl::StrFormat("--checkpoint_timeout_s=%d must be positive", wait_s));
  }
  options.wait = absl::Seconds(wait_s);
  if (!coordinator.empty()) {
    absl::StatusOr<v1::JobStatus> status =
        FetchJobStatus(coordinator, security, timeout);
    if (!status.ok()) return Fail(status.status().ToString());
    absl::StatusOr<std::vector<std::string>> all = AllServers(*status);
    if (!all.ok()) return Fail(all.status().ToString());
    servers = *std::move(all);
  }
  absl::StatusOr<CheckpointResult> done =
      Checkpoint(servers, security, options, [](const std::string& line) {
        absl::PrintF("%s\n", line);
        std::fflush(stdout);
      });
  if (!done.ok()) return Fail(done.status().ToString());
  absl::PrintF("checkpoint of step %d committed in %s\n", done->step,
               done->dir);
  return 0;
}

int Health(const SecurityOptions& security, absl::Duration timeout) {
  const std::string addr = absl::GetFlag(FLAGS_addr);
  if (addr.empty()) return Fail("health needs --addr=host:port");
  const std::string service = absl::GetFlag(FLAGS_service);
  absl::StatusOr<HealthState> state =
      CheckHealth(addr, service, security, timeout);
  if (!state.ok()) return Fail(state.status().ToString());
  const std::string what =
      service.empty() ? addr : absl::StrFormat("%s (%s)", addr, service);
  if (*state != HealthState::kServing) {
    return Fail(absl::StrFormat("%s is %s", what, HealthStateName(*state)));
  }
  absl::PrintF("%s: SERVING\n", what);
  return 0;
}

int Shards(const SecurityOptions& security, absl::Duration timeout) {
  const std::vector<std::string> servers = absl::GetFlag(FLAGS_servers);
  if (servers.empty()) return Fail("shards needs --servers=host:port,...");
  const std::vector<ShardReport> reports =
      FetchShardReports(servers, security, timeout);
  absl::PrintF("%s", FormatShardReports(reports));
  int failed = 0;
  for (const ShardReport& r : reports) failed += r.status.ok() ? 0 : 1;
  if (failed > 0) {
    return Fail(absl::StrFormat("%d of %d shards did not answer", failed,
                                reports.size()));
  }
  return 0;
}

int Main(const std::vector<char*>& args) {
  if (args.size() != 2) {
    return Fail(absl::StrFormat(
        "%s\n%s",
        args.size() < 2 ? "missing subcommand" : "one subcommand at a time",
        kUsage));
  }
  const int32_t timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (timeout_ms <= 0) {
    return Fail(
        absl::StrFormat("--timeout_ms=%d must be positive", timeout_ms));
  }
  const absl::Duration timeout = absl::Milliseconds(timeout_ms);
  const absl::StatusOr<SecurityOptions> security = SecurityOptionsFromFlags();
  if (!security.ok()) return Fail(std::string(security.status().message()));
  const std::string command = args[1];
  if (command == "status") return Status(*security, timeout);
  if (command == "health") return Health(*security, timeout);
  if (command == "shards") return Shards(*security, timeout);
  if (command == "checkpoint") return CheckpointNow(*security, timeout);
  return Fail(
      absl::StrFormat("unknown subcommand \"%s\"\n%s", command, kUsage));
}

}  // namespace
}  // namespace shardps::ctl

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(shardps::ctl::kUsage);
  // Abseil's --help lists flags of a file named after the binary; list ours.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "ctl_main") ||
           absl::StrContains(file, "security_flags");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  return shardps::ctl::Main(absl::ParseCommandLine(argc, argv));
}
