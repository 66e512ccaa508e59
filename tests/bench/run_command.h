// Child commands of shardps-bench: run one through the shell, read figures
// from the one-line JSON objects the Python peers print.
#ifndef SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
#define SHARDPS_TESTS_BENCH_RUN_COMMAND_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace shardps::bench {

// Runs `command` through the shell; returns its stdout, or Internal with the
// exit status and the output.
absl::StatusOr<std::string> RunCommand(const std::string& command);

// What a command and every process it waited for used (getrusage of this
// process's children, before and after).
struct CommandUsage {
  double cpu_s = 0;  // user + system
  int64_t voluntary_switches = 0;
  int64_t involuntary_switches = 0;
};
// RunCommand, and the command's usage into *usage.
absl::StatusOr<std::string> RunCommand(const std::string& command,
                                       CommandUsage* usage);

// The number after "key": in a one-line JSON object (first match); -1 when
// there is none.
double JsonNumber(const std::string& json, const std::string& key);

// The text of the value of "key" (a scalar or a flat list); "?" when absent.
std::string JsonField(const std::string& json, const std::string& key);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
