// shardps-worker: one data-parallel worker of a shardps job.
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/trainer.h"
#include "worker/training_flags.h"

ABSL_FLAG(std::string, servers, "",
          "Parameter servers, shard 0 first: host:port,host:port,...");
ABSL_FLAG(uint32_t, rank, 0, "This worker's rank in [0, num_workers).");
ABSL_FLAG(uint32_t, num_workers, 1, "Number of workers in the job.");
ABSL_FLAG(std::string, metrics_csv, "",
          "Rank 0: append one row per epoch to this CSV file.");
ABSL_FLAG(std::string, model_out, "",
          "Rank 0: write the final model here (safetensors).");
ABSL_FLAG(int32_t, connect_timeout_s, 120,
          "How long to wait for the servers to come up.");

namespace shardps::worker {
namespace {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& name,
                                                     int threads) {
  if (name == "cpu") return NewCpuBackend(threads);
  if (name == "cuda") return NewCudaBackend(0);
  if (name != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", name, " is not one of: auto, cpu, cuda"));
  }
  absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend(0);
  if (cuda.ok()) return cuda;
  LogInfo("no usable GPU (%s): using the CPU backend", cuda.status().message());
  return NewCpuBackend(threads);
}

absl::Status Run() {
  TrainerOptions o;
  o.rank = absl::GetFlag(FLAGS_rank);
  o.num_workers = absl::GetFlag(FLAGS_num_workers);
  if (o.num_workers < 1 || o.rank >= o.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank=", o.rank, " must be below --num_workers=", o.num_workers));
  }
  InitLog("worker", static_cast<int>(o.rank),
          absl::GetFlag(FLAGS_log_format) == "json");
  ClientOptions co;
  co.servers =
      absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty());
  if (co.servers.empty()) {
    return absl::InvalidArgumentError(
        "--servers is empty: give the parameter servers as host:port,...");
  }
  co.rank = o.rank;
  co.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
  co.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.epochs = absl::GetFlag(FLAGS_epochs);
  o.max_steps = absl::GetFlag(FLAGS_max_steps);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.eval_every_epochs = absl::GetFlag(FLAGS_eval_every_epochs);
  const int64_t chunk_kib = absl::GetFlag(FLAGS_chunk_kib);
  if (o.epochs < 1 || o.eval_every_epochs < 1 || o.max_steps < 0 ||
      chunk_kib < 1 || chunk_kib > (64 << 10)) {
    return absl::InvalidArgumentError(
        "--epochs and --eval_every_epochs must be >= 1, --max_steps >= 0, "
        "--chunk_kib in [1, 65536]");
  }
  o.chunk_bytes = static_cast<uint64_t>(chunk_kib) << 10;
  if (o.rank == 0) {
    o.metrics_csv = absl::GetFlag(FLAGS_metrics_csv);
    o.model_out = absl::GetFlag(FLAGS_model_out);
  }

  const std::string spec = absl::GetFlag(FLAGS_dataset);
  SHARDPS_ASSIGN_OR_RETURN(Dataset train, LoadDatasetSpec(spec, true));
  if (absl::GetFlag(FLAGS_train_limit) > 0) {
    train.Truncate(absl::GetFlag(FLAGS_train_limit));
  }
  std::optional<Dataset> test;
  if (o.rank == 0) {
    absl::StatusOr<Dataset> loaded = LoadDatasetSpec(
        spec, false, {train.num_features(), train.num_classes()});
    if (loaded.ok()) {
      test = *std::move(loaded);
      if (absl::GetFlag(FLAGS_test_limit) > 0) {
        test->Truncate(absl::GetFlag(FLAGS_test_limit));
      }
    } else if (absl::IsNotFound(loaded.status())) {
      LogWarning("no test set (%s): training without evaluation",
                 loaded.status().message());
    } else {
      return loaded.status();
    }
  }
  LogInfo("dataset %s: %d training samples, %d features, %d classes", spec,
          train.num_samples(), train.num_features(), train.num_classes());
  SHARDPS_ASSIGN_OR_RETURN(
      ModelSpec model,
      ParseModelSpec(absl::GetFlag(FLAGS_model), train.num_features(),
                     train.num_classes()));
  SHARDPS_ASSIGN_OR_RETURN(
      int64_t steps_per_epoch,
      StepsPerEpoch(train.num_samples(), o.batch_size, o.num_workers));
  int64_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
  OptimizerFlags of;
  of.name = absl::GetFlag(FLAGS_optimizer);
  of.lr = absl::GetFlag(FLAGS_lr);
  of.momentum = absl::GetFlag(FLAGS_momentum);
  of.nesterov = absl::GetFlag(FLAGS_nesterov);
  of.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  of.schedule = absl::GetFlag(FLAGS_lr_schedule);
  of.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  SHARDPS_ASSIGN_OR_RETURN(v1::OptimizerSpec optimizer,
                           MakeOptimizerSpec(of, total_steps));
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<Backend> backend,
      MakeBackend(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_threads)));
  LogInfo("rank %d of %d, backend %s, %d servers", o.rank, o.num_workers,
          backend->name(), co.servers.size());
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Create(co));
  Trainer trainer(o, std::move(model), std::move(train), std::move(test),
                  std::move(backend), std::move(client), optimizer);
  SHARDPS_ASSIGN_OR_RETURN(TrainResult result, trainer.Run());
  LogInfo("done: epoch %d step %d train_loss %.4f%s", result.epoch, result.step,
          result.train_loss,
          result.test_accuracy >= 0
              ? absl::StrFormat(" test_accuracy %.4f", result.test_accuracy)
              : "");
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardps::worker

int main(int argc, char** argv) {
  shardps::ParseDaemonFlags(
      argc, argv,
      "trains one data-parallel worker of a shardps job.\n"
      "  shardps-worker --servers=127.0.0.1:5000,127.0.0.1:5001 --rank=0 "
      "--num_workers=2");
  return shardps::ExitCode(shardps::worker::Run());
}
