// Child commands of shardps-bench: run one through the shell, read figures
// from the one-line JSON objects the Python peers print.
#ifndef SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
#define SHARDPS_TESTS_BENCH_RUN_COMMAND_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardps::bench {

// Runs `command` through the shell; returns its stdout, or Internal with the
// exit status and the output.
absl::StatusOr<std::string> RunCommand(const std::string& command);

// The number after "key": in a one-line JSON object (first match); -1 when
// there is none.
double JsonNumber(const std::string& json, const std::string& key);

// The text of the value of "key" (a scalar or a flat list); "?" when absent.
std::string JsonField(const std::string& json, const std::string& key);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_RUN_COMMAND_H_
