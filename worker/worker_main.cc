// shardps-worker: one data-parallel worker of a shardps job. Static mode:
// --servers, --rank and --num_workers on the command line. With --coordinator
// it joins the job there, takes its rank, the job's size and the servers'
// addresses from the coordinator, waits until every member is present, and
// tells the coordinator when it finished.
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/daemon_flags.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security_flags.h"
#include "common/status.h"
#include "server/coordinator/coordinator_client.h"
#include "server/coordinator/member_flags.h"
#include "worker/trainer.h"
#include "worker/training_flags.h"

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
          "Rank 0: append one row per epoch to this CSV file.");
ABSL_FLAG(std::string, model_out, "",
          "Rank 0: write the final model here (safetensors).");
ABSL_FLAG(int32_t, fault_step_delay_ms, 0,
          "Testing only: pause this long before every step (a slow worker).");
ABSL_FLAG(int32_t, connect_timeout_s, 120,
          "How long to wait for the servers to come up (and, with "
          "--coordinator, to join and for every member to join).");

namespace shardps::worker {
namespace {

// How often a worker waiting for the job's other members says so.
constexpr absl::Duration kWaitLogInterval = absl::Seconds(3);
// Leaving after a failure is a courtesy (the lease would expire anyway).
constexpr absl::Duration kLeaveTimeout = absl::Seconds(3);
// Telling the coordinator this worker finished is what ends the job.
constexpr absl::Duration kFinishTimeout = absl::Seconds(60);

// Where this worker stands in the job.
struct Placement {
  uint32_t rank = 0;
  uint32_t num_workers = 1;
  std::vector<std::string> servers;  // shard order
};

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

// The training options but rank and job size (which may come from the
// coordinator); InvalidArgument for a bad flag.
absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags() {
  TrainerOptions o;
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.epochs = absl::GetFlag(FLAGS_epochs);
  o.max_steps = absl::GetFlag(FLAGS_max_steps);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.eval_every_epochs = absl::GetFlag(FLAGS_eval_every_epochs);
  o.step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_fault_step_delay_ms));
  const int64_t chunk_kib = absl::GetFlag(FLAGS_chunk_kib);
  if (o.epochs < 1 || o.eval_every_epochs < 1 || o.max_steps < 0 ||
      chunk_kib < 1 || chunk_kib > (64 << 10)) {
    return absl::InvalidArgumentError(
        "--epochs and --eval_every_epochs must be >= 1, --max_steps >= 0, "
        "--chunk_kib in [1, 65536]");
  }
  o.chunk_bytes = static_cast<uint64_t>(chunk_kib) << 10;
  return o;
}

absl::StatusOr<Placement> StaticPlacement() {
  Placement p;
  p.rank = static_cast<uint32_t>(std::max(absl::GetFlag(FLAGS_rank), 0));
  p.num_workers = absl::GetFlag(FLAGS_num_workers).value_or(1);
  if (p.rank >= p.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank=", p.rank, " must be below --num_workers=", p.num_workers));
  }
  p.servers =
      absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty());
  if (p.servers.empty()) {
    return absl::InvalidArgumentError(
        "--servers is empty: give the parameter servers as host:port,... or "
        "--coordinator=host:port");
  }
  return p;
}

// The training set, and (rank 0) the test set when there is one.
absl::StatusOr<std::pair<Dataset, std::optional<Dataset>>> LoadData(
    uint32_t rank) {
  const std::string spec = absl::GetFlag(FLAGS_dataset);
  SHARDPS_ASSIGN_OR_RETURN(Dataset train, LoadDatasetSpec(spec, true));
  if (absl::GetFlag(FLAGS_train_limit) > 0) {
    train.Truncate(absl::GetFlag(FLAGS_train_limit));
  }
  std::optional<Dataset> test;
  if (rank == 0) {
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
  return std::make_pair(std::move(train), std::move(test));
}

absl::StatusOr<v1::OptimizerSpec> OptimizerFromFlags(int64_t total_steps) {
  OptimizerFlags of;
  of.name = absl::GetFlag(FLAGS_optimizer);
  of.lr = absl::GetFlag(FLAGS_lr);
  of.momentum = absl::GetFlag(FLAGS_momentum);
  of.nesterov = absl::GetFlag(FLAGS_nesterov);
  of.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  of.schedule = absl::GetFlag(FLAGS_lr_schedule);
  of.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  return MakeOptimizerSpec(of, total_steps);
}

// This process's incarnation (JoinRequest.incarnation): its start time, so
// that a restarted worker's is larger.
uint64_t Incarnation() {
  static const uint64_t incarnation =
      static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  return incarnation;
}

// Workers alive in `view`, ascending.
std::vector<uint32_t> AliveRanks(const v1::ClusterView& view) {
  std::vector<uint32_t> ranks;
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.alive()) ranks.push_back(w.rank());
  }
  return ranks;
}

