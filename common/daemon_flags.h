// Flags every daemon shares (--host, --port, --port_file, --log_format) and
// the process plumbing around them: port files, termination signals, and
// turning a Status into an exit code. Only *_main.cc files include this.
#ifndef SHARDPS_COMMON_DAEMON_FLAGS_H_
#define SHARDPS_COMMON_DAEMON_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

ABSL_DECLARE_FLAG(std::string, host);
ABSL_DECLARE_FLAG(int32_t, port);
ABSL_DECLARE_FLAG(std::string, port_file);
ABSL_DECLARE_FLAG(std::string, log_format);

namespace shardps {

// Parses flags with a usage line (so --help works) and returns the positional
// arguments; exits 1 with a one-line error on unknown or malformed flags.
std::vector<char*> ParseDaemonFlags(int argc, char** argv,
                                    absl::string_view usage);

// Validates the shared flags: InvalidArgument naming the flag.
absl::Status CheckDaemonFlags();

// Writes `port` to `path` atomically (temporary file, then rename), so a
// reader never sees a partial number. Empty path: does nothing.
absl::Status WritePortFile(const std::string& path, int port);

// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts
// afterwards; call first thing in main. WaitForTerminationSignal then
// receives them synchronously.
void BlockTerminationSignals();
// Waits until SIGINT or SIGTERM arrives and returns its number.
int WaitForTerminationSignal();

// Logs a failed status as one line and returns the process exit code.
int ExitCode(const absl::Status& status);

}  // namespace shardps

#endif  // SHARDPS_COMMON_DAEMON_FLAGS_H_
