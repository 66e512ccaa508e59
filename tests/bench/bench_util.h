// Helpers the benchmarks of shardps-bench share: medians, a process's peak
// memory, and running one function per worker thread.
#ifndef SHARDPS_TESTS_BENCH_BENCH_UTIL_H_
#define SHARDPS_TESTS_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::bench {

// The median (the upper one of an even count); v must not be empty.
absl::Duration Median(std::vector<absl::Duration> v);

// Peak resident set of a process, in bytes (VmHWM); -1 if unreadable.
int64_t PeakRss(pid_t pid);
// Its resident shared-memory pages now (RssShmem): for a shard, the pages
// of workers' regions it touched, which are the workers' memory.
int64_t SharedRss(pid_t pid);

// What the machine's CPUs have done since boot (/proc/stat). The difference
// over a run counts every process of it and the kernel's packet processing,
// which no process is charged for.
struct MachineLoad {
  // Seconds busy, summed over the CPUs: user, nice, system, irq and
  // softirq; not idle, iowait or steal. -1 if unreadable.
  double busy_s = -1;
  // Context switches: each time a CPU switched threads, which a virtual
  // machine can make expensive. -1 if unreadable.
  int64_t context_switches = -1;

  static MachineLoad Now();
  // This load minus an earlier one (-1 where either is unreadable).
  MachineLoad Since(const MachineLoad& before) const;
};

// Runs fn(rank) for rank in [0, workers) on one thread each and returns
// the wall time, or the first error.
absl::StatusOr<absl::Duration> Parallel(
    uint32_t workers, const std::function<absl::Status(uint32_t)>& fn);

// The benchmarks' model: one fp32 tensor "w" of `elements` in chunks of
// `chunk_bytes`, and plain SGD with a tiny learning rate (the weights stay
// finite however many steps run).
struct BenchModel {
  v1::Layout layout;
  v1::OptimizerSpec optimizer;
};
BenchModel OneTensorModel(int64_t elements, int64_t chunk_bytes);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_BENCH_UTIL_H_
