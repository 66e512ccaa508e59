// shardps-bench transport: full PushPull steps, Push-only and Pull-only of a
// 64 MiB fp32 model over real shardps-server processes on loopback, each
// against a raw TCP exchange of the same bytes in the same pattern. With a
// link, the servers and the raw peer run in one network namespace and the
// workers in another, and the traffic crosses a tbf-shaped veth pair.
#include "tests/bench/transport_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/link_rate.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/netns_link.h"
#include "tests/bench/raw_tcp.h"
#include "tests/testing/daemon.h"
#include "worker/client.h"
#include "worker/compression.h"

namespace shardps::bench {
namespace {

using ::shardps::testing::Daemon;

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

// The link's raw TCP exchange, with raw_tcp.h's socket loops; RawTcpBench
// serves on 127.0.0.1 in its own process, so it cannot put the two ends in
// two namespaces.
bool SendBytes(int fd, int64_t n) {
  std::vector<char> buf(std::min(n, kIoBytes), 1);
  for (int64_t k; n > 0; n -= k) {
    k = std::min(n, kIoBytes);
    if (!WriteAll(fd, buf.data(), k)) return false;
  }
  return true;
}

bool RecvBytes(int fd, int64_t n) {
  std::vector<char> buf(std::min(n, kIoBytes));
  for (int64_t k; n > 0; n -= k) {
    k = std::min(n, kIoBytes);
    if (!ReadAll(fd, buf.data(), k)) return false;
  }
  return true;
}

// The peer's half of an exchange: all but the last byte of the reply go
// out while the request comes in; the last one after the whole request was
// read, so the client's step ends only when both directions have arrived.
bool AnswerExchange(int fd) {
  int64_t header[2];
  if (!ReadAll(fd, reinterpret_cast<char*>(header), sizeof(header)) ||
      header[0] < 0 || header[1] < 1) {
    return false;
  }
  bool sent = false;
  std::thread sender([&] { sent = SendBytes(fd, header[1] - 1); });
  const bool read = RecvBytes(fd, header[0]);
  sender.join();
  return sent && read && SendBytes(fd, 1);
}

// Client connections in the workers' namespace to ServeRawTcpPeer across
// the link, one per element of the pattern.
class LinkRawTcp {
 public:
  static absl::StatusOr<std::unique_ptr<LinkRawTcp>> Create(
      int port, std::vector<RawExchange> pattern) {
    std::unique_ptr<LinkRawTcp> b(new LinkRawTcp());
    b->pattern_ = std::move(pattern);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    inet_pton(AF_INET, NetnsLink::kServerHost, &addr.sin_addr);
    for (size_t i = 0; i < b->pattern_.size(); ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      if (fd >= 0) b->fds_.push_back(fd);
      if (fd < 0 ||
          connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        return absl::UnavailableError(
            absl::StrCat("cannot connect to the raw TCP peer at ",
                         NetnsLink::kServerHost, ":", port));
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    return b;
  }
  ~LinkRawTcp() {
    for (int fd : fds_) close(fd);  // the peer sees EOF and lets go
  }

  // Runs one step on every connection in parallel; returns its wall time.
  absl::StatusOr<absl::Duration> Step() {
    std::vector<std::thread> threads;
    std::vector<char> ok(pattern_.size() * 2, 0);
    const absl::Time start = absl::Now();
    for (size_t i = 0; i < pattern_.size(); ++i) {
      const RawExchange& e = pattern_[i];
      const int fd = fds_[i];
      threads.emplace_back([&ok, i, e, fd] {
        int64_t header[2] = {e.request_bytes, e.reply_bytes};
        ok[2 * i] =
            WriteAll(fd, reinterpret_cast<char*>(header), sizeof(header)) &&
            SendBytes(fd, e.request_bytes);
      });
      threads.emplace_back(
          [&ok, i, e, fd] { ok[2 * i + 1] = RecvBytes(fd, e.reply_bytes); });
    }
    for (std::thread& t : threads) t.join();
    const absl::Duration elapsed = absl::Now() - start;
    if (std::count(ok.begin(), ok.end(), 0) > 0) {
      return absl::UnavailableError("raw TCP exchange over the link failed");
    }
    return elapsed;
  }

 private:
  LinkRawTcp() = default;
  std::vector<RawExchange> pattern_;
  std::vector<int> fds_;
};

struct Row {
  uint32_t shards, workers;
  Kind kind;
  double payload_gb;
  absl::Duration shardps, raw;
  // With a link: the model bytes of one direction (both carry as much in
  // a PushPull), and the mean bytes per measured shardps step that the
  // workers' veth end sent and received.
  int64_t direction_bytes = 0;
  double to_servers = 0, to_workers = 0;
};

// Where the run's servers and raw peer are: a link (or null: loopback).
struct Network {
  NetnsLink* link = nullptr;
  int raw_peer_port = 0;
};

// Starts the `shards` servers of a `workers`-worker job (in the link's
// servers' namespace when there is one) and appends their addresses.
absl::Status StartServers(const TransportOptions& o, const Network& net,
                          uint32_t shards, uint32_t workers,
                          std::vector<std::unique_ptr<Daemon>>* servers,
                          std::vector<std::string>* addresses) {
  NetnsLink* link = net.link;
  for (uint32_t s = 0; s < shards; ++s) {
    const std::string name = absl::StrCat("bench-server-", servers->size());
    std::vector<std::string> args = {
        absl::StrCat("--shard_index=", s),
        absl::StrCat("--num_shards=", shards),
        absl::StrCat("--num_workers=", workers),
        absl::StrCat("--update_threads=", o.update_threads)};
    std::unique_ptr<Daemon> d;
    if (link != nullptr) {
      args.push_back(absl::StrCat("--host=", NetnsLink::kServerHost));
      SHARDPS_ASSIGN_OR_RETURN(
          d, Daemon::Start(name, link->ip_binary(),
                           link->ServerArgs(o.server_binary, args)));
      addresses->push_back(
          absl::StrCat(NetnsLink::kServerHost, ":", d->port()));
    } else {
      SHARDPS_ASSIGN_OR_RETURN(d, Daemon::Start(name, o.server_binary, args));
      addresses->push_back(d->address());
    }
    servers->push_back(std::move(d));
  }
  return absl::OkStatus();
}

absl::Status RunConfig(const TransportOptions& o, const Network& net,
                       uint32_t shards, uint32_t workers,
                       std::vector<Row>* rows,
                       std::vector<std::string>* rss_lines) {
  NetnsLink* link = net.link;
  std::vector<std::unique_ptr<Daemon>> servers;
  std::vector<std::string> addresses;
  SHARDPS_RETURN_IF_ERROR(
      StartServers(o, net, shards, workers, &servers, &addresses));
  const int64_t elements = o.model_bytes / 4;
  const BenchModel model = OneTensorModel(elements, o.chunk_bytes);
  const v1::Layout& layout = model.layout;
  const v1::OptimizerSpec& opt = model.optimizer;

  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> grads(workers), weights(workers);
  // Where each worker's gradient and weights lie: as shardps-worker keeps
  // them, in the client's gradient and weight buffers when it has them (a
  // shard on this machine), else in buffers of its own.
  std::vector<absl::Span<const float>> gradient(workers);
  std::vector<absl::Span<float>> weight(workers);
  for (uint32_t r = 0; r < workers; ++r) {
    ClientOptions co;
    co.servers = addresses;
    co.rank = r;
    co.streams_per_shard = o.streams_per_shard;
    co.shared_memory = o.shared_memory;
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Create(co));
    SHARDPS_RETURN_IF_ERROR(c->Declare(layout, opt));
    const Tensors buffers = c->GradientBuffers();
    const Tensors weight_buffers = c->WeightBuffers();
    if (buffers.empty()) {
      grads[r].assign(elements, 1e-3f * (r + 1));
      gradient[r] = grads[r];
      weights[r].assign(elements, 0.0f);
      weight[r] = absl::MakeSpan(weights[r]);
    } else {
      std::fill(buffers[0].begin(), buffers[0].end(), 1e-3f * (r + 1));
      gradient[r] = buffers[0];
      weight[r] = weight_buffers[0];
    }
    clients.push_back(std::move(c));
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
      ConstTensors g = {gradient[r]};
      Tensors w = {weight[r]};
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
    std::vector<RawExchange> pattern = RawPattern(
        kind, workers, shard_bytes, o.streams_per_shard, chunks_per_stream);
    std::function<absl::StatusOr<absl::Duration>()> raw_step;
    std::unique_ptr<RawTcpBench> loopback_raw;
    std::unique_ptr<LinkRawTcp> link_raw;
    if (!o.raw_baseline) {
      raw_step = [] { return absl::ZeroDuration(); };
    } else if (link != nullptr) {
      SHARDPS_ASSIGN_OR_RETURN(
          link_raw, LinkRawTcp::Create(net.raw_peer_port, std::move(pattern)));
      raw_step = [&] { return link_raw->Step(); };
    } else {
      SHARDPS_ASSIGN_OR_RETURN(loopback_raw,
                               RawTcpBench::Create(std::move(pattern)));
      raw_step = [&] { return loopback_raw->Step(); };
    }
    // Alternate the two so both see the same machine load.
    std::vector<absl::Duration> times, raw_times;
    LinkBytes crossed;
    for (int i = 0; i < o.warmup_steps + o.steps; ++i) {
      LinkBytes before, after;
      if (link != nullptr) {
        SHARDPS_ASSIGN_OR_RETURN(before, link->Bytes());
      }
      SHARDPS_ASSIGN_OR_RETURN(absl::Duration d, Parallel(workers, one_step));
      if (link != nullptr) {
        SHARDPS_ASSIGN_OR_RETURN(after, link->Bytes());
      }
      if (kind != Kind::kPull) ++step;
      SHARDPS_ASSIGN_OR_RETURN(absl::Duration r, raw_step());
      if (i >= o.warmup_steps) {
        times.push_back(d);
        raw_times.push_back(r);
        crossed.to_servers += after.to_servers - before.to_servers;
        crossed.to_workers += after.to_workers - before.to_workers;
      }
    }
    if (!o.raw_baseline) raw_times = times;  // profiling runs only
    const double directions = kind == Kind::kPushPull ? 2.0 : 1.0;
    Row row = {shards,        workers,
               kind,          directions * workers * o.model_bytes / 1e9,
               Median(times), Median(raw_times)};
    if (link != nullptr) {
      row.direction_bytes = int64_t{workers} * o.model_bytes;
      row.to_servers = static_cast<double>(crossed.to_servers) / o.steps;
      row.to_workers = static_cast<double>(crossed.to_workers) / o.steps;
      const double carried =
          kind == Kind::kPull ? row.to_workers : row.to_servers;
      if (carried < row.direction_bytes) {
        return absl::InternalError(absl::StrFormat(
            "shards=%d workers=%d %s: %.0f bytes a step crossed the link, "
            "less than the %d bytes of payload; the traffic took another "
            "path",
            shards, workers, KindName(kind), carried, row.direction_bytes));
      }
    }
    rows->push_back(row);
  }
  SHARDPS_ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status,
                           clients[0]->ShardStatus());
  for (uint32_t s = 0; s < shards; ++s) {
    // The workers' regions stay mapped while their streams are open, and
    // each worker's Pull region (its weights of this shard, each chunk at a
    // cache line) while it pulls: their pages count in the peak but are the
    // workers' memfds.
    const int64_t pull_regions =
        clients[0]->shared_memory(s)
            ? int64_t{workers} *
                  static_cast<int64_t>(shard_bytes[s] +
                                       64 * status[s].num_chunks())
            : 0;
    const int64_t shared =
        std::max<int64_t>(0, SharedRss(servers[s]->pid())) + pull_regions;
    const int64_t rss = PeakRss(servers[s]->pid()) - shared;
    // SGD without momentum: the weights and the running sum per owned byte,
    // plus at most one early gradient per stream (messages in flight).
    const int64_t in_flight =
        int64_t{workers} * o.streams_per_shard * o.chunk_bytes;
    const int64_t bound = 2 * shard_bytes[s] + in_flight + (int64_t{64} << 20);
    rss_lines->push_back(absl::StrFormat(
        "  shards=%d workers=%d server-%d peak RSS %.1f MiB besides %.1f MiB "
        "of the workers' shared-memory regions (bound 2 x %.1f "
        "MiB + %d x %d x %.1f MiB in flight + 64 MiB = %.1f MiB; one buffer "
        "per worker would need %.1f MiB) %s; %d of %d updates copied weights",
        shards, workers, s, rss / 1048576.0, shared / 1048576.0,
        shard_bytes[s] / 1048576.0, workers, o.streams_per_shard,
        o.chunk_bytes / 1048576.0, bound / 1048576.0,
        (3 + workers) * shard_bytes[s] / 1048576.0,
        rss <= bound ? "ok" : "OVER", status[s].weight_copies_total(),
        status[s].updates_total()));
  }
  return absl::OkStatus();
}

// The model of a codec run: one tensor of model_bytes in chunk_bytes, or the
// main job's MLP (784-512-256-10 with biases, 256 KiB chunks).
v1::Layout CodecLayout(const TransportOptions& o) {
  v1::Layout layout;
  if (!o.main_job_model) {
    layout.set_chunk_bytes(o.chunk_bytes);
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name("w");
    t->add_shape(o.model_bytes / 4);
    return layout;
  }
  layout.set_chunk_bytes(256 << 10);
  const int sizes[] = {784, 512, 256, 10};
  for (int l = 0; l < 3; ++l) {
    v1::TensorSpec* w = layout.add_tensors();
    w->set_name(absl::StrCat("fc", l + 1, ".weight"));
    w->add_shape(sizes[l + 1]);
    w->add_shape(sizes[l]);
    v1::TensorSpec* b = layout.add_tensors();
    b->set_name(absl::StrCat("fc", l + 1, ".bias"));
    b->add_shape(sizes[l + 1]);
  }
  return layout;
}

// One codec of a codec run: its servers and clients.
struct CodecRun {
  std::string spec;
  Compression compression;
  std::vector<std::unique_ptr<Daemon>> servers;
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<absl::Duration> times;
  LinkBytes crossed;
  // The shards' byte counters over the steps (GetStatus, summed).
  int64_t wire_in = 0, wire_out = 0, fp32_in = 0, fp32_out = 0;
  absl::Status Count(int sign) {
    SHARDPS_ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status,
                             clients[0]->ShardStatus());
    for (const v1::GetStatusResponse& shard : status) {
      wire_in += sign * static_cast<int64_t>(shard.bytes_in_total());
      fp32_in += sign * static_cast<int64_t>(shard.bytes_in_fp32_total());
      wire_out += sign * static_cast<int64_t>(shard.bytes_out_total());
      fp32_out += sign * static_cast<int64_t>(shard.bytes_out_fp32_total());
    }
    return absl::OkStatus();
  }
};

// "GRADIENTS[/WEIGHTS]" as --compression and --weight_encoding spell them.
absl::StatusOr<Compression> ParseCodecSpec(const std::string& spec) {
  Compression c;
  const size_t slash = spec.find('/');
  SHARDPS_ASSIGN_OR_RETURN(
      c.gradients,
      ParseGradientCompression(spec.substr(0, slash), &c.topk_ratio));
  if (slash != std::string::npos) {
    SHARDPS_ASSIGN_OR_RETURN(
        c.weights,
        ParseWeightEncoding(spec.substr(slash + 1), &c.weights_topk_ratio));
  }
  // Small chunks (the MLP's biases and output layer) go whole, as the
  // top-k recipe of the README's accuracy table has it.
  c.min_elements = kCodecMinElements;
  return c;
}

// PushPull steps of every codec in o.compressions on its own servers, one
// step of each in turn so that all see the same machine load; the first is
// the baseline of the speed-ups.
absl::Status RunCodecConfig(const TransportOptions& o, const Network& net,
                            uint32_t shards, uint32_t workers) {
  const v1::Layout layout = CodecLayout(o);
  v1::OptimizerSpec opt;
  opt.set_kind(v1::OptimizerSpec::KIND_SGD);
  opt.set_learning_rate(1e-6f);
  int64_t elements = 0;
  std::vector<int64_t> sizes;
  for (const v1::TensorSpec& t : layout.tensors()) {
    sizes.push_back(NumElements(t));
    elements += sizes.back();
  }
  // Gradients that look like gradients (not constant: top-k must choose).
  std::vector<std::vector<float>> grads(workers), weights(workers);
  for (uint32_t r = 0; r < workers; ++r) {
    grads[r].resize(elements);
    for (int64_t i = 0; i < elements; ++i) {
      grads[r][i] = 1e-3f * std::sin(0.37f * static_cast<float>(i) + r);
    }
    weights[r].assign(elements, 0.0f);
  }
  auto spans = [&](uint32_t r) {
    std::pair<ConstTensors, Tensors> v;
    int64_t at = 0;
    for (int64_t n : sizes) {
      v.first.push_back(absl::MakeConstSpan(grads[r]).subspan(at, n));
      v.second.push_back(absl::MakeSpan(weights[r]).subspan(at, n));
      at += n;
    }
    return v;
  };
  std::vector<CodecRun> runs(o.compressions.size());
  for (size_t c = 0; c < runs.size(); ++c) {
    CodecRun& run = runs[c];
    run.spec = o.compressions[c];
    SHARDPS_ASSIGN_OR_RETURN(run.compression, ParseCodecSpec(run.spec));
    std::vector<std::string> addresses;
    SHARDPS_RETURN_IF_ERROR(
        StartServers(o, net, shards, workers, &run.servers, &addresses));
    for (uint32_t r = 0; r < workers; ++r) {
      ClientOptions co;
      co.servers = addresses;
      co.rank = r;
      co.streams_per_shard = o.streams_per_shard;
      // The namespaces share /proc: shared memory would bypass the link.
      co.shared_memory = false;
      co.compression = run.compression;
      SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> client,
                               Client::Create(co));
      SHARDPS_RETURN_IF_ERROR(client->Declare(layout, opt));
      // Sparse weights are changes to the copy a worker holds.
      SHARDPS_RETURN_IF_ERROR(client->Pull(spans(r).second));
      run.clients.push_back(std::move(client));
    }
    SHARDPS_RETURN_IF_ERROR(run.Count(-1));  // not the Pulls above
  }
  for (int i = 0; i < o.warmup_steps + o.steps; ++i) {
    for (CodecRun& run : runs) {
      LinkBytes before, after;
      if (net.link != nullptr) {
        SHARDPS_ASSIGN_OR_RETURN(before, net.link->Bytes());
      }
      SHARDPS_ASSIGN_OR_RETURN(absl::Duration d,
                               Parallel(workers, [&](uint32_t r) {
                                 const auto [g, w] = spans(r);
                                 return run.clients[r]->PushPull(i, g, w);
                               }));
      if (net.link != nullptr) {
        SHARDPS_ASSIGN_OR_RETURN(after, net.link->Bytes());
      }
      if (i >= o.warmup_steps) {
        run.times.push_back(d);
        run.crossed.to_servers += after.to_servers - before.to_servers;
        run.crossed.to_workers += after.to_workers - before.to_workers;
      }
    }
  }
  absl::PrintF(
      "shards=%d workers=%d, %s: PushPull step, median of %d after %d "
      "warmup, one step of each codec in turn\n",
      shards, workers,
      o.main_job_model
          ? "the main job's MLP 784-512-256-10 (2.0 MiB)"
          : absl::StrFormat("%.0f MiB model", o.model_bytes / 1048576.0),
      o.steps, o.warmup_steps);
  absl::PrintF("  %-24s %10s %9s %12s %12s %12s\n", "gradients/weights",
               "step ms", "speed-up", "in / fp32", "out / fp32",
               net.link != nullptr ? "link MB/step" : "");
  const absl::Duration base = Median(runs[0].times);
  for (CodecRun& run : runs) {
    SHARDPS_RETURN_IF_ERROR(run.Count(1));
    const absl::Duration t = Median(run.times);
    absl::PrintF("  %-24s %10.1f %8.2fx %12.4f %12.4f %s\n", run.spec,
                 absl::ToDoubleMilliseconds(t), absl::FDivDuration(base, t),
                 static_cast<double>(run.wire_in) / run.fp32_in,
                 static_cast<double>(run.wire_out) / run.fp32_out,
                 net.link != nullptr
                     ? absl::StrFormat("%6.2f up, %6.2f down",
                                       run.crossed.to_servers / 1e6 / o.steps,
                                       run.crossed.to_workers / 1e6 / o.steps)
                     : "");
  }
  return absl::OkStatus();
}

