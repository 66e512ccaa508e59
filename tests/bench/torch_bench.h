// The torch benchmark of shardps-bench: the CNN and the GPT examples of
// worker/python/examples on 2 servers + 2 workers against PyTorch DDP (gloo,
// 2 processes x 1 thread) with the same model, data and global batch.
#ifndef SHARDPS_TESTS_BENCH_TORCH_BENCH_H_
#define SHARDPS_TESTS_BENCH_TORCH_BENCH_H_

#include <string>

#include "absl/status/status.h"

namespace shardps::bench {

struct TorchOptions {
  std::string local_binary;  // shardps-local
  std::string source_dir;    // the repository: examples and the DDP script
  std::string python = "/usr/bin/python3";  // Debian's, the one with torch
  // The built shardps package (<build>/worker/python), which the DDP side
  // uses for the same data order.
  std::string python_path;
  int cnn_steps = 200;
  int gpt_steps = 60;
  // Runs of each side (DDP, shardps, DDP, ...); the fastest of each counts.
  int rounds = 2;
  // > 0: shardps also runs each example with --max_grad_norm at this bound
  // and at 0 (off), alternating, and what clipping costs is printed.
  double clip_grad_norm = 0;
};

// Ok when both sides of every model ran; when the shardps side fails the DDP
// figures are still printed, then Internal names the failed runs.
absl::Status RunTorchBench(const TorchOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TORCH_BENCH_H_
