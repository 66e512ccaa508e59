// shardps-bench scale: a coordinated sync job on 127.0.0.1 (one
// shardps-coordinator, S shardps-server processes) and W workers. Each
// worker rank joins through the coordinator with its own membership and
// incarnation, as shardps-worker and the Python session do, and pushes
// through its own Client (its own connections). The W memberships live in
// one helper process (scale_members) and the W Clients are threads of this
// one: 64 worker processes on a 2-core machine would measure the
// scheduler, and within one process 64 workers' bulk transfers hold up
// gRPC's polling of the coordinator's channel for seconds (heartbeats
// took 2-6 s, and members expired), which no real worker, one rank to a
// process, sees. The shards and the coordinator cannot tell the
// difference: every rank has its own membership, incarnation and streams.
#include "tests/bench/scale_bench.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "coordinator/client/coordinator_client.h"
#include "coordinator/client/join_job.h"
#include "tests/bench/bench_util.h"
#include "tests/testing/daemon.h"
#include "worker/client.h"
#include "worker/worker_job.h"

namespace shardps::bench {
namespace {

using ::shardps::testing::Daemon;

constexpr char kJobId[] = "scale";

// CPU time (user + system, every thread, the dead ones included) of a
// process, from /proc/PID/stat: clock ticks, 10 ms each.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  // The command name, in parentheses, may hold spaces: fields count from
  // after its closing one (state is field 3, utime 14, stime 15).
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return -1;
  std::vector<std::string> fields =
      absl::StrSplit(text.substr(paren + 2), ' ', absl::SkipEmpty());
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// CPU time of a process's live threads, from each one's
// /proc/PID/task/TID/schedstat (nanoseconds): finer than ticks, for a
// coordinator that spends a few milliseconds a second, but blind to threads
// that end between two readings (CpuBetween takes the ticks when those add
// up to more).
double ThreadCpuSeconds(pid_t pid) {
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  DIR* dir = opendir(tasks.c_str());
  if (dir == nullptr) return -1;
  int64_t ns = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(absl::StrCat(tasks, "/", e->d_name, "/schedstat"));
    int64_t run = 0;
    if (in >> run) ns += run;
  }
  closedir(dir);
  return ns * 1e-9;
}

// A process's CPU time at one moment, both ways.
struct CpuReading {
  double ticks = 0;
  double threads = 0;
};
CpuReading ReadCpu(pid_t pid) {
  return {CpuSeconds(pid), ThreadCpuSeconds(pid)};
}
double CpuBetween(const CpuReading& before, const CpuReading& after) {
  const double ticks = after.ticks - before.ticks;
  const double threads = after.threads - before.threads;
  // Ticks count in whole 10 ms steps: they win only when more than one step
  // above the live threads' sum (threads that ended in between).
  return ticks > threads + 1.0 / sysconf(_SC_CLK_TCK) ? ticks : threads;
}

// The 1-minute load average.
double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

// This process's CPU time (the worker threads and their gRPC threads).
double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// ESTABLISHED TCP sockets whose local port is `port`: the shard's ends of
// its connections (everything here is one network namespace, so
// /proc/net/tcp shows both ends of each).
int EstablishedConnections(int port) {
  int count = 0;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // "  sl  local_address rem_address   st ..." with addresses as
      // HEXADDR:HEXPORT; state 01 is ESTABLISHED.
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 4 || f[3] != "01") continue;
      const size_t colon = f[1].rfind(':');
      int local = 0;
      if (colon != std::string::npos &&
          absl::SimpleHexAtoi(f[1].substr(colon + 1), &local) &&
          local == port) {
        ++count;
      }
    }
  }
  return count;
}

int64_t ChunkBytes(const ScaleOptions& o, int64_t model_bytes) {
  return std::min(o.max_chunk_bytes, model_bytes / o.chunks_per_model);
}

// One worker rank's connections to the shards (its membership is in the
// scale_members process).
struct Worker {
  std::unique_ptr<Client> client;
  std::vector<float> weights;
};

