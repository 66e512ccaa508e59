// The transport benchmark of shardps-bench: PushPull, Push and Pull of a model
// through real server processes, each as a ratio to raw TCP in the same run.
#ifndef SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_
#define SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardps::bench {

struct TransportOptions {
  std::string server_binary;
  int64_t model_bytes = int64_t{64} << 20;
  int64_t chunk_bytes = int64_t{4} << 20;
  int streams_per_shard = 2;
  int update_threads = 2;
  int steps = 10;
  int warmup_steps = 2;
  // Off only for profiling shardps alone.
  bool raw_baseline = true;
  std::vector<uint32_t> shards = {1, 2};
  std::vector<uint32_t> workers = {1, 2};
};

absl::Status RunTransportBench(const TransportOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_