void PrintLoopbackTable(const std::vector<Row>& rows) {
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
}

// "of link" is the time the link needs for the payload, at its rate, over
// the time taken: a PushPull's push and pull go opposite ways of the
// full-duplex link, so its bound is one direction's bytes, as for Push and
// Pull. Wire overhead (headers: 1448 payload bytes per 1514-byte frame at
// MTU 1500) caps it near 0.956.
void PrintLinkTable(const std::vector<Row>& rows, const TransportOptions& o,
                    const NetnsLink& link) {
  // First: it logs the tc commands it runs.
  const std::string qdisc_stats = link.QdiscStats();
  absl::PrintF("%-6s %-7s %-9s %8s %9s %9s %9s %8s %8s %8s  %s\n", "shards",
               "workers", "op", "payload", "bound", "shardps", "raw tcp",
               "shardps", "shardps", "raw tcp", "ratio");
  absl::PrintF("%-6s %-7s %-9s %8s %9s %9s %9s %8s %8s %8s  %s\n", "", "", "",
               "GB", "ms", "ms", "ms", "GB/s", "of link", "of link",
               "(raw time / shardps time)");
  for (const Row& r : rows) {
    const double bound_s =
        r.direction_bytes * 8.0 / static_cast<double>(link.bits_per_second());
    const double raw_s = absl::ToDoubleSeconds(r.raw);
    absl::PrintF(
        "%-6d %-7d %-9s %8.3f %9.1f %9.1f %9.1f %8.3f %8.3f %8s  ratio = "
        "%s\n",
        r.shards, r.workers, KindName(r.kind), r.payload_gb, bound_s * 1e3,
        absl::ToDoubleMilliseconds(r.shardps), raw_s * 1e3,
        r.payload_gb / absl::ToDoubleSeconds(r.shardps),
        bound_s / absl::ToDoubleSeconds(r.shardps),
        o.raw_baseline ? absl::StrFormat("%.3f", bound_s / raw_s) : "-",
        o.raw_baseline
            ? absl::StrFormat("%.2f", absl::FDivDuration(r.raw, r.shardps))
            : "-");
  }
  absl::PrintF(
      "link bytes a shardps step, counted by %s's veth (to servers = its tx, "
      "to workers = its rx), against the payload of one direction:\n",
      link.worker_namespace());
  for (const Row& r : rows) {
    absl::PrintF(
        "  shards=%d workers=%d %-8s to servers %8.2f MB, to workers %8.2f "
        "MB, payload %.2f MB\n",
        r.shards, r.workers, KindName(r.kind), r.to_servers / 1e6,
        r.to_workers / 1e6, r.direction_bytes / 1e6);
  }
  absl::PrintF("tc after the run:\n%s\n", qdisc_stats);
}

}  // namespace