struct ScaleRow {
  int64_t model_bytes = 0;
  uint32_t shards = 0, workers = 0;
  int steps = 0;
  absl::Duration step;       // median
  absl::Duration join;       // first Join to every worker declared
  double shard_bytes_s = 0;  // in + out, mean of the shards
  int64_t peak_rss = 0;      // the largest shard's
  int64_t budget_peak = 0;   // the most a shard's receive budget held
  int connections_min = 0, connections_max = 0;
  double coordinator_cpu = 0;       // seconds a measured step
  double coordinator_cpu_rate = 0;  // seconds a second of them
  double coordinator_join_cpu = 0;  // seconds, the whole join
  double servers_cpu = 0;           // seconds a step, every shard
  double workers_cpu = 0;           // seconds a step, both processes
};

// Steps a row measures before min_row_seconds may add more.
int TargetSteps(const ScaleOptions& o, int64_t model_bytes, uint32_t workers) {
  const int64_t budget = o.row_bytes / (model_bytes * workers);
  return static_cast<int>(std::clamp<int64_t>(budget, o.min_steps, o.steps));
}

// Starts the coordinator and the shards of one row; logs go to `dir`.
absl::Status StartJob(const ScaleOptions& o, uint32_t shards, uint32_t workers,
                      const std::string& dir, const std::string& row,
                      std::unique_ptr<Daemon>* coordinator,
                      std::vector<std::unique_ptr<Daemon>>* servers) {
  SHARDPS_ASSIGN_OR_RETURN(
      *coordinator,
      Daemon::Start(
          absl::StrCat(row, "-coordinator"), o.coordinator_binary,
          {absl::StrCat("--job_id=", kJobId),
           absl::StrCat("--num_servers=", shards),
           absl::StrCat("--num_workers=", workers),
           absl::StrCat("--heartbeat_timeout_ms=", o.heartbeat_timeout_ms),
           "--exit_when_finished=false"},
          absl::Seconds(30), dir));
  for (uint32_t s = 0; s < shards; ++s) {
    std::vector<std::string> flags = {
        absl::StrCat("--coordinator=", (*coordinator)->address()),
        absl::StrCat("--job_id=", kJobId), absl::StrCat("--shard_index=", s),
        "--mode=sync", absl::StrCat("--update_threads=", o.update_threads)};
    flags.insert(flags.end(), o.server_flags.begin(), o.server_flags.end());
    SHARDPS_ASSIGN_OR_RETURN(
        std::unique_ptr<Daemon> d,
        Daemon::Start(absl::StrCat(row, "-server-", s), o.server_binary,
                      std::move(flags), absl::Seconds(30), dir));
    servers->push_back(std::move(d));
  }
  return absl::OkStatus();
}

// Joins rank `r` through the coordinator as a worker process does (its
// own membership and incarnation, waiting until the job can take it).
absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> JoinRank(
    const std::string& coordinator, uint32_t r, uint64_t incarnation) {
  coordinator::JoinOptions join;
  join.client.coordinator = coordinator;
  join.client.incarnation = incarnation;
  join.role = v1::ROLE_WORKER;
  join.address = absl::StrCat("scale-bench/", getpid(), "/", r);
  join.requested_index = static_cast<int32_t>(r);
  join.job_id = kJobId;
  join.timeout = absl::Seconds(60);
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::CoordinatorClient> c,
                           coordinator::JoinJob(join));
  SHARDPS_RETURN_IF_ERROR(
      c->WaitForView(worker::ReadyToJoin, absl::Now() + absl::Seconds(60))
          .status());
  return c;
}

// Connects rank `r` (incarnation as it joined) to the shards and declares
// the model, as a worker does once the job can take it.
absl::Status Declare(const ScaleOptions& o,
                     const std::vector<std::string>& servers, uint32_t r,
                     uint64_t incarnation, const v1::Layout& layout,
                     const v1::OptimizerSpec& optimizer, Worker* w) {
  ClientOptions co;
  co.servers = servers;
  co.rank = r;
  co.incarnation = incarnation;
  co.streams_per_shard = o.streams_per_shard;
  co.shared_memory = o.shared_memory;
  SHARDPS_ASSIGN_OR_RETURN(w->client, Client::Create(co));
  SHARDPS_RETURN_IF_ERROR(w->client->Declare(layout, optimizer));
  if (w->client->must_join()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", r,
                     " found the job already running; every row starts a "
                     "new one"));
  }
  return absl::OkStatus();
}

