// Flags every daemon shares (--host, --port, --port_file, --log_format,
// --metrics_port, --metrics_port_file) and the process plumbing around them:
// port files, the metrics endpoint, and turning a Status into an exit code
// (termination signals: signal_wait.h, included here for the mains). Only
// *_main.cc files include this.
#ifndef SHARDPS_COMMON_DAEMON_FLAGS_H_
#define SHARDPS_COMMON_DAEMON_FLAGS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/metrics.h"
#include "common/signal_wait.h"

ABSL_DECLARE_FLAG(std::string, host);
ABSL_DECLARE_FLAG(int32_t, port);
ABSL_DECLARE_FLAG(std::string, port_file);
ABSL_DECLARE_FLAG(std::string, log_format);
ABSL_DECLARE_FLAG(int32_t, metrics_port);
ABSL_DECLARE_FLAG(std::string, metrics_port_file);

namespace shardps {

// Parses flags with a usage line (so --help works) and returns the positional
// arguments; exits 1 with a one-line error on unknown or malformed flags.
std::vector<char*> ParseDaemonFlags(int argc, char** argv,
                                    absl::string_view usage);

// Validates the shared flags: InvalidArgument naming the flag.
absl::Status CheckDaemonFlags();

// Writes `port` and a newline to `path` with WriteFileAtomically, so a reader
// never sees a partial number. Empty path: does nothing.
absl::Status WritePortFile(const std::string& path, int port);

// Serves Prometheus metrics on --host:--metrics_port and writes the bound
// port to --metrics_port_file; nullptr (and no error) when --metrics_port is
// -1. Unavailable naming --metrics_port when the port cannot be bound.
absl::StatusOr<std::unique_ptr<MetricsExporter>> ServeMetricsFromFlags();

// Logs a failed status as one line and returns the process exit code.
int ExitCode(const absl::Status& status);

}  // namespace shardps

#endif  // SHARDPS_COMMON_DAEMON_FLAGS_H_
