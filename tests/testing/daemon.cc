#include "tests/testing/daemon.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace shardps::testing {
namespace {

absl::StatusOr<pid_t> Spawn(const std::string& binary,
                            const std::vector<std::string>& args,
                            const std::string& log_path) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    // Signals blocked by the test runner must not stay blocked in the child.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(binary.c_str(), argv.data());
    const std::string msg = "cannot execute " + binary + "\n";
    ssize_t ignored = write(2, msg.data(), msg.size());
    (void)ignored;
    _exit(127);
  }
  return pid;
}

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  const char* base = getenv("TEST_TMPDIR");
  std::string templ =
      absl::StrCat(base != nullptr ? base : "/tmp", "/", prefix, ".XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    // A test that went on would share or delete files it does not own.
    std::fprintf(stderr, "mkdtemp(%s): %s\n", templ.c_str(),
                 std::strerror(errno));
    std::abort();
  }
  return templ;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::StartProcess(
    const std::string& name, const std::string& binary,
    std::vector<std::string> args, const std::string& dir) {
  std::unique_ptr<Daemon> d(new Daemon());
  d->log_path_ = absl::StrCat(
      dir.empty() ? MakeTempDir("shardps-" + name) : dir, "/", name, ".log");
  absl::StatusOr<pid_t> pid = Spawn(binary, args, d->log_path_);
  if (!pid.ok()) return pid.status();
  d->pid_ = *pid;
  return d;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    const std::string& name, const std::string& binary,
    std::vector<std::string> args, absl::Duration timeout,
    const std::string& log_dir) {
  const std::string dir =
      log_dir.empty() ? MakeTempDir("shardps-" + name) : log_dir;
  const std::string port_file = dir + "/" + name + ".port";
  const bool has_port = std::any_of(
      args.begin(), args.end(),
      [](const std::string& a) { return a.rfind("--port=", 0) == 0; });
  if (!has_port) args.push_back("--port=0");
  args.push_back("--port_file=" + port_file);
  std::unique_ptr<Daemon> d(new Daemon());
  d->log_path_ = dir + "/" + name + ".log";
  absl::StatusOr<pid_t> pid = Spawn(binary, args, d->log_path_);
  if (!pid.ok()) return pid.status();
  d->pid_ = *pid;
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (const int port = WaitForPortFile(port_file, absl::ZeroDuration());
        port > 0) {
      d->port_ = port;
      return d;
    }
    int status = 0;
    if (waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
      d->exited_ = true;
      return absl::FailedPreconditionError(
          absl::StrCat(name, " exited before serving:\n", d->ReadLog()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(name, " did not report a port:\n", d->ReadLog()));
}

std::string Daemon::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

std::string Daemon::ReadLog() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<int> Daemon::Wait(absl::Duration timeout) {
  if (exited_) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_code_ =
          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<int> Daemon::Stop(int sig, absl::Duration timeout) {
  if (!exited_) kill(pid_, sig);
  return Wait(timeout);
}

Daemon::~Daemon() {
  if (exited_ || pid_ <= 0) return;
  if (!Stop(SIGTERM, absl::Seconds(5)).ok()) {
    kill(pid_, SIGKILL);
    Wait(absl::Seconds(5)).IgnoreError();
  }
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

int WaitForPortFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path);
    std::string text;
    int port = 0;
    if (std::getline(in, text) && absl::SimpleAtoi(text, &port) && port > 0) {
      return port;
    }
    if (absl::Now() >= deadline) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

bool WaitForLog(const Daemon& d, const std::string& text,
                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (d.ReadLog().find(text) == std::string::npos) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

CommandResult RunCommand(const std::string& binary,
                         std::vector<std::string> args,
                         absl::Duration timeout) {
  CommandResult result;
  absl::StatusOr<std::unique_ptr<Daemon>> d =
      Daemon::StartProcess("command", binary, std::move(args));
  if (!d.ok()) {
    result.output = d.status().ToString();
    return result;
  }
  absl::StatusOr<int> code = (*d)->Wait(timeout);
  result.code = code.value_or(-1);
  result.output = (*d)->ReadLog();
  return result;
}

}  // namespace shardps::testing