// Bytes in + out of every shard so far, by shard index, and the most any
// shard's receive budget held.
struct ShardCounters {
  std::vector<int64_t> bytes;
  int64_t budget_peak = 0;
};
absl::StatusOr<ShardCounters> ReadShards(Client& client) {
  SHARDPS_ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status,
                           client.ShardStatus());
  ShardCounters c;
  for (const v1::GetStatusResponse& s : status) {
    c.bytes.push_back(
        static_cast<int64_t>(s.bytes_in_total() + s.bytes_out_total()));
    c.budget_peak = std::max(
        c.budget_peak, static_cast<int64_t>(s.receive_budget_peak_bytes()));
  }
  return c;
}

absl::StatusOr<ScaleRow> RunRow(const ScaleOptions& o, int64_t model_bytes,
                                uint32_t shards, uint32_t workers,
                                const std::string& dir) {
  ScaleRow row;
  row.model_bytes = model_bytes;
  row.shards = shards;
  row.workers = workers;
  const std::string name =
      absl::StrCat("m", model_bytes >> 20, "-s", shards, "-w", workers);
  std::unique_ptr<Daemon> coordinator;
  std::vector<std::unique_ptr<Daemon>> servers;
  SHARDPS_RETURN_IF_ERROR(
      StartJob(o, shards, workers, dir, name, &coordinator, &servers));

  const int64_t elements = model_bytes / 4;
  const BenchModel model = OneTensorModel(elements, ChunkBytes(o, model_bytes));
  const v1::Layout& layout = model.layout;
  const v1::OptimizerSpec& opt = model.optimizer;
  // One gradient for every rank: the clients only read it, and a job of
  // 64 workers of a 64 MiB model then needs 4 GiB (their weights), not 8.
  const std::vector<float> gradient(elements, 1e-3f);

  std::vector<std::string> addresses;
  for (const auto& d : servers) addresses.push_back(d->address());
  std::vector<Worker> w(workers);
  const uint64_t incarnation = worker::ProcessIncarnation();
  const CpuReading join_cpu_before = ReadCpu(coordinator->pid());
  const absl::Time join_start = absl::Now();
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<Daemon> members,
      Daemon::Start(
          absl::StrCat(name, "-members"), o.self_binary,
          {"scale_members",
           absl::StrCat("--scale_coordinator=", coordinator->address()),
           absl::StrCat("--scale_workers=", workers),
           absl::StrCat("--scale_incarnation=", incarnation)},
          absl::Seconds(120), dir));
  SHARDPS_RETURN_IF_ERROR(Parallel(workers, [&](uint32_t r) {
                            w[r].weights.assign(elements, 0.0f);
                            return Declare(o, addresses, r, incarnation + r,
                                           layout, opt, &w[r]);
                          }).status());
  row.join = absl::Now() - join_start;
  row.coordinator_join_cpu =
      CpuBetween(join_cpu_before, ReadCpu(coordinator->pid()));

  int64_t step = w[0].client->start_step();
  auto one_step = [&](uint32_t r) {
    return w[r].client->PushPull(step, {gradient},
                                 {absl::MakeSpan(w[r].weights)});
  };
  for (int i = 0; i < o.warmup_steps; ++i, ++step) {
    SHARDPS_RETURN_IF_ERROR(Parallel(workers, one_step).status());
  }

  SHARDPS_ASSIGN_OR_RETURN(ShardCounters before, ReadShards(*w[0].client));
  std::vector<CpuReading> server_cpu_before;
  for (const auto& s : servers) server_cpu_before.push_back(ReadCpu(s->pid()));
  const CpuReading coordinator_cpu_before = ReadCpu(coordinator->pid());
  const double self_cpu_before = SelfCpuSeconds();
  const CpuReading members_cpu_before = ReadCpu(members->pid());
  const int target = TargetSteps(o, model_bytes, workers);
  std::vector<absl::Duration> times;
  absl::Duration elapsed;
  while (static_cast<int>(times.size()) < target ||
         (elapsed < absl::Seconds(o.min_row_seconds) &&
          static_cast<int>(times.size()) < o.max_steps)) {
    SHARDPS_ASSIGN_OR_RETURN(absl::Duration d, Parallel(workers, one_step));
    times.push_back(d);
    elapsed += d;
    ++step;
  }
  const double self_cpu =
      SelfCpuSeconds() - self_cpu_before +
      CpuBetween(members_cpu_before, ReadCpu(members->pid()));
  const double coordinator_cpu =
      CpuBetween(coordinator_cpu_before, ReadCpu(coordinator->pid()));
  double server_cpu = 0;
  for (size_t s = 0; s < servers.size(); ++s) {
    server_cpu += CpuBetween(server_cpu_before[s], ReadCpu(servers[s]->pid()));
  }
  SHARDPS_ASSIGN_OR_RETURN(ShardCounters after, ReadShards(*w[0].client));

  row.steps = static_cast<int>(times.size());
  row.step = Median(times);
  const double n = row.steps;
  row.coordinator_cpu = coordinator_cpu / n;
  row.coordinator_cpu_rate = coordinator_cpu / absl::ToDoubleSeconds(elapsed);
  row.servers_cpu = server_cpu / n;
  row.workers_cpu = self_cpu / n;
  double shard_bytes = 0;
  row.budget_peak = after.budget_peak;
  for (size_t s = 0; s < after.bytes.size(); ++s) {
    shard_bytes += after.bytes[s] - before.bytes[s];
  }
  row.shard_bytes_s = shard_bytes / shards / absl::ToDoubleSeconds(elapsed);
  row.connections_min = 1 << 30;
  for (const auto& s : servers) {
    row.peak_rss = std::max(row.peak_rss, PeakRss(s->pid()));
    const int c = EstablishedConnections(s->port());
    row.connections_min = std::min(row.connections_min, c);
    row.connections_max = std::max(row.connections_max, c);
  }
  // The clients go first (their streams end), then the memberships, the
  // shards and the coordinator.
  for (Worker& x : w) x.client.reset();
  members.reset();
  servers.clear();
  return row;
}

