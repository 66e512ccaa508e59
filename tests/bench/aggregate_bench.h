// The aggregation benchmark of shardps-bench: the server's rank-ordered
// reduce plus optimizer update, against a plain `w += g` loop over the same
// memory in the same run.
#ifndef SHARDPS_TESTS_BENCH_AGGREGATE_BENCH_H_
#define SHARDPS_TESTS_BENCH_AGGREGATE_BENCH_H_

#include <cstdint>

#include "absl/status/status.h"

namespace shardps::bench {

struct AggregateOptions {
  int64_t bytes = int64_t{64} << 20;  // per contribution
  int repeats = 5;
};

absl::Status RunAggregateBench(const AggregateOptions& options);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_AGGREGATE_BENCH_H_