int64_t DefaultLinkModelBytes(int64_t link_bits_per_second) {
  const int64_t half_second = link_bits_per_second / 16;
  int64_t mib = 16;
  while (mib < 256 && (mib << 20) * 3 / 2 < half_second) mib *= 2;
  return mib << 20;
}

absl::Status ServeRawTcpPeer(const std::string& host, int port,
                             const std::function<absl::Status(int)>& bound) {
  const int listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  socklen_t len = sizeof(addr);
  if (listen_fd < 0 || inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(listen_fd, 128) != 0 ||
      getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return absl::UnavailableError(
        absl::StrCat("raw TCP peer: cannot listen on ", host, ":", port));
  }
  SHARDPS_RETURN_IF_ERROR(bound(ntohs(addr.sin_port)));
  while (true) {
    const int fd = accept(listen_fd, nullptr, nullptr);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::thread([fd] {
      while (AnswerExchange(fd)) {
      }
      close(fd);
    }).detach();
  }
}

absl::Status RunTransportBench(const TransportOptions& o) {
  // Declared first, so that it outlives the processes inside it.
  std::unique_ptr<NetnsLink> link;
  std::unique_ptr<Daemon> raw_peer;
  Network net;
  std::string where = "loopback";
  if (o.link_bits_per_second > 0) {
    SHARDPS_ASSIGN_OR_RETURN(link, NetnsLink::Create(o.link_bits_per_second));
    net.link = link.get();
    // Before any gRPC channel exists: the client threads it starts later,
    // and their sockets, are then in the workers' namespace.
    SHARDPS_RETURN_IF_ERROR(link->EnterWorkerNamespace());
    if (o.raw_baseline) {
      SHARDPS_ASSIGN_OR_RETURN(
          raw_peer,
          Daemon::Start(
              "bench-raw-peer", link->ip_binary(),
              link->ServerArgs(
                  o.self_binary,
                  {"raw_tcp_peer",
                   absl::StrCat("--host=", NetnsLink::kServerHost)})));
      net.raw_peer_port = raw_peer->port();
    }
    where = absl::StrFormat(
        "across a %s link each way (tbf burst %d B, latency %d ms) from %s "
        "(servers, %s) to %s (workers, %s)",
        FormatLinkRate(link->bits_per_second()), link->burst_bytes(),
        link->latency_ms(), link->server_namespace(), NetnsLink::kServerHost,
        link->worker_namespace(), NetnsLink::kWorkerHost);
  }
  absl::PrintF(
      "transport: %.0f MiB fp32 model in %g MiB chunks, %d stream(s) per "
      "shard, median of %d steps after %d warmup, %s; payloads %s\n",
      o.model_bytes / 1048576.0, o.chunk_bytes / 1048576.0, o.streams_per_shard,
      o.steps, o.warmup_steps, where,
      link == nullptr && o.shared_memory
          ? "through shared memory, gradients and weights in the clients' "
            "buffers (--shared_memory=false: over gRPC)"
          : "over gRPC");
  if (link != nullptr) {
    absl::PrintF(
        "raw tcp: the same bytes and connections; over the link the peer "
        "sends a reply while it reads the request (full duplex)\n");
    // veth and tbf run in softirq, which a busy machine defers (ksoftirqd):
    // other load slows the link itself, not only shardps.
    std::ifstream loadavg("/proc/loadavg");
    double load = -1;
    loadavg >> load;
    absl::PrintF("machine: %d CPUs, load average %.2f at the start\n",
                 std::thread::hardware_concurrency(), load);
  }
  if (!o.compressions.empty()) {
    absl::PrintF(
        "codecs: chunks under %d elements go as fp32; in / out: payload "
        "bytes the shards took and sent in the steps over what they stand "
        "for as fp32\n",
        kCodecMinElements);
    for (uint32_t shards : o.shards) {
      for (uint32_t workers : o.workers) {
        SHARDPS_RETURN_IF_ERROR(RunCodecConfig(o, net, shards, workers));
      }
    }
    std::fflush(stdout);
    return absl::OkStatus();
  }
  std::vector<Row> rows;
  std::vector<std::string> rss;
  for (uint32_t shards : o.shards) {
    for (uint32_t workers : o.workers) {
      SHARDPS_RETURN_IF_ERROR(RunConfig(o, net, shards, workers, &rows, &rss));
    }
  }
  if (link != nullptr) {
    PrintLinkTable(rows, o, *link);
  } else {
    PrintLoopbackTable(rows);
  }
  absl::PrintF("server memory:\n");
  for (const std::string& line : rss) absl::PrintF("%s\n", line);
  // Before the link's teardown logs its commands to stderr.
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace shardps::bench