std::string Mib(int64_t bytes) {
  return bytes % (1 << 20) == 0 ? absl::StrCat(bytes >> 20, " MiB")
                                : absl::StrCat(bytes >> 10, " KiB");
}

void PrintHeader(const ScaleOptions& o, int64_t model) {
  absl::PrintF(
      "\n%s fp32 model (one tensor, %d chunks of %s), sync SGD, %d stream(s) "
      "per shard per worker\n",
      Mib(model), o.chunks_per_model, Mib(ChunkBytes(o, model)),
      o.streams_per_shard);
  constexpr char kColumns[] =
      "%-6s %-7s %5s %9s %7s %9s %8s %8s %9s %7s %6s %8s %7s %8s %6s %7s\n";
  absl::PrintF(kColumns, "shards", "workers", "steps", "step", "growth",
               "per shard", "server", "held", "conns", "coord", "coord",
               "servers", "servers", "workers", "join", "coord");
  absl::PrintF(kColumns, "", "", "", "ms", "", "MB/s", "RSS MiB", "MiB",
               "per shard", "CPU ms", "CPU", "CPU ms", "CPU", "CPU ms", "s",
               "join");
  absl::PrintF(kColumns, "", "", "", "", "", "", "", "", "", "a step", "ms/s",
               "a step", "growth", "a step", "", "CPU ms");
  std::fflush(stdout);
}

// `base`: the first row of the same shard count (the fewest workers).
void PrintRow(const ScaleRow& r, const ScaleRow& base) {
  // Step time over (workers x model bytes / shards), against the base row:
  // 1.00 is linear in workers.
  const double growth =
      absl::FDivDuration(r.step, base.step) * base.workers / r.workers;
  // The same for the shards' CPU time a step, which other load on the
  // machine disturbs less than the wall time.
  const double cpu_growth =
      r.servers_cpu / base.servers_cpu * base.workers / r.workers;
  absl::PrintF(
      "%-6d %-7d %5d %9.1f %7.2f %9.0f %8.0f %8.1f %9s %7.2f %6.1f %8.1f "
      "%7.2f %8.1f %6.2f %7.0f\n",
      r.shards, r.workers, r.steps, absl::ToDoubleMilliseconds(r.step), growth,
      r.shard_bytes_s / 1e6, r.peak_rss / 1048576.0, r.budget_peak / 1048576.0,
      r.connections_min == r.connections_max
          ? absl::StrCat(r.connections_min)
          : absl::StrCat(r.connections_min, "-", r.connections_max),
      r.coordinator_cpu * 1e3, r.coordinator_cpu_rate * 1e3,
      r.servers_cpu * 1e3, cpu_growth, r.workers_cpu * 1e3,
      absl::ToDoubleSeconds(r.join), r.coordinator_join_cpu * 1e3);
  std::fflush(stdout);
}

}  // namespace

