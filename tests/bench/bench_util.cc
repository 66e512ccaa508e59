#include "tests/bench/bench_util.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace shardps::bench {

absl::Duration Median(std::vector<absl::Duration> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

// A "Field:   N kB" line of /proc/<pid>/status, in bytes (-1: none).
int64_t StatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) {
      return std::stoll(line.substr(field.size())) * 1024;
    }
  }
  return -1;
}

}  // namespace

int64_t PeakRss(pid_t pid) { return StatusBytes(pid, "VmHWM:"); }

int64_t SharedRss(pid_t pid) { return StatusBytes(pid, "RssShmem:"); }

MachineLoad MachineLoad::Now() {
  MachineLoad load;
  std::ifstream stat("/proc/stat");
  std::string name;
  while (stat >> name) {
    if (name == "cpu") {
      // cpu user nice system idle iowait irq softirq steal ...
      int64_t v[8] = {};
      for (int64_t& x : v) {
        if (!(stat >> x)) return load;
      }
      load.busy_s = static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6]) /
                    sysconf(_SC_CLK_TCK);
    } else if (name == "ctxt") {
      if (!(stat >> load.context_switches)) load.context_switches = -1;
    }
    stat.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return load;
}

MachineLoad MachineLoad::Since(const MachineLoad& before) const {
  MachineLoad d;
  if (busy_s >= 0 && before.busy_s >= 0) d.busy_s = busy_s - before.busy_s;
  if (context_switches >= 0 && before.context_switches >= 0) {
    d.context_switches = context_switches - before.context_switches;
  }
  return d;
}

absl::StatusOr<absl::Duration> Parallel(
    uint32_t workers, const std::function<absl::Status(uint32_t)>& fn) {
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  threads.reserve(workers);
  const absl::Time start = absl::Now();
  for (uint32_t r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] { status[r] = fn(r); });
  }
  for (std::thread& t : threads) t.join();
  const absl::Duration d = absl::Now() - start;
  for (const absl::Status& s : status) SHARDPS_RETURN_IF_ERROR(s);
  return d;
}

BenchModel OneTensorModel(int64_t elements, int64_t chunk_bytes) {
  BenchModel m;
  m.layout.set_chunk_bytes(chunk_bytes);
  v1::TensorSpec* t = m.layout.add_tensors();
  t->set_name("w");
  t->add_shape(elements);
  m.optimizer.set_kind(v1::OptimizerSpec::KIND_SGD);
  m.optimizer.set_learning_rate(1e-6f);
  return m;
}

}  // namespace shardps::bench
