// shardps-bench: benchmarks, each reported as a ratio to a baseline measured
// in the same run. Not part of the test suite.
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "tests/bench/aggregate_bench.h"
#include "tests/bench/gpu_bench.h"
#include "tests/bench/torch_bench.h"
#include "tests/bench/train_bench.h"
#include "tests/bench/transport_bench.h"

ABSL_FLAG(std::string, server_binary, "",
          "shardps-server to start; default: next to this binary's build.");
ABSL_FLAG(int32_t, epochs, 10, "Epochs (train).");
ABSL_FLAG(int32_t, steps, 10, "Measured steps per configuration.");
ABSL_FLAG(int32_t, cnn_steps, 200, "Measured steps of the CNN (torch).");
ABSL_FLAG(int32_t, gpt_steps, 60, "Measured steps of the GPT (torch).");
ABSL_FLAG(int32_t, torch_rounds, 2,
          "torch: runs of each side, alternating; the fastest of each counts "
          "(a noisy machine only ever slows a run down).");
ABSL_FLAG(int32_t, streams_per_shard, 2, "Client streams per shard.");
ABSL_FLAG(int64_t, model_mib, 64, "Model size in MiB (transport).");
ABSL_FLAG(int64_t, chunk_mib, 4, "Chunk size in MiB (transport).");
ABSL_FLAG(bool, raw_baseline, true,
          "Measure the raw TCP baseline (off only to profile shardps alone).");
ABSL_FLAG(std::string, shards, "1,2", "Shard counts to run (transport).");
ABSL_FLAG(std::string, workers, "1,2", "Worker counts to run (transport).");

namespace shardps::bench {
namespace {

// A binary of the same build tree: build/tests/shardps-bench ->
// build/<path>.
std::string SiblingBinary(const std::string& path) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string self = n > 0 ? std::string(buf, n) : "";
  const size_t pos = self.rfind("/tests/");
  return pos == std::string::npos ? path.substr(path.rfind('/') + 1)
                                  : self.substr(0, pos) + "/" + path;
}

absl::StatusOr<std::vector<uint32_t>> ParseCounts(const std::string& flag,
                                                  const std::string& value) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    uint32_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", value, " is not a list of counts"));
    }
    out.push_back(v);
  }
  return out;
}

absl::Status Run(const std::string& command) {
#ifndef NDEBUG
  absl::PrintF("WARNING: assertions are enabled; figures are not meaningful\n");
#endif
  if (command == "aggregate") return RunAggregateBench(AggregateOptions());
  if (command == "transport") {
    TransportOptions o;
    o.server_binary = absl::GetFlag(FLAGS_server_binary);
    if (o.server_binary.empty()) {
      o.server_binary = SiblingBinary("server/shardps-server");
    }
    o.steps = absl::GetFlag(FLAGS_steps);
    o.raw_baseline = absl::GetFlag(FLAGS_raw_baseline);
    o.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
    o.model_bytes = absl::GetFlag(FLAGS_model_mib) << 20;
    o.chunk_bytes = absl::GetFlag(FLAGS_chunk_mib) << 20;
    absl::StatusOr<std::vector<uint32_t>> shards =
        ParseCounts("shards", absl::GetFlag(FLAGS_shards));
    if (!shards.ok()) return shards.status();
    absl::StatusOr<std::vector<uint32_t>> workers =
        ParseCounts("workers", absl::GetFlag(FLAGS_workers));
    if (!workers.ok()) return workers.status();
    o.shards = *shards;
    o.workers = *workers;
    return RunTransportBench(o);
  }
  if (command == "gpu") return RunGpuBench();
  if (command == "train") {
    TrainOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.torch_script = SHARDPS_SOURCE_DIR "/tests/bench/torch/mlp_ddp.py";
    o.epochs = absl::GetFlag(FLAGS_epochs);
    return RunTrainBench(o);
  }
  if (command == "torch") {
    TorchOptions o;
    o.local_binary = SiblingBinary("deploy/local/shardps-local");
    o.python_path = SiblingBinary("worker/python");
    o.source_dir = SHARDPS_SOURCE_DIR;
    o.cnn_steps = absl::GetFlag(FLAGS_cnn_steps);
    o.gpt_steps = absl::GetFlag(FLAGS_gpt_steps);
    o.rounds = absl::GetFlag(FLAGS_torch_rounds);
    return RunTorchBench(o);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown benchmark \"", command,
                   "\"; one of: transport, aggregate, train, gpu, torch"));
}

}  // namespace
}  // namespace shardps::bench

int main(int argc, char** argv) {
  std::vector<char*> args = shardps::ParseDaemonFlags(
      argc, argv,
      "runs a benchmark against a baseline measured in the same run.\n"
      "  shardps-bench transport | aggregate | train | gpu | torch [flags]");
  if (args.size() != 2) {
    shardps::LogError(
        "give one benchmark: transport, aggregate, train, gpu or torch");
    return 1;
  }
  return shardps::ExitCode(shardps::bench::Run(args[1]));
}
