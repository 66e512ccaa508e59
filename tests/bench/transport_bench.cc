// shardps-bench transport: full PushPull steps, Push-only and Pull-only of a
// 64 MiB fp32 model over real shardps-server processes on loopback, each
// against a raw TCP exchange of the same bytes in the same pattern.
#include "tests/bench/transport_bench.h"

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "tests/bench/raw_tcp.h"
#include "tests/testing/daemon.h"
#include "worker/client.h"

namespace shardps::bench {
namespace {

using ::shardps::testing::Daemon;

absl::Duration Median(std::vector<absl::Duration> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Peak resident set of a process, in bytes (VmHWM).
int64_t PeakRss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      return std::stoll(line.substr(6)) * 1024;
    }
  }
  return -1;
}

// Runs `fn(rank)` on one thread per worker and returns the wall time.
absl::StatusOr<absl::Duration> Parallel(
    uint32_t workers, const std::function<absl::Status(uint32_t)>& fn) {
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (uint32_t r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] { status[r] = fn(r); });
  }
  for (std::thread& t : threads) t.join();
  const absl::Duration d = absl::Now() - start;
  for (const absl::Status& s : status) SHARDPS_RETURN_IF_ERROR(s);
  return d;
}

enum class Kind { kPushPull, kPush, kPull };
const char* KindName(Kind k) {
  return k == Kind::kPushPull ? "pushpull" : k == Kind::kPush ? "push" : "pull";
}

// The raw TCP pattern of one step: a connection per (worker, shard, stream),
// each carrying its stream's share of the shard's bytes.
std::vector<RawExchange> RawPattern(Kind kind, uint32_t workers,
                                    const std::vector<int64_t>& shard_bytes,
                                    int streams, int64_t chunks_per_stream) {
  std::vector<RawExchange> pattern;
  for (uint32_t w = 0; w < workers; ++w) {
    for (int64_t bytes : shard_bytes) {
      for (int k = 0; k < streams; ++k) {
        const int64_t share = bytes / streams;
        // Control messages of the real protocol are ~32 bytes per chunk.
        const int64_t small = 32 * chunks_per_stream;
        RawExchange e;
        e.request_bytes = kind == Kind::kPull ? small : share;
        e.reply_bytes = kind == Kind::kPush ? small : share;
        pattern.push_back(e);
      }
    }
  }
  return pattern;
}

struct Row {
  uint32_t shards, workers;
  Kind kind;
  double payload_gb;
  absl::Duration shardps, raw;
};

