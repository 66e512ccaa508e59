// shardps-bench torch --emulate_hosts: the GPT example of
// worker/python/examples, and a wide GPT whose gradients dwarf its compute,
// with every process on an emulated host of its own (shardps-local
// --emulate_hosts -- python3 gpt_kjv.py) against PyTorch DDP (gloo, ring
// all-reduce) with one rank per emulated host of the same link; same model,
// data, global batch, optimizer and steps. Rows as train --emulate_hosts.
#ifndef SHARDPS_TESTS_BENCH_TORCH_HOSTS_BENCH_H_
#define SHARDPS_TESTS_BENCH_TORCH_HOSTS_BENCH_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/bench/train_hosts_bench.h"

namespace shardps::bench {

struct TorchHostsOptions {
  std::string local_binary;  // shardps-local
  std::string source_dir;    // the repository: the example and ddp_bench.py
  std::string python_path;   // the built shardps package (both sides use it)
  std::string link;          // as tc writes it: "1gbit"
  std::vector<TrainHostsRow> rows;
  int gpt_steps = 60;   // the example's GPT (0: skipped)
  int wide_steps = 20;  // the wide GPT (0: skipped)
  // Names of the workloads to run (empty: all).
  std::vector<std::string> workloads;
};

// Checks the build, root, ip and tc, python3-torch and shardps-local, then
// runs each workload's rows (shardps, then DDP once per workers and
// encoding) and prints each row and a table. FailedPrecondition before any
// row for what is missing; Internal, with the output, when a run fails.
absl::Status RunTorchHostsBench(const TorchHostsOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TORCH_HOSTS_BENCH_H_
