// The transport benchmark of shardps-bench: PushPull, Push and Pull of a model
// through real server processes, each as a ratio to raw TCP in the same run,
// on loopback or across a rate-limited veth link (netns_link.h).
#ifndef SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_
#define SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardps::bench {

// Codec runs send chunks of fewer elements as fp32.
inline constexpr int64_t kCodecMinElements = 4096;

struct TransportOptions {
  std::string server_binary;
  int64_t model_bytes = int64_t{64} << 20;
  int64_t chunk_bytes = int64_t{4} << 20;
  int streams_per_shard = 2;
  // Loopback: payloads through shared memory (the co-located path); never
  // across a --link.
  bool shared_memory = true;
  int update_threads = 2;
  int steps = 10;
  int warmup_steps = 2;
  // Off only for profiling shardps alone.
  bool raw_baseline = true;
  std::vector<uint32_t> shards = {1, 2};
  std::vector<uint32_t> workers = {1, 2};
  // Nonzero: servers and workers run in two network namespaces joined by a
  // veth pair shaped to this many bits per second each way (NetnsLink, so
  // root), and each row also gives the fraction of the link it achieved.
  // Zero: loopback.
  int64_t link_bits_per_second = 0;
  // Non-empty: instead of the table, PushPull step times of each codec,
  // "GRADIENTS[/WEIGHTS]" as --compression and --weight_encoding spell
  // them ("none", "bf16/bf16", "topk:0.01/topk:0.05"), against the first.
  std::vector<std::string> compressions;
  // Codec runs: the main job's MLP instead of one tensor of model_bytes.
  bool main_job_model = false;
  // This program: with a link, run in the servers' namespace as
  // `<self_binary> raw_tcp_peer --host=...` for the raw TCP baseline.
  std::string self_binary;
};

// Prints the table. With a link: FailedPrecondition when not root or
// without ip/tc, Internal when fewer bytes than the payload crossed the
// link (the traffic took another path).
absl::Status RunTransportBench(const TransportOptions& options);

// The model size of a link run unless told otherwise: about half a second
// per direction for one worker, a power of two from 16 to 256 MiB. Shorter
// steps would flatter the link: tbf's bucket refills between steps, and
// each step starts with burst_bytes (4 ms of the rate) above it.
int64_t DefaultLinkModelBytes(int64_t link_bits_per_second);

// The raw TCP peer of a link run (shardps-bench raw_tcp_peer): listens on
// host:port (0: any free port), calls `bound` with the port, then answers
// every connection until killed. Each exchange is a 16-byte header (request
// and reply sizes), the request, and the reply, which it sends while it
// still reads the request (full duplex, as shardps streams a PushPull's
// replies back during the push). Returns only on errors.
absl::Status ServeRawTcpPeer(const std::string& host, int port,
                             const std::function<absl::Status(int)>& bound);

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_TRANSPORT_BENCH_H_