absl::Status RunConfig(const TransportOptions& o, uint32_t shards,
                       uint32_t workers, std::vector<Row>* rows,
                       std::vector<std::string>* rss_lines) {
  std::vector<std::unique_ptr<Daemon>> servers;
  std::vector<std::string> addresses;
  for (uint32_t s = 0; s < shards; ++s) {
    SHARDPS_ASSIGN_OR_RETURN(
        std::unique_ptr<Daemon> d,
        Daemon::Start(absl::StrCat("bench-server-", s), o.server_binary,
                      {absl::StrCat("--shard_index=", s),
                       absl::StrCat("--num_shards=", shards),
                       absl::StrCat("--num_workers=", workers),
                       absl::StrCat("--update_threads=", o.update_threads)}));
    addresses.push_back(d->address());
    servers.push_back(std::move(d));
  }
  const int64_t elements = o.model_bytes / 4;
  v1::Layout layout;
  layout.set_chunk_bytes(o.chunk_bytes);
  v1::TensorSpec* t = layout.add_tensors();
  t->set_name("w");
  t->add_shape(elements);
  v1::OptimizerSpec opt;
  opt.set_kind(v1::OptimizerSpec::KIND_SGD);
  opt.set_learning_rate(1e-6f);

  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> grads(workers), weights(workers);
  for (uint32_t r = 0; r < workers; ++r) {
    ClientOptions co;
    co.servers = addresses;
    co.rank = r;
    co.streams_per_shard = o.streams_per_shard;
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Create(co));
    SHARDPS_RETURN_IF_ERROR(c->Declare(layout, opt));
    clients.push_back(std::move(c));
    grads[r].assign(elements, 1e-3f * (r + 1));
    weights[r].assign(elements, 0.0f);
  }
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  std::vector<uint32_t> shard_of = PartitionChunks(chunks, shards);
  std::vector<int64_t> shard_bytes(shards, 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    shard_bytes[shard_of[i]] += chunks[i].bytes();
  }
  const int64_t chunks_per_stream =
      std::max<int64_t>(1, chunks.size() / (shards * o.streams_per_shard));

  int64_t step = 0;
  for (Kind kind : {Kind::kPushPull, Kind::kPush, Kind::kPull}) {
    auto one_step = [&](uint32_t r) -> absl::Status {
      ConstTensors g = {grads[r]};
      Tensors w = {absl::MakeSpan(weights[r])};
      switch (kind) {
        case Kind::kPushPull:
          return clients[r]->PushPull(step, g, w);
        case Kind::kPush:
          return clients[r]->Push(step, g);
        case Kind::kPull:
          return clients[r]->Pull(w);
      }
      return absl::OkStatus();
    };
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<RawTcpBench> raw,
                             RawTcpBench::Create(RawPattern(
                                 kind, workers, shard_bytes,
                                 o.streams_per_shard, chunks_per_stream)));
    // Alternate the two so both see the same machine load.
    std::vector<absl::Duration> times, raw_times;
    for (int i = 0; i < o.warmup_steps + o.steps; ++i) {
      SHARDPS_ASSIGN_OR_RETURN(absl::Duration d, Parallel(workers, one_step));
      if (kind != Kind::kPull) ++step;
      absl::Duration r = absl::ZeroDuration();
      if (o.raw_baseline) {
        SHARDPS_ASSIGN_OR_RETURN(r, raw->Step());
      }
      if (i >= o.warmup_steps) {
        times.push_back(d);
        raw_times.push_back(r);
      }
    }
    if (!o.raw_baseline) raw_times = times;  // profiling runs only
    const double directions = kind == Kind::kPushPull ? 2.0 : 1.0;
    rows->push_back({shards, workers, kind,
                     directions * workers * o.model_bytes / 1e9, Median(times),
                     Median(raw_times)});
  }
  SHARDPS_ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status,
                           clients[0]->ShardStatus());
  for (uint32_t s = 0; s < shards; ++s) {
    const int64_t rss = PeakRss(servers[s]->pid());
    // SGD without momentum: the weights and the running sum per owned byte,
    // plus at most one early gradient per stream (messages in flight).
    const int64_t in_flight =
        int64_t{workers} * o.streams_per_shard * o.chunk_bytes;
    const int64_t bound = 2 * shard_bytes[s] + in_flight + (int64_t{64} << 20);
    rss_lines->push_back(absl::StrFormat(
        "  shards=%d workers=%d server-%d peak RSS %.1f MiB (bound 2 x %.1f "
        "MiB + %d x %d x %.1f MiB in flight + 64 MiB = %.1f MiB; one buffer "
        "per worker would need %.1f MiB) %s; %d of %d updates copied weights",
        shards, workers, s, rss / 1048576.0, shard_bytes[s] / 1048576.0,
        workers, o.streams_per_shard, o.chunk_bytes / 1048576.0,
        bound / 1048576.0, (3 + workers) * shard_bytes[s] / 1048576.0,
        rss <= bound ? "ok" : "OVER", status[s].weight_copies_total(),
        status[s].updates_total()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunTransportBench(const TransportOptions& o) {
  absl::PrintF(
      "transport: %.0f MiB fp32 model in %.0f MiB chunks, %d stream(s) per "
      "shard, median of %d steps after %d warmup, loopback\n",
      o.model_bytes / 1048576.0, o.chunk_bytes / 1048576.0, o.streams_per_shard,
      o.steps, o.warmup_steps);
  std::vector<Row> rows;
  std::vector<std::string> rss;
  for (uint32_t shards : o.shards) {
    for (uint32_t workers : o.workers) {
      SHARDPS_RETURN_IF_ERROR(RunConfig(o, shards, workers, &rows, &rss));
    }
  }
  absl::PrintF("%-8s %-7s %-9s %10s %10s %10s %10s  %s\n", "shards", "workers",
               "op", "payload", "shardps", "raw tcp", "shardps", "ratio");
  absl::PrintF("%-8s %-7s %-9s %10s %10s %10s %10s  %s\n", "", "", "", "GB",
               "ms", "ms", "GB/s", "(raw time / shardps time)");
  for (const Row& r : rows) {
    absl::PrintF("%-8d %-7d %-9s %10.3f %10.1f %10.1f %10.2f  ratio = %.2f\n",
                 r.shards, r.workers, KindName(r.kind), r.payload_gb,
                 absl::ToDoubleMilliseconds(r.shardps),
                 absl::ToDoubleMilliseconds(r.raw),
                 r.payload_gb / absl::ToDoubleSeconds(r.shardps),
                 absl::FDivDuration(r.raw, r.shardps));
  }
  absl::PrintF("server memory:\n");
  for (const std::string& line : rss) absl::PrintF("%s\n", line);
  return absl::OkStatus();
}

}  // namespace shardps::bench
