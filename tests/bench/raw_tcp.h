// The raw TCP baseline of the transport benchmark: the same bytes in the same
// pattern as a shardps step (one connection per stream, 1 MiB writes, the
// reply sent after the whole request was read), with nothing but sockets.
#ifndef SHARDPS_TESTS_BENCH_RAW_TCP_H_
#define SHARDPS_TESTS_BENCH_RAW_TCP_H_

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardps::bench {

// Reads and writes of the raw baselines: 1 MiB at a time.
inline constexpr int64_t kIoBytes = 1 << 20;
// Writes (reads) exactly n bytes; false when the connection fails first.
bool WriteAll(int fd, const char* p, int64_t n);
bool ReadAll(int fd, char* p, int64_t n);

// One connection's share of a step.
struct RawExchange {
  int64_t request_bytes = 0;
  int64_t reply_bytes = 0;
};

// An echo-style server on 127.0.0.1 that answers each request with
// reply_bytes, and a set of client connections to it.
class RawTcpBench {
 public:
  // Opens one connection per element of `pattern`.
  static absl::StatusOr<std::unique_ptr<RawTcpBench>> Create(
      std::vector<RawExchange> pattern);
  ~RawTcpBench();

  // Runs one step on every connection in parallel; returns its wall time.
  absl::StatusOr<absl::Duration> Step();

 private:
  RawTcpBench() = default;
  void Serve(int fd);

  std::vector<RawExchange> pattern_;
  int listen_fd_ = -1;
  std::vector<int> client_fds_;
  std::vector<int> server_fds_;
  std::vector<std::unique_ptr<std::thread>> server_threads_;
};

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_RAW_TCP_H_
