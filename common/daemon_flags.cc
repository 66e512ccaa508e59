#include "common/daemon_flags.h"

#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "common/transport.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address to listen on (0.0.0.0 for every interface).");
ABSL_FLAG(int32_t, port, 0, "Port to listen on; 0 picks a free one.");
ABSL_FLAG(std::string, port_file, "",
          "If set, write the bound port to this file once serving.");
ABSL_FLAG(std::string, log_format, "text", "Log format: text or json.");
ABSL_FLAG(int32_t, metrics_port, -1,
          "Serve Prometheus metrics at http://--host:PORT/metrics; 0 picks a "
          "free port, -1: off.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, write the bound metrics port to this file once serving.");

namespace shardps {

std::vector<char*> ParseDaemonFlags(int argc, char** argv,
                                    absl::string_view usage) {
  ConfigureProcessMemory();
  // Abseil's deadlock detection records every lock acquisition in a global
  // graph (about 1% of a worker's CPU in a profile of the main job). The
  // daemons go without; the unit tests, which run clients and shards in
  // one process, keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(usage);
  // Abseil's --help shows only flags defined in a file named after the
  // binary; show every shardps flag instead (and none of Abseil's own).
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return !absl::StrContains(file, "absl/");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  return absl::ParseCommandLine(argc, argv);
}

absl::Status CheckDaemonFlags() {
  const int32_t port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port=", port, " is outside [0, 65535]"));
  }
  const std::string format = absl::GetFlag(FLAGS_log_format);
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format=", format, " is not one of: text, json"));
  }
  if (absl::GetFlag(FLAGS_host).empty()) {
    return absl::InvalidArgumentError("--host is empty");
  }
  const int32_t metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < -1 || metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port=", metrics_port, " is outside [-1, 65535]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> ServeMetricsFromFlags() {
  const int32_t port = absl::GetFlag(FLAGS_metrics_port);
  if (port == -1) return nullptr;
  const std::string host = absl::GetFlag(FLAGS_host);
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Serve(host, port);
  if (!exporter.ok()) return exporter.status();
  LogInfo("metrics at http://%s:%d/metrics", host, (*exporter)->port());
  absl::Status written = WritePortFile(absl::GetFlag(FLAGS_metrics_port_file),
                                       (*exporter)->port());
  if (!written.ok()) return written;
  return exporter;
}

absl::Status WritePortFile(const std::string& path, int port) {
  if (path.empty()) return absl::OkStatus();
  return WriteFileAtomically(path, absl::StrCat(port, "\n"));
}

int ExitCode(const absl::Status& status) {
  if (status.ok()) return 0;
  LogError("%s", status.ToString());
  return 1;
}

}  // namespace shardps
