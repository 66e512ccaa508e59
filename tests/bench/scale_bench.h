// The scale benchmark of shardps-bench: sync PushPull steps of a coordinated
// job (a real shardps-coordinator and shardps-server processes) as the
// workers grow from 1 to 64, per shard count and model size, with what each
// shard and the coordinator spend. Shows where a step costs more than
// workers x bytes per shard.
#ifndef SHARDPS_TESTS_BENCH_SCALE_BENCH_H_
#define SHARDPS_TESTS_BENCH_SCALE_BENCH_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardps::bench {

struct ScaleOptions {
  std::string server_binary;
  // More flags for every shardps-server (e.g. --max_inflight_mib=64).
  std::vector<std::string> server_flags;
  std::string coordinator_binary;
  // This program, run again as `scale_members` for the memberships.
  std::string self_binary;
  std::vector<uint32_t> workers = {1, 2, 4, 8, 16, 32, 64};
  std::vector<uint32_t> shards = {1, 2, 4};
  std::vector<int64_t> model_bytes = {int64_t{2} << 20, int64_t{64} << 20};
  // A model is one fp32 tensor in chunks_per_model chunks (so that every
  // shard count divides it evenly), each at most max_chunk_bytes.
  int chunks_per_model = 16;
  int64_t max_chunk_bytes = int64_t{4} << 20;
  int streams_per_shard = 2;
  // Off by default: a job of many workers spans machines, and regions of
  // every worker mapped into one shard would count in its RSS.
  bool shared_memory = false;
  int update_threads = 2;
  // Measured steps of a row: `steps`, fewer for big rows (at most
  // row_bytes of gradients, workers x model bytes a step, but never fewer
  // than min_steps), more for fast ones (until min_row_time has passed, at
  // most max_steps). The table says how many each row ran.
  int steps = 10;
  int min_steps = 3;
  int max_steps = 400;
  int warmup_steps = 1;
  int64_t row_bytes = int64_t{2} << 30;
  double min_row_seconds = 1.0;
  // The coordinator's --heartbeat_timeout_ms (workers beat every third).
  int64_t heartbeat_timeout_ms = 5000;
};

// Runs every (model, shards, workers) row on fresh processes and prints one
// table per model size. Errors of starting the daemons, joining or a step.
absl::Status RunScaleBench(const ScaleOptions& options);

// The workers' memberships of a scale row (shardps-bench scale_members,
// started by RunScaleBench): joins ranks [0, workers) of the job at
// `coordinator`, rank r with incarnation `incarnation` + r, each with its
// own CoordinatorClient (heartbeats and watch), waits until the job can
// take them all, calls `ready`, then keeps them alive until killed.
// Returns only on errors (those of joining).
absl::Status ServeScaleMembers(const std::string& coordinator, uint32_t workers,
                               uint64_t incarnation,
                               const std::function<absl::Status()>& ready);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_SCALE_BENCH_H_
