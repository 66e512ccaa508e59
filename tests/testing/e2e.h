// Small helpers shared by the end-to-end tests: starting daemons and running
// commands with a test failure instead of a status, waiting for a clean exit,
// reading files and checkpoint directories, and the kill tests' job.
// Test-only.
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

// The training flags of the seeded sync job that the kill tests interrupt and
// compare with an uninterrupted run: `max_steps` steps of Adam on 12800
// Fashion-MNIST images on the CPU backend, in 16 KiB chunks. Every run of
// them ends with the same model, bit for bit.
std::vector<std::string> KillJobTrainingFlags(int max_steps);

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_E2E_H_
