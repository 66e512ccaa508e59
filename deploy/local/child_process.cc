#include "deploy/local/child_process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/signal_wait.h"

namespace shardps::local {
namespace {

// Runs in the child between fork and exec: only async-signal-safe calls.
[[noreturn]] void ExecChild(pid_t parent, int log_fd, int netns_fd,
                            char* const* argv, char* const* envp,
                            const std::string& exec_error) {
  // If the launcher is SIGKILLed, its daemons must not outlive it.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1);
  const int null_fd = open("/dev/null", O_RDONLY);
  if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
  dup2(log_fd, STDOUT_FILENO);
  dup2(log_fd, STDERR_FILENO);
  // The launcher blocks SIGINT, SIGTERM and SIGCHLD and ignores SIGPIPE; the
  // mask and ignored signals survive exec, so reset them.
  signal(SIGPIPE, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) {
    const char* reason = strerror(errno);
    WriteAll(STDERR_FILENO, "cannot enter the host's network namespace: ");
    WriteAll(STDERR_FILENO, absl::string_view(reason, strlen(reason)));
    WriteAll(STDERR_FILENO, "\n");
    _exit(127);
  }
  execve(argv[0], argv, envp);
  WriteAll(STDERR_FILENO, exec_error);
  const char* reason = strerror(errno);
  WriteAll(STDERR_FILENO, absl::string_view(reason, strlen(reason)));
  WriteAll(STDERR_FILENO, "\n");
  _exit(127);
}

}  // namespace

void WriteAll(int fd, absl::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

absl::StatusOr<pid_t> SpawnWithLog(const std::string& binary,
                                   const std::vector<std::string>& args,
                                   const std::string& log_path, bool append,
                                   const std::vector<std::string>* env,
                                   int netns_fd) {
  // Built before fork: the child only execs.
  std::vector<std::string> owned;
  owned.reserve(args.size() + 1);
  owned.push_back(binary);
  owned.insert(owned.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : owned) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> owned_env;
  std::vector<char*> envp;
  if (env != nullptr) {
    owned_env = *env;
    for (std::string& e : owned_env) envp.push_back(e.data());
    envp.push_back(nullptr);
  }
  const std::string exec_error = absl::StrCat("cannot execute ", binary, ": ");

  // The parent creates the log, so it exists once this returns and can be
  // followed at once. Appending keeps a follower's offset valid.
  const int log_fd = open(
      log_path.c_str(),
      O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
  if (log_fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", log_path, ": ", strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    ExecChild(parent, log_fd, netns_fd, argv.data(),
              env != nullptr ? envp.data() : environ, exec_error);
  }
  const int fork_errno = errno;
  close(log_fd);
  if (pid < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot start ", binary, ": fork: ", strerror(fork_errno)));
  }
  return pid;
}

std::string DescribeExit(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    const char* name = sigabbrev_np(sig);
    return name != nullptr ? absl::StrCat("signal ", sig, ", SIG", name)
                           : absl::StrCat("signal ", sig);
  }
  return absl::StrCat("exit code ", WEXITSTATUS(wait_status));
}

bool ExitedCleanly(int wait_status) {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

std::vector<std::string> LastLines(const std::string& path, int n) {
  // The last 64 KiB hold the last lines of any log a daemon writes; reading
  // only those keeps a long run's log from being loaded whole.
  constexpr off_t kTailBytes = 64 << 10;
  std::vector<std::string> lines;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return lines;
  const off_t size = lseek(fd, 0, SEEK_END);
  if (size <= 0) {
    close(fd);
    return lines;
  }
  const off_t start = size > kTailBytes ? size - kTailBytes : 0;
  std::string text(static_cast<size_t>(size - start), '\0');
  const ssize_t got = pread(fd, text.data(), text.size(), start);
  close(fd);
  if (got <= 0) return lines;
  text.resize(static_cast<size_t>(got));
  lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  // A tail that starts mid-file starts mid-line: drop that fragment.
  if (start > 0 && !lines.empty()) lines.erase(lines.begin());
  if (static_cast<int>(lines.size()) > n) {
    lines.erase(lines.begin(), lines.end() - n);
  }
  return lines;
}

LogFollower::~LogFollower() {
  if (fd_ >= 0) close(fd_);
}

absl::Status LogFollower::Open(const std::string& path, int out_fd) {
  fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  }
  out_fd_ = out_fd;
  return absl::OkStatus();
}

void LogFollower::Relay() {
  if (fd_ < 0) return;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd_, buffer, sizeof(buffer))) > 0) {
    partial_.append(buffer, static_cast<size_t>(n));
  }
  const size_t end = partial_.rfind('\n');
  if (end == std::string::npos) return;
  WriteAll(out_fd_, absl::string_view(partial_).substr(0, end + 1));
  partial_.erase(0, end + 1);
}

void LogFollower::Finish() {
  Relay();
  if (fd_ < 0) return;
  if (!partial_.empty()) WriteAll(out_fd_, partial_ + "\n");
  partial_.clear();
  close(fd_);
  fd_ = -1;
}

std::string SignalName(int sig) {
  const char* name = sigabbrev_np(sig);
  return name != nullptr ? absl::StrCat("SIG", name) : absl::StrCat(sig);
}

int WaitForSignal(absl::Duration timeout) {
  return WaitForSignalFor({SIGINT, SIGTERM, SIGCHLD}, timeout);
}

}  // namespace shardps::local
