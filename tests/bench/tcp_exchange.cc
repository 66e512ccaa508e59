// Threads: a worker runs a sender and a receiver per server; a server a
// reader and a writer per worker. Blocking sockets with TCP_NODELAY (as
// gRPC sets it), each chunk written whole.
#include "tests/bench/tcp_exchange.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/emulated_ddp.h"
#include "tests/bench/raw_tcp.h"

namespace shardps::bench {
namespace {

constexpr int kPort = 29600;
constexpr char kSubnet[] = "10.213.0.";
constexpr absl::Duration kConnectTimeout = absl::Seconds(60);

std::string HostAddress(int rank) { return absl::StrCat(kSubnet, rank + 1); }

// Chunk k's share of `total` bytes in `parts` near-equal pieces.
int64_t PieceBytes(int64_t total, int parts, int k) {
  return total / parts + (k < total % parts ? 1 : 0);
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno)));
}

absl::StatusOr<sockaddr_in> Address(const std::string& ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad address ", ip));
  }
  return a;
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A connection failed: the exchange cannot go on, and its other threads
// would wait for it forever. Exits the process; its peers' reads then fail
// too, and the bench reports rank 0's log.
[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tcp_exchange: %s: the peer closed, or %s\n",
               what.c_str(), strerror(errno));
  std::fflush(stderr);
  _exit(1);
}

// Reads a step's `chunks` pieces of `total` bytes from `fd`, calling
// read(k) after piece k.
template <typename Read>
void ReadStep(int fd, int64_t total, int chunks, std::vector<char>& buf,
              const char* what, const Read& read) {
  for (int k = 0; k < chunks; ++k) {
    if (!ReadAll(fd, buf.data(), PieceBytes(total, chunks, k))) Die(what);
    read(k);
  }
}

