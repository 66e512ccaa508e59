#include "tests/testing/http_get.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardps::testing {
namespace {

// Closes the socket when the request is done.
class Socket {
 public:
  Socket() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

 private:
  const int fd_;
};

}  // namespace

absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  Socket s;
  if (s.fd() < 0) return absl::InternalError("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect 127.0.0.1:", port, ": ", strerror(errno)));
  }
  const std::string request =
      absl::StrCat("GET ", path,
                   " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (send(s.fd(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError("cannot send the request");
  }
  // HTTP/1.0 with Connection: close: the answer ends when the peer closes.
  std::string answer;
  char buf[16384];
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no complete answer from 127.0.0.1:", port, path));
    }
    pollfd p{s.fd(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <=
        0) {
      continue;
    }
    const ssize_t n = recv(s.fd(), buf, sizeof(buf), 0);
    if (n < 0) return absl::UnavailableError("recv failed");
    if (n == 0) break;
    answer.append(buf, n);
  }
  const size_t body = answer.find("\r\n\r\n");
  if (body == std::string::npos) {
    return absl::InternalError(absl::StrCat("malformed answer: ", answer));
  }
  const std::string status_line = answer.substr(0, answer.find("\r\n"));
  if (!absl::StrContains(status_line, " 200 ")) {
    return absl::InternalError(
        absl::StrCat("GET ", path, " answered ", status_line));
  }
  return answer.substr(body + 4);
}

}  // namespace shardps::testing
