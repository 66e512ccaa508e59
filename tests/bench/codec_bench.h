// The codec benchmark of shardps-bench: encode and decode throughput of each
// gradient codec (common/codec.h) over one chunk of normal-ish gradients,
// against a memcpy of the same chunk in the same run.
#ifndef SHARDPS_TESTS_BENCH_CODEC_BENCH_H_
#define SHARDPS_TESTS_BENCH_CODEC_BENCH_H_

#include <cstdint>

#include "absl/status/status.h"

namespace shardps::bench {

struct CodecOptions {
  int64_t bytes = int64_t{4} << 20;  // fp32 bytes of the chunk
  int repeats = 15;                  // the median counts
  double topk_ratio = 0.01;
};

absl::Status RunCodecBench(const CodecOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_CODEC_BENCH_H_