// The lowest rank still in the job (alive, or finished its training):
// it evaluates and writes the metrics and the model. `self` counts as alive.
uint32_t LeadRank(const v1::ClusterView& view, uint32_t self) {
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.alive() || w.finished() || w.rank() == self) return w.rank();
  }
  return self;
}

// A job can take this worker: every member is there (the first workers
// start together), or the job is under way and every shard is up (a worker
// joining a running job does not wait for ranks that left).
bool ReadyToJoin(const v1::ClusterView& view) {
  if (coordinator::ReadyToTrain(view)) return true;
  if (view.global_step() == 0) return false;
  for (const v1::ServerSlot& s : view.servers()) {
    if (!s.alive()) return false;
  }
  return true;
}

// Waits until every server and every worker has joined (or finished), saying
// what it waits for every few seconds; then takes the servers' addresses.
absl::Status WaitForCluster(const coordinator::CoordinatorClient& client,
                            Placement* placement) {
  const int32_t timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  absl::StatusOr<v1::ClusterView> view = client.WaitForView(
      ReadyToJoin, std::min(deadline, absl::Now() + absl::Milliseconds(10)));
  while (!view.ok()) {
    const v1::ClusterView now = client.view();
    const coordinator::ViewCounts c = coordinator::CountMembers(now);
    LogInfo("waiting for %d server(s) / %d worker(s) to join (%s)",
            now.num_shards() - c.alive_servers,
            now.num_workers() - c.alive_workers - c.finished_workers,
            coordinator::DescribeView(now));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the job's members did not all join within --connect_timeout_s=",
          timeout_s, ": ", view.status().message()));
    }
    view = client.WaitForView(
        ReadyToJoin, std::min(deadline, absl::Now() + kWaitLogInterval));
  }
  placement->servers.clear();
  for (const v1::ServerSlot& s : view->servers()) {
    placement->servers.push_back(s.address());
  }
  LogInfo("every member joined (%s): training with %d server(s)",
          coordinator::DescribeView(*view), placement->servers.size());
  return absl::OkStatus();
}

// Loads the data, waits for the cluster (with a coordinator), trains.
absl::Status Train(TrainerOptions o, Placement placement,
                   coordinator::CoordinatorClient* coordinator,
                   const SecurityOptions& security) {
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsExporter> exporter,
                           ServeMetricsFromFlags());
  std::unique_ptr<WorkerMetrics> metrics;
  if (exporter != nullptr) {
    metrics = std::make_unique<WorkerMetrics>(exporter->registry());
    o.metrics = metrics.get();
  }
  o.rank = placement.rank;
  o.num_workers = placement.num_workers;
  // Written by the lead worker only: rank 0, or with a coordinator the
  // lowest rank still in the job.
  o.metrics_csv = absl::GetFlag(FLAGS_metrics_csv);
  o.model_out = absl::GetFlag(FLAGS_model_out);
  SHARDPS_ASSIGN_OR_RETURN(auto data, LoadData(o.rank));
  auto& [train, test] = data;
  SHARDPS_ASSIGN_OR_RETURN(
      ModelSpec model,
      ParseModelSpec(absl::GetFlag(FLAGS_model), train.num_features(),
                     train.num_classes()));
  SHARDPS_ASSIGN_OR_RETURN(
      int64_t steps_per_epoch,
      StepsPerEpoch(train.num_samples(), o.batch_size, o.num_workers));
  int64_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
  SHARDPS_ASSIGN_OR_RETURN(v1::OptimizerSpec optimizer,
                           OptimizerFromFlags(total_steps));
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<Backend> backend,
      MakeBackend(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_threads)));
  ClientOptions co;
  if (coordinator != nullptr) {
    SHARDPS_RETURN_IF_ERROR(WaitForCluster(*coordinator, &placement));
    o.on_step = [coordinator](int64_t step, int epoch) {
      coordinator->SetProgress(step, epoch);
    };
    const uint32_t rank = o.rank;
    o.active_ranks = [coordinator] { return AliveRanks(coordinator->view()); };
    o.lead = [coordinator, rank] {
      return LeadRank(coordinator->view(), rank) == rank;
    };
    co.incarnation = Incarnation();
    o.rejoin_when_dropped = true;
    o.rollback = [coordinator] {
      const v1::ClusterView view = coordinator->view();
      return std::make_pair(view.rollback_id(), view.rollback_step());
    };
  }
  co.servers = placement.servers;
  co.rank = o.rank;
  co.security = security;
  co.streams_per_shard = absl::GetFlag(FLAGS_streams_per_shard);
  co.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  LogInfo("rank %d of %d, backend %s, %d servers, %s", o.rank, o.num_workers,
          backend->name(), co.servers.size(), DescribeClientSecurity(security));
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

