// Runs a shardps daemon as a child process for end-to-end tests: binds port 0,
// waits (with a deadline) for the port file, and stops the process (SIGTERM,
// then SIGKILL) when destroyed. Test-only.
#ifndef SHARDPS_TESTS_TESTING_DAEMON_H_
#define SHARDPS_TESTS_TESTING_DAEMON_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardps::testing {

class Daemon {
 public:
  // Starts `binary` with `args` plus --port=0 (unless `args` has a --port)
  // and --port_file=<dir>/<name>.port, and waits up to `timeout` for the
  // port. Output goes to <dir>/<name>.log; an empty `dir` is a fresh
  // temporary directory.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const std::string& name, const std::string& binary,
      std::vector<std::string> args, absl::Duration timeout = absl::Seconds(30),
      const std::string& dir = "");
  // Starts a process that does not serve (a worker): no port file.
  static absl::StatusOr<std::unique_ptr<Daemon>> StartProcess(
      const std::string& name, const std::string& binary,
      std::vector<std::string> args, const std::string& dir = "");
  ~Daemon();

  int port() const { return port_; }
  std::string address() const;
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  std::string ReadLog() const;

  // Sends `sig`; then waits up to `timeout` for the exit and returns the
  // exit code (128 + signal if killed), or DeadlineExceeded.
  absl::StatusOr<int> Stop(int sig, absl::Duration timeout);
  // Waits for the process to exit by itself.
  absl::StatusOr<int> Wait(absl::Duration timeout);

 private:
  Daemon() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  bool exited_ = false;
  int exit_code_ = 0;
  std::string log_path_;
};

// A fresh directory under $TEST_TMPDIR or /tmp, of this call alone; aborts
// the test when none can be made.
std::string MakeTempDir(const std::string& prefix);

// A TCP port on 127.0.0.1 that was free a moment ago (bound, then closed).
int FreePort();

// Polls the port file a daemon writes (--port_file, --metrics_port_file)
// until it holds a port (returned) or `timeout` passes (0).
int WaitForPortFile(const std::string& path, absl::Duration timeout);

// Polls `d`'s log until it contains `text` (true) or `timeout` passes.
bool WaitForLog(const Daemon& d, const std::string& text,
                absl::Duration timeout = absl::Seconds(60));

// Runs `binary` with `args` to its end (at most `timeout`) and returns its
// exit code (-1 if it did not end) and its output.
struct CommandResult {
  int code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& binary,
                         std::vector<std::string> args,
                         absl::Duration timeout = absl::Seconds(30));

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_DAEMON_H_
