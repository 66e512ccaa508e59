// The training benchmark of shardps-bench: the main job on the local cluster
// against PyTorch DDP (when installed) in the same run.
#ifndef SHARDPS_TESTS_BENCH_TRAIN_BENCH_H_
#define SHARDPS_TESTS_BENCH_TRAIN_BENCH_H_

#include <string>

#include "absl/status/status.h"

namespace shardps::bench {

struct TrainOptions {
  std::string local_binary;  // shardps-local
  std::string torch_script;  // tests/bench/torch/mlp_ddp.py
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int epochs = 10;
  // > 0: the cluster also runs with --clip_grad_norm at this bound
  // (two-phase steps), alternating with runs without, and the cost of
  // clipping is printed.
  double clip_grad_norm = 0;
};

absl::Status RunTrainBench(const TrainOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TRAIN_BENCH_H_