// A label for the coordinator's view: which host and process this is.
std::string WorkerLabel() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  return absl::StrCat(name[0] != '\0' ? name : "worker", "/", getpid());
}

// Joins the job at --coordinator, trains, and tells the coordinator this
// rank finished (or leaves, after a failure).
absl::Status RunCoordinated(const TrainerOptions& o,
                            const SecurityOptions& security, bool json) {
  const int32_t requested = absl::GetFlag(FLAGS_rank);
  InitLog("worker", requested, json);
  coordinator::CoordinatorClientOptions cco;
  cco.coordinator = absl::GetFlag(FLAGS_coordinator);
  cco.incarnation = Incarnation();
  cco.security = security;
  cco.on_retry = [](const absl::Status& reason, absl::Duration wait) {
    LogInfo("not joined yet (%s); retrying in %s", reason.ToString(),
            absl::FormatDuration(wait));
  };
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<coordinator::CoordinatorClient> coordinator,
      coordinator::CoordinatorClient::Create(cco));
  const std::string job = absl::GetFlag(FLAGS_job_id);
  LogInfo("joining job %s at coordinator %s, rank %s", job, cco.coordinator,
          requested < 0 ? "any" : absl::StrCat(requested));
  SHARDPS_RETURN_IF_ERROR(coordinator->Join(
      v1::ROLE_WORKER, WorkerLabel(), requested, job,
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s))));
  Placement placement;
  placement.rank = coordinator->index();
  placement.num_workers = coordinator->view().num_workers();
  // Only this thread logs; the client's threads never do.
  InitLog("worker", static_cast<int>(placement.rank), json);
  LogInfo("joined job %s as rank %d of %d (%s)", job, placement.rank,
          placement.num_workers,
          coordinator::DescribeView(coordinator->view()));
  const std::optional<uint32_t> flag_workers = absl::GetFlag(FLAGS_num_workers);
  absl::Status status =
      flag_workers.has_value() && *flag_workers != placement.num_workers
          ? absl::FailedPreconditionError(
                absl::StrCat("--num_workers=", *flag_workers, " but job ", job,
                             " has ", placement.num_workers, " workers"))
          : Train(o, std::move(placement), coordinator.get(), security);
  if (!status.ok()) {
    coordinator->Leave(absl::Now() + kLeaveTimeout).IgnoreError();
    return status;
  }
  SHARDPS_RETURN_IF_ERROR(coordinator->Finish(absl::Now() + kFinishTimeout));
  LogInfo("told the coordinator that rank %d finished", coordinator->index());
  return absl::OkStatus();
}

absl::Status Run() {
  SHARDPS_RETURN_IF_ERROR(coordinator::CheckMemberFlags());
  const bool json = absl::GetFlag(FLAGS_log_format) == "json";
  if (absl::GetFlag(FLAGS_rank) < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank=", absl::GetFlag(FLAGS_rank),
                     " must be -1 (any) or at least 0"));
  }
  if (coordinator::UseCoordinator() && !absl::GetFlag(FLAGS_servers).empty()) {
    return absl::InvalidArgumentError(
        "give either --servers (static mode) or --coordinator, not both");
  }
  SHARDPS_ASSIGN_OR_RETURN(TrainerOptions o, TrainerOptionsFromFlags());
  SHARDPS_ASSIGN_OR_RETURN(const SecurityOptions security,
                           SecurityOptionsFromFlags());
  if (coordinator::UseCoordinator()) return RunCoordinated(o, security, json);
  SHARDPS_ASSIGN_OR_RETURN(Placement placement, StaticPlacement());
  InitLog("worker", static_cast<int>(placement.rank), json);
  return Train(std::move(o), std::move(placement), nullptr, security);
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
