// The GPU benchmark of shardps-bench: samples/s of the CUDA backend's
// training step for the main-job MLP, against a cuBLAS-only GEMM roofline and
// the CPU backend measured in the same run. Skips, saying why, without a GPU.
#ifndef SHARDPS_TESTS_BENCH_GPU_BENCH_H_
#define SHARDPS_TESTS_BENCH_GPU_BENCH_H_

#include "absl/status/status.h"

namespace shardps::bench {

absl::Status RunGpuBench();

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_GPU_BENCH_H_
