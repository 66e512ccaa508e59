// Small helpers shared by the end-to-end tests: starting daemons and running
// commands with a test failure instead of a status, waiting for a clean exit,
// reading files and checkpoint directories. Test-only.
#ifndef SHARDPS_TESTS_TESTING_E2E_H_
#define SHARDPS_TESTS_TESTING_E2E_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/daemon.h"

namespace shardps::testing {

// The daemon, or null after failing the test with the status.
std::unique_ptr<Daemon> Must(absl::StatusOr<std::unique_ptr<Daemon>> d);

// Waits up to `timeout` for `d` to exit by itself and expects exit code 0;
// the daemon's log goes with any failure.
void ExpectExitsZero(Daemon* d, absl::Duration timeout);

// Runs `binary` with `args` to its end: its exit code and output, after
// failing the test (code -1) when it cannot start or does not end within
// `timeout`.
CommandResult MustRun(const std::string& binary, std::vector<std::string> args,
                      absl::Duration timeout = absl::Seconds(30));

// The whole file (empty when it cannot be read).
std::string ReadFile(const std::string& path);
// The file's lines, without their newlines (none when it cannot be read).
std::vector<std::string> ReadLines(const std::string& path);

// NewestCommittedStep(dir) (common/checkpoint_steps.h), or -1 when none is
// committed or `dir` cannot be read: for polling loops.
int64_t NewestCommitted(const std::string& dir);

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_E2E_H_
