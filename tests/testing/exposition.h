// Parses the Prometheus text exposition format (version 0.0.4) as a scrape
// of /metrics returns it, strictly enough to catch malformed output: every
// line is a # HELP or # TYPE comment or a sample "series value". Test-only.
#ifndef SHARDPS_TESTS_TESTING_EXPOSITION_H_
#define SHARDPS_TESTS_TESTING_EXPOSITION_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace shardps::testing {

// Samples keyed by their series as written: `name` or `name{label="v",...}`.
using Samples = std::map<std::string, double>;

// InvalidArgument naming the first bad line, a sample of a family without a
// # TYPE line, or a series that appears twice.
absl::StatusOr<Samples> ParseExposition(const std::string& text);

// The value of `series`, or -1 when it is absent (what a test prints).
double SampleOr(const Samples& samples, const std::string& series,
                double missing = -1);

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_EXPOSITION_H_