absl::Status Serve(const TcpExchange& x, int rank) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return Errno("socket");
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  SHARDPS_ASSIGN_OR_RETURN(const sockaddr_in at,
                           Address(HostAddress(rank), kPort));
  if (bind(listener, reinterpret_cast<const sockaddr*>(&at), sizeof(at)) != 0 ||
      listen(listener, x.workers) != 0) {
    return Errno(absl::StrCat("listening on ", HostAddress(rank)));
  }
  std::vector<int> fds;
  for (int w = 0; w < x.workers; ++w) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return Errno("accept");
    NoDelay(fd);
    fds.push_back(fd);
  }
  close(listener);
  absl::Mutex mu;
  // copies[step * chunks + k]: the workers' copies of chunk k in.
  std::vector<int> copies(static_cast<size_t>(x.steps) * x.chunks, 0);
  std::vector<std::deque<int>> outboxes(fds.size());
  std::vector<std::thread> threads;
  for (size_t c = 0; c < fds.size(); ++c) {
    threads.emplace_back([&, c] {
      std::vector<char> buf(PieceBytes(x.push_bytes, x.chunks, 0));
      for (int step = 0; step < x.steps; ++step) {
        ReadStep(fds[c], x.push_bytes, x.chunks, buf, "reading a push",
                 [&](int k) {
                   absl::MutexLock lock(&mu);
                   if (++copies[static_cast<size_t>(step) * x.chunks + k] ==
                       x.workers) {
                     for (std::deque<int>& box : outboxes) box.push_back(k);
                   }
                 });
      }
    });
    threads.emplace_back([&, c] {
      const std::vector<char> reply(PieceBytes(x.reply_bytes, x.chunks, 0));
      for (int64_t n = 0; n < int64_t{x.steps} * x.chunks; ++n) {
        int k = 0;
        {
          absl::MutexLock lock(&mu);
          mu.Await(absl::Condition(
              +[](std::deque<int>* box) { return !box->empty(); },
              &outboxes[c]));
          k = outboxes[c].front();
          outboxes[c].pop_front();
        }
        if (!WriteAll(fds[c], reply.data(),
                      PieceBytes(x.reply_bytes, x.chunks, k))) {
          Die("writing a reply");
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : fds) close(fd);
  return absl::OkStatus();
}

// A counter and the value it waits for.
bool Reached(const std::pair<const int*, int>* p) {
  return *p->first >= p->second;
}

absl::StatusOr<int> Connect(int server_rank) {
  SHARDPS_ASSIGN_OR_RETURN(const sockaddr_in at,
                           Address(HostAddress(server_rank), kPort));
  const absl::Time deadline = absl::Now() + kConnectTimeout;
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("socket");
    if (connect(fd, reinterpret_cast<const sockaddr*>(&at), sizeof(at)) == 0) {
      NoDelay(fd);
      return fd;
    }
    close(fd);
    if (absl::Now() > deadline) {
      return Errno(absl::StrCat("connecting to ", HostAddress(server_rank)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::Status Work(const TcpExchange& x, int rank) {
  std::vector<int> fds;
  for (int s = 0; s < x.servers; ++s) {
    SHARDPS_ASSIGN_OR_RETURN(const int fd, Connect(x.workers + s));
    fds.push_back(fd);
  }
  absl::Mutex mu;
  int started = -1;                      // the step the senders may send
  std::vector<int> replied(x.steps, 0);  // servers whose replies are all in
  std::vector<std::thread> threads;
  for (size_t c = 0; c < fds.size(); ++c) {
    threads.emplace_back([&, c] {
      const std::vector<char> push(PieceBytes(x.push_bytes, x.chunks, 0));
      for (int step = 0; step < x.steps; ++step) {
        {
          absl::MutexLock lock(&mu);
          const std::pair<const int*, int> wait(&started, step);
          mu.Await(absl::Condition(&Reached, &wait));
        }
        for (int k = 0; k < x.chunks; ++k) {
          if (!WriteAll(fds[c], push.data(),
                        PieceBytes(x.push_bytes, x.chunks, k))) {
            Die("writing a push");
          }
        }
      }
    });
    threads.emplace_back([&, c] {
      std::vector<char> buf(PieceBytes(x.reply_bytes, x.chunks, 0));
      for (int step = 0; step < x.steps; ++step) {
        ReadStep(fds[c], x.reply_bytes, x.chunks, buf, "reading a reply",
                 [](int) {});
        absl::MutexLock lock(&mu);
        ++replied[step];
      }
    });
  }
  std::vector<absl::Time> ends;
  for (int step = 0; step < x.steps; ++step) {
    absl::MutexLock lock(&mu);
    started = step;
    const std::pair<const int*, int> wait(&replied[step], x.servers);
    mu.Await(absl::Condition(&Reached, &wait));
    ends.push_back(absl::Now());
  }
  for (std::thread& t : threads) t.join();
  for (int fd : fds) close(fd);
  if (rank == 0) {
    const int measured = x.steps - 1 - x.warmup;
    absl::PrintF(
        "tcp_exchange step_ms=%.3f steps=%d\n",
        absl::ToDoubleMilliseconds(ends.back() - ends[x.warmup]) / measured,
        measured);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatTcpExchange(const TcpExchange& x) {
  return absl::StrCat(x.workers, ",", x.servers, ",", x.push_bytes, ",",
                      x.reply_bytes, ",", x.chunks, ",", x.steps, ",",
                      x.warmup);
}

absl::StatusOr<TcpExchange> ParseTcpExchange(const std::string& text) {
  const std::vector<std::string> f = absl::StrSplit(text, ',');
  TcpExchange x;
  if (f.size() != 7 || !absl::SimpleAtoi(f[0], &x.workers) ||
      !absl::SimpleAtoi(f[1], &x.servers) ||
      !absl::SimpleAtoi(f[2], &x.push_bytes) ||
      !absl::SimpleAtoi(f[3], &x.reply_bytes) ||
      !absl::SimpleAtoi(f[4], &x.chunks) || !absl::SimpleAtoi(f[5], &x.steps) ||
      !absl::SimpleAtoi(f[6], &x.warmup) || x.workers < 1 || x.servers < 1 ||
      x.chunks < 1 || x.push_bytes < x.chunks || x.reply_bytes < x.chunks ||
      x.warmup < 0 || x.steps < x.warmup + 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", text,
        "\" is not WORKERS,SERVERS,PUSH_BYTES,REPLY_BYTES,CHUNKS,STEPS,WARMUP "
        "(at least one worker, server and chunk, a byte a chunk each way, "
        "and two steps after the warm-up)"));
  }
  return x;
}

absl::Status RunTcpExchangeHost(const TcpExchange& exchange, int rank) {
  if (rank < 0 || rank >= exchange.workers + exchange.servers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not in [0, ",
                     exchange.workers + exchange.servers, ")"));
  }
  return rank < exchange.workers ? Work(exchange, rank) : Serve(exchange, rank);
}

absl::StatusOr<TcpExchangeRun> RunTcpExchangeOnHosts(
    const std::string& self_binary, int64_t rate, const TcpExchange& exchange,
    const local::NetworkTools& tools) {
  const std::string spec = FormatTcpExchange(exchange);
  const MachineLoad before = MachineLoad::Now();
  SHARDPS_ASSIGN_OR_RETURN(
      RanksRun run,
      RunRanksOnHosts(
          self_binary, rate, exchange.workers + exchange.servers, tools,
          [&](int rank, const std::string&) {
            return std::vector<std::string>{
                "tcp_exchange_host", absl::StrCat("--exchange=", spec),
                absl::StrCat("--exchange_rank=", rank)};
          },
          absl::Minutes(10)));
  double ms = 0;
  const size_t at = run.result.find("step_ms=");
  if (at == std::string::npos ||
      !absl::SimpleAtod(
          run.result.substr(at + 8, run.result.find(' ', at) - at - 8), &ms)) {
    return absl::InternalError(
        absl::StrCat("no step time from the raw TCP exchange's rank 0 in ",
                     run.log0, ": ", run.result));
  }
  TcpExchangeRun out;
  out.step = absl::Milliseconds(ms);
  out.load = MachineLoad::Now().Since(before);
  out.steps = exchange.steps;
  for (const HostBytes& b : run.bytes) {
    out.most_retransmitted =
        std::max(out.most_retransmitted, b.retransmitted_percent);
  }
  return out;
}

}  // namespace shardps::bench