absl::Status ServeScaleMembers(const std::string& coordinator, uint32_t workers,
                               uint64_t incarnation,
                               const std::function<absl::Status()>& ready) {
  std::vector<std::unique_ptr<coordinator::CoordinatorClient>> members(workers);
  SHARDPS_RETURN_IF_ERROR(Parallel(workers, [&](uint32_t r) -> absl::Status {
                            SHARDPS_ASSIGN_OR_RETURN(
                                members[r],
                                JoinRank(coordinator, r, incarnation + r));
                            return absl::OkStatus();
                          }).status());
  SHARDPS_RETURN_IF_ERROR(ready());
  // The memberships heartbeat on their own threads until the bench kills
  // this process with the row's daemons.
  while (true) absl::SleepFor(absl::Hours(1));
}

absl::Status RunScaleBench(const ScaleOptions& o) {
  if (o.steps < 1 || o.min_steps < 1 || o.max_steps < o.steps) {
    return absl::InvalidArgumentError(
        "scale: steps must be at least 1 and at most max_steps");
  }
  for (int64_t b : o.model_bytes) {
    if (b < 4 * o.chunks_per_model) {
      return absl::InvalidArgumentError(
          absl::StrCat("scale: a ", b, "-byte model is too small"));
    }
  }
  const std::string dir = testing::MakeTempDir("shardps-scale");
  // Everything shares the machine's cores: other load shows in the times.
  absl::PrintF("machine: %d CPUs, load average %.2f at the start\n",
               std::thread::hardware_concurrency(), LoadAverage());
  absl::PrintF(
      "scale: a coordinated sync job on 127.0.0.1 per row (shardps-coordinator "
      "and the shards as processes, started afresh); each worker rank joins "
      "with its own membership and incarnation (all of them in one helper "
      "process) and pushes through its own Client (threads of this process: "
      "64 worker processes on %d CPUs would measure the scheduler)\n",
      std::thread::hardware_concurrency());
  absl::PrintF(
      "steps: median of the measured ones after %d warmup; %d unless a row's "
      "gradients pass %d MiB (then fewer, at least %d) or its steps take "
      "under %.1f s (then more, at most %d)\n",
      o.warmup_steps, o.steps, static_cast<int>(o.row_bytes >> 20), o.min_steps,
      o.min_row_seconds, o.max_steps);
  absl::PrintF(
      "growth: step / (workers x model bytes / shards) over the same for the "
      "first row of that shard count, the fewest workers (1.00: linear in "
      "workers); servers CPU growth: the same for the shards' CPU time a "
      "step\n"
      "per shard MB/s: bytes in + out of each shard (GetStatus) over the "
      "measured time, mean of the shards; server RSS: the largest shard's "
      "VmHWM; held: the most a shard's receive budget held (pushes being "
      "read and early gradients, GetStatus); conns: ESTABLISHED sockets on "
      "each shard's port (a shard "
      "owning little gets one stream per worker); CPU: user + system time "
      "per measured step (ticks, or the live threads' schedstat where finer) "
      "of the coordinator (also per second: its heartbeats come per second, "
      "not per step), of every shard together, and of the workers (this "
      "process and the memberships'); join: from starting the memberships "
      "to the last Declare, and the coordinator's CPU in it\n");
  std::fflush(stdout);
  for (int64_t model : o.model_bytes) {
    PrintHeader(o, model);
    for (uint32_t shards : o.shards) {
      std::optional<ScaleRow> base;
      for (uint32_t workers : o.workers) {
        SHARDPS_ASSIGN_OR_RETURN(ScaleRow row,
                                 RunRow(o, model, shards, workers, dir));
        if (!base.has_value()) base = row;
        PrintRow(row, *base);
      }
    }
  }
  absl::PrintF("load average %.2f at the end; daemon logs: %s\n", LoadAverage(),
               dir);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace shardps::bench
