// What the emulated-host benchmarks of shardps-bench share (train and torch
// --emulate_hosts): the bytes each host's link carried, as shardps-local
// prints them or as the switch counts them, and a job with one rank per
// emulated host (PyTorch DDP; the raw TCP exchange).
#ifndef SHARDPS_TESTS_BENCH_EMULATED_DDP_H_
#define SHARDPS_TESTS_BENCH_EMULATED_DDP_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "deploy/local/link_shaping.h"

namespace shardps::bench {

struct HostBytes {
  std::string name;
  int64_t sent = 0;
  int64_t received = 0;
  double retransmitted_percent = -1;  // of its TCP segments; -1: unknown
};

// The per-host lines after "bytes over each host's link" in shardps-local's
// output ("  worker-0 10.213.0.4   sent   1.6 MiB  received   1.7 MiB  TCP
// retransmitted 0.42 %").
std::vector<HostBytes> ParseLinkBytes(const std::string& out);

// The busiest card: its larger direction, in bytes, and its name.
int64_t BusiestBytes(const std::vector<HostBytes>& bytes, std::string* name);

// "worker-0 0.96 GiB / 0.96 GiB (TCP retransmitted 0.42 %), ...": each
// host's sent / received.
std::string HostBytesText(const std::vector<HostBytes>& bytes);

// Column `name` of the CSV file at `path` (a header line, then rows), as
// numbers, of the rows whose column `kind` is `kind_value` (every row when
// `kind` is empty); a cell that is not a number is left out. Internal when
// the file has no header or no such column.
absl::StatusOr<std::vector<double>> CsvColumn(
    const std::string& path, const std::string& name,
    const std::string& kind = "", const std::string& kind_value = "");

// What a benchmark `what` on emulated hosts needs: an optimized build, root
// with ip and tc, `local_binary` (shardps-local) and python3-torch; the
// network tools, or FailedPrecondition saying what is missing.
absl::StatusOr<local::NetworkTools> CheckEmulatedBench(
    const std::string& what, const std::string& local_binary);

// A job on emulated hosts, as RunRanksOnHosts ran it.
struct RanksRun {
  std::vector<HostBytes> bytes;  // each rank's host, as the switch counted
  std::string result;            // the last line of rank 0's log
  std::string log0;              // rank 0's log
};

// Makes one emulated host per rank ("rank-R" at 10.213.0.(R+1), each with a
// link of `rate` bits/s each way), starts `program` (a DDP job:
// /usr/bin/python3) with argv(R, master) in rank R's namespace (master:
// "10.213.0.1:PORT", where rank 0 listens), in this process's environment
// plus `extra_env` ("NAME=value"), its output to DIR/rank-R.log, and waits
// for all of them. The first rank that fails, or `timeout`, has the others
// killed: Internal with the end of its log. The hosts are removed on return.
absl::StatusOr<RanksRun> RunRanksOnHosts(
    const std::string& program, int64_t rate, int ranks,
    const local::NetworkTools& tools,
    const std::function<
        std::vector<std::string>(int rank, const std::string& master)>& argv,
    absl::Duration timeout, const std::vector<std::string>& extra_env = {});

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_EMULATED_DDP_H_
