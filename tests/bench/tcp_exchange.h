// The raw TCP baseline of shardps-bench train --emulate_hosts: a synchronous
// parameter-server step with nothing but sockets, on the same emulated hosts
// and with the bytes and chunks the row's workers moved. Each worker sends
// each server its chunks of a step; a server, once every worker's copy of a
// chunk is in, sends that chunk's reply to every worker; a worker starts its
// next step once every reply of the last is in. No gRPC, no serialization,
// no optimizer, no compute: what the links and this machine's cores allow
// for the exchange alone.
#ifndef SHARDPS_TESTS_BENCH_TCP_EXCHANGE_H_
#define SHARDPS_TESTS_BENCH_TCP_EXCHANGE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "deploy/local/link_shaping.h"
#include "tests/bench/bench_util.h"

namespace shardps::bench {

struct TcpExchange {
  int workers = 2;
  int servers = 2;
  int64_t push_bytes = 1;   // what a worker sends each server a step
  int64_t reply_bytes = 1;  // what a server sends each worker a step
  int chunks = 1;           // each server's: a message each way a step
  int steps = 100;
  int warmup = 10;  // steps left out of the mean
};

// "W,S,PUSH,REPLY,CHUNKS,STEPS,WARMUP", as the hosts' command lines carry
// it, and back. InvalidArgument for another form or a value out of range.
std::string FormatTcpExchange(const TcpExchange& exchange);
absl::StatusOr<TcpExchange> ParseTcpExchange(const std::string& text);

// Plays rank `rank` of the exchange from this process's network namespace:
// ranks 0..W-1 are the workers, W..W+S-1 the servers, rank R on the emulated
// host at 10.213.0.(R+1) (servers listen on a fixed port there). Rank 0
// prints "tcp_exchange step_ms=X" (the mean step after the warm-up) as its
// last line. Unavailable when a connection fails.
absl::Status RunTcpExchangeHost(const TcpExchange& exchange, int rank);

struct TcpExchangeRun {
  absl::Duration step;             // rank 0's mean step after the warm-up
  double most_retransmitted = -1;  // % of a host's TCP segments, the most
  MachineLoad load;                // the machine's CPUs, over the whole run
  int steps = 0;                   // the exchange's, warm-up included
};

// Makes W+S emulated hosts with links of `rate` bits/s each way, runs
// `self_binary tcp_exchange_host` on each and returns what rank 0 measured.
absl::StatusOr<TcpExchangeRun> RunTcpExchangeOnHosts(
    const std::string& self_binary, int64_t rate, const TcpExchange& exchange,
    const local::NetworkTools& tools);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TCP_EXCHANGE_H_
