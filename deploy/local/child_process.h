// The process plumbing of shardps-local: starting a daemon with its output in
// a log file, waiting for it to end and describing how it ended, and reading
// that log back (its last lines, or new lines as they are written).
// Single-threaded use only.
#ifndef SHARDPS_DEPLOY_LOCAL_CHILD_PROCESS_H_
#define SHARDPS_DEPLOY_LOCAL_CHILD_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shardps::local {

// Starts `binary` with `args` (argv[0] is `binary`), its stdout and stderr
// going to `log_path` (truncated first unless `append`), every signal
// unblocked and at default disposition, and SIGTERM delivered to it should
// this process die first. Returns the child's pid; FailedPrecondition if the
// log cannot be created. A binary that cannot be executed exits 127 with the
// reason in the log. `env` ("NAME=value" strings): the child's whole
// environment; null: this process's. `netns_fd` >= 0: a network namespace
// the child enters before it executes `binary` (it exits 127 with the
// reason in the log if it cannot).
absl::StatusOr<pid_t> SpawnWithLog(
    const std::string& binary, const std::vector<std::string>& args,
    const std::string& log_path, bool append,
    const std::vector<std::string>* env = nullptr, int netns_fd = -1);

// Writes all of `text` to `fd` unbuffered, so that it keeps its place among
// relayed log lines; gives up silently on an error such as a closed terminal.
void WriteAll(int fd, absl::string_view text);

// "exit code N" or "signal S (NAME)" for a status from wait4().
std::string DescribeExit(int wait_status);

// True if `wait_status` is a normal exit with code 0.
bool ExitedCleanly(int wait_status);

// "SIGTERM" for SIGTERM; the number for a signal without a name.
std::string SignalName(int sig);

// Waits up to `timeout` for SIGINT, SIGTERM or SIGCHLD and returns it; 0 if
// none came. REQUIRES: the three blocked, so that they wait as pending.
int WaitForSignal(absl::Duration timeout);

// The last `n` lines of the file at `path` (fewer if it is shorter; none if
// it cannot be read).
std::vector<std::string> LastLines(const std::string& path, int n);

// Copies the lines appended to a log file to a file descriptor as they
// appear, whole lines only until Finish(). Owns its read descriptor.
class LogFollower {
 public:
  LogFollower() = default;
  ~LogFollower();
  LogFollower(const LogFollower&) = delete;
  LogFollower& operator=(const LogFollower&) = delete;

  // Starts following `path` from its beginning, writing to `out_fd` (not
  // owned; must stay open). FailedPrecondition if `path` cannot be opened.
  absl::Status Open(const std::string& path, int out_fd);
  // Writes every complete line appended since the last call.
  void Relay();
  // Relays what is left, including an unterminated last line, and closes.
  void Finish();
  // Between Open() and Finish().
  bool is_open() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  int out_fd_ = -1;
  std::string partial_;
};

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_CHILD_PROCESS_H_
