// shardps-worker: one data-parallel worker of a shardps job. Static mode:
// --servers, --rank and --num_workers on the command line. With --coordinator
// it joins the job there, takes its rank, the job's size and the servers'
// addresses from the coordinator, waits until every member is present, and
// tells the coordinator when it finished. Flag parsing only: the run is
// RunWorker's (worker/worker_job.h).
#include <memory>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security_flags.h"
#include "common/status.h"
#include "common/transport.h"
#include "coordinator/client/member_flags.h"
#include "worker/training_flags.h"
#include "worker/worker_job.h"
#include "worker/worker_metrics.h"

ABSL_FLAG(std::string, servers, "",
          "Parameter servers, shard 0 first: host:port,host:port,... "
          "(static mode; with --coordinator the coordinator tells them).");
ABSL_FLAG(int32_t, rank, -1,
          "This worker's rank in [0, num_workers); -1: any free one (with "
          "--coordinator), else 0.");
ABSL_FLAG(std::optional<uint32_t>, num_workers, std::nullopt,
          "Number of workers in the job; unset: the coordinator's "
          "--num_workers, else 1.");
ABSL_FLAG(std::string, metrics_csv, "",
          "The lead (rank 0, or with --coordinator the lowest rank left): "
          "append one row per epoch to this CSV file.");
ABSL_FLAG(std::string, model_out, "",
          "The lead (rank 0, or with --coordinator the lowest rank left): "
          "write the final model here (safetensors).");
ABSL_FLAG(int32_t, fault_step_delay_ms, 0,
          "Testing only: pause this long before every step (a slow worker).");
ABSL_FLAG(int32_t, connect_timeout_s, 120,
          "How long to wait for the servers to come up (and, with "
          "--coordinator, to join and for every member to join).");

namespace shardps::worker {
namespace {

// The training options but rank and job size (which may come from the
// coordinator); InvalidArgument for a bad flag.
absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags() {
  SHARDPS_ASSIGN_OR_RETURN(const TrainingFlagValues v,
                           TrainingFlagValuesFromFlags());
  TrainerOptions o;
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.epochs = v.epochs;
  o.max_steps = v.max_steps;
  o.seed = absl::GetFlag(FLAGS_seed);
  o.eval_every_epochs = v.eval_every_epochs;
  o.step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_fault_step_delay_ms));
  o.clip_grad_norm = v.clip_grad_norm;
  o.chunk_bytes = v.chunk_bytes;
  o.link_bits_per_second = v.link_bits_per_second;
  // Written by the lead worker only.
  o.metrics_csv = absl::GetFlag(FLAGS_metrics_csv);
  o.model_out = absl::GetFlag(FLAGS_model_out);
  return o;
}

OptimizerFlags OptimizerFromFlags() {
  OptimizerFlags of;
  of.name = absl::GetFlag(FLAGS_optimizer);
  of.lr = absl::GetFlag(FLAGS_lr);
  of.momentum = absl::GetFlag(FLAGS_momentum);
  of.nesterov = absl::GetFlag(FLAGS_nesterov);
  of.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  of.schedule = absl::GetFlag(FLAGS_lr_schedule);
  of.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  return of;
}

absl::Status Run() {
  SHARDPS_RETURN_IF_ERROR(coordinator::CheckMemberFlags());
  const bool json = absl::GetFlag(FLAGS_log_format) == "json";
  WorkerJobOptions o;
  o.rank = absl::GetFlag(FLAGS_rank);
  o.num_workers = absl::GetFlag(FLAGS_num_workers);
  o.servers =
      absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty());
  if (coordinator::UseCoordinator()) {
    o.coordinator = absl::GetFlag(FLAGS_coordinator);
    o.job_id = absl::GetFlag(FLAGS_job_id);
    o.incarnation = ProcessIncarnation();
    o.label = ProcessLabel();
  }
  o.dataset = absl::GetFlag(FLAGS_dataset);
  o.train_limit = absl::GetFlag(FLAGS_train_limit);
  o.test_limit = absl::GetFlag(FLAGS_test_limit);
  o.model = absl::GetFlag(FLAGS_model);
  o.optimizer = OptimizerFromFlags();
  o.backend = absl::GetFlag(FLAGS_backend);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
  o.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  o.speculative_weights = absl::GetFlag(FLAGS_speculative_weights);
  SHARDPS_ASSIGN_OR_RETURN(o.compression, CompressionFromFlags());
  o.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  SHARDPS_ASSIGN_OR_RETURN(o.trainer, TrainerOptionsFromFlags());
  if (o.trainer.link_bits_per_second > 0) {
    o.receive_buffer_bytes =
        ReceiveBufferBytesForLink(o.trainer.link_bits_per_second);
  }
  SHARDPS_ASSIGN_OR_RETURN(o.security, SecurityOptionsFromFlags());
  InitLog("worker", o.rank, json);
  // Only the calling thread logs; the coordinator client's threads never do.
  o.on_rank = [json](uint32_t rank) {
    InitLog("worker", static_cast<int>(rank), json);
  };
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsExporter> exporter,
                           ServeMetricsFromFlags());
  std::unique_ptr<WorkerMetrics> metrics;
  if (exporter != nullptr) {
    metrics = std::make_unique<WorkerMetrics>(exporter->registry());
    o.trainer.metrics = metrics.get();
  }
  return RunWorker(std::move(o));
}

}  // namespace
}  // namespace shardps::worker

int main(int argc, char** argv) {
  shardps::ParseDaemonFlags(
      argc, argv,
      "trains one data-parallel worker of a shardps job.\n"
      "  shardps-worker --servers=127.0.0.1:5000,127.0.0.1:5001 --rank=0 "
      "--num_workers=2\n"
      "  shardps-worker --coordinator=127.0.0.1:7000");
  return shardps::ExitCode(shardps::worker::Run());
}
