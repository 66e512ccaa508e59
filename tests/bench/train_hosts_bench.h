// shardps-bench train --emulate_hosts: the main job with every process on an
// emulated host (shardps-local --emulate_hosts) against PyTorch DDP (gloo,
// ring all-reduce) with one rank per emulated host of the same link, per
// row of workers, servers and compression. Runs from one thread; needs an
// optimized build, root, iproute2 and python3-torch, and refuses to start
// without them.
#ifndef SHARDPS_TESTS_BENCH_TRAIN_HOSTS_BENCH_H_
#define SHARDPS_TESTS_BENCH_TRAIN_HOSTS_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "deploy/local/link_shaping.h"

namespace shardps::bench {

// One configuration: shardps with `workers` workers and `servers` servers,
// DDP with `workers` ranks; `compression` fp32, bf16 both ways (shardps
// --compression=bf16 --weight_encoding=bf16; DDP's gradients as fp16, the
// same 2 bytes an element, as gloo has no bfloat16), or topk (shardps
// --compression=topk:0.01 with error feedback, --weight_encoding=bf16; DDP
// fp32, as DDP has no top-k).
struct TrainHostsRow {
  int workers = 2;
  int servers = 2;
  std::string compression = "fp32";
};

// How a row's sides encode: shardps's gradients and weights, as
// --compression and --weight_encoding spell them (empty for fp32: the
// defaults), and DDP's all-reduce (fp32, or fp16 for a row whose shardps
// side sends 2 bytes an element: gloo has no bfloat16; DDP has no top-k).
struct RowEncodings {
  std::string gradients;
  std::string weights;
  std::string ddp = "fp32";
};
RowEncodings EncodingsOf(const TrainHostsRow& row);

// "2x2,4x4,4x1" (WORKERSxSERVERS) times "fp32,bf16,topk": every pair, in that
// order. InvalidArgument naming the part that is not one; fewer than 2
// workers has no all-reduce to compare with.
absl::StatusOr<std::vector<TrainHostsRow>> ParseTrainHostsRows(
    const std::string& rows, const std::string& compressions);

// The link-bound time of shardps over DDP's from the bytes over the busiest
// network card per step, model M: a worker's card carries M each way, a
// server's W×M/S, a ring all-reduce rank's 2(W−1)/W × M:
// max(1, W/S) / (2(W−1)/W). REQUIRES: workers >= 2, servers >= 1.
double IdealTimeRatio(int workers, int servers);

struct TrainHostsOptions {
  std::string local_binary;  // shardps-local
  std::string torch_script;  // tests/bench/torch/mlp_ddp.py
  std::string self_binary;   // shardps-bench, for the raw TCP exchange
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int epochs = 2;
  std::string link;       // as tc writes it: "1gbit"
  int64_t chunk_kib = 0;  // shardps's --chunk_kib; 0: the workers' automatic
  std::vector<TrainHostsRow> rows;
};

// Checks the build, root, ip and tc, python3-torch and the binaries, then
// runs each row (shardps first, then the raw TCP exchange of its bytes and
// chunks, tcp_exchange.h, then DDP) and prints its figures and a table at
// the end. FailedPrecondition before any row for what is missing;
// Internal, with the output, when a run fails.
absl::Status RunTrainHostsBench(const TrainHostsOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TRAIN_HOSTS_BENCH_H_
