// Small helpers shared by the end-to-end tests: starting daemons with a
// test failure instead of a status, waiting for a clean exit, reading files.
// Test-only.
#ifndef SHARDPS_TESTS_TESTING_E2E_H_
#define SHARDPS_TESTS_TESTING_E2E_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/daemon.h"

namespace shardps::testing {

// The daemon, or null after failing the test with the status.
std::unique_ptr<Daemon> Must(absl::StatusOr<std::unique_ptr<Daemon>> d);

// Waits up to `timeout` for `d` to exit by itself and expects exit code 0;
// the daemon's log goes with any failure.
void ExpectExitsZero(Daemon* d, absl::Duration timeout);

// The whole file (empty when it cannot be read).
std::string ReadFile(const std::string& path);

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_E2E_H_
