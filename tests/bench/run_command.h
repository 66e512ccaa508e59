// Child commands of shardps-bench: run one through the shell, read figures
// from the one-line JSON objects the Python peers print.
#ifndef SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
#define SHARDPS_TESTS_BENCH_RUN_COMMAND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

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

// The numbers of a flat JSON list, "key": [1.5, 2.5]; empty when absent.
std::vector<double> JsonList(const std::string& json, const std::string& key);

// The value after `key ` in a progress line ("... epoch_s 12.34 ...").
bool ProgressField(absl::string_view line, absl::string_view key, double* v);

// The last `n` lines of `text`, indented, to show why a command failed.
std::string Tail(absl::string_view text, size_t n);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
