#include "tests/bench/raw_tcp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardps::bench {

bool WriteAll(int fd, const char* p, int64_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, std::min(n, kIoBytes));
    if (w <= 0) return false;
    p += w;
    n -= w;
  }
  return true;
}

bool ReadAll(int fd, char* p, int64_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, std::min(n, kIoBytes));
    if (r <= 0) return false;
    p += r;
    n -= r;
  }
  return true;
}

namespace {

// Sends `n` bytes from a reusable 1 MiB buffer.
bool SendBytes(int fd, int64_t n, std::vector<char>& buf) {
  while (n > 0) {
    const int64_t k = std::min(n, kIoBytes);
    if (!WriteAll(fd, buf.data(), k)) return false;
    n -= k;
  }
  return true;
}

bool RecvBytes(int fd, int64_t n, std::vector<char>& buf) {
  while (n > 0) {
    const int64_t k = std::min(n, kIoBytes);
    if (!ReadAll(fd, buf.data(), k)) return false;
    n -= k;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RawTcpBench>> RawTcpBench::Create(
    std::vector<RawExchange> pattern) {
  std::unique_ptr<RawTcpBench> b(new RawTcpBench());
  b->pattern_ = std::move(pattern);
  b->listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(b->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(b->listen_fd_, 128) != 0 ||
      getsockname(b->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) !=
          0) {
    return absl::UnavailableError("cannot listen on 127.0.0.1");
  }
  for (size_t i = 0; i < b->pattern_.size(); ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::UnavailableError("cannot connect to the raw TCP server");
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int sfd = accept(b->listen_fd_, nullptr, nullptr);
    setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    b->client_fds_.push_back(fd);
    b->server_fds_.push_back(sfd);
    b->server_threads_.push_back(std::make_unique<std::thread>(
        [raw = b.get(), sfd] { raw->Serve(sfd); }));
  }
  return b;
}

void RawTcpBench::Serve(int fd) {
  std::vector<char> buf(kIoBytes);
  while (true) {
    int64_t header[2];
    if (!ReadAll(fd, reinterpret_cast<char*>(header), sizeof(header))) return;
    if (!RecvBytes(fd, header[0], buf)) return;
    if (!SendBytes(fd, header[1], buf)) return;
  }
}

absl::StatusOr<absl::Duration> RawTcpBench::Step() {
  std::vector<std::thread> threads;
  std::vector<bool> ok(pattern_.size(), false);
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < pattern_.size(); ++i) {
    threads.emplace_back([this, i, &ok] {
      std::vector<char> buf(kIoBytes, 1);
      const int fd = client_fds_[i];
      int64_t header[2] = {pattern_[i].request_bytes, pattern_[i].reply_bytes};
      ok[i] = WriteAll(fd, reinterpret_cast<char*>(header), sizeof(header)) &&
              SendBytes(fd, pattern_[i].request_bytes, buf) &&
              RecvBytes(fd, pattern_[i].reply_bytes, buf);
    });
  }
  for (std::thread& t : threads) t.join();
  const absl::Duration elapsed = absl::Now() - start;
  for (bool b : ok) {
    if (!b) return absl::UnavailableError("raw TCP exchange failed");
  }
  return elapsed;
}

RawTcpBench::~RawTcpBench() {
  for (int fd : client_fds_) close(fd);  // servers see EOF and return
  for (auto& t : server_threads_) t->join();
  for (int fd : server_fds_) close(fd);
  if (listen_fd_ >= 0) close(listen_fd_);
}

}  // namespace shardps::bench
