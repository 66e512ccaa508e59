#include "worker/worker_job.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/client/cluster_view.h"
#include "coordinator/client/join_job.h"

namespace shardps::worker {
namespace {

// Where this worker stands in the job.
struct Placement {
  uint32_t rank = 0;
  uint32_t num_workers = 1;
  std::vector<std::string> servers;  // shard order
};

absl::StatusOr<Placement> StaticPlacement(const WorkerJobOptions& o) {
  Placement p;
  p.rank = static_cast<uint32_t>(std::max(o.rank, 0));
  p.num_workers = o.num_workers.value_or(1);
  if (p.rank >= p.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank=", p.rank, " must be below --num_workers=", p.num_workers));
  }
  p.servers = o.servers;
  if (p.servers.empty()) {
    return absl::InvalidArgumentError(
        "--servers is empty: give the parameter servers as host:port,... or "
        "--coordinator=host:port");
  }
  return p;
}

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

struct TrainingData {
  Dataset train;
  std::optional<Dataset> test;
};

// The training set and, for a worker that may lead, the test set when there
// is one. With a coordinator any rank may become the lead (the lowest rank
// left takes over when rank 0 dies), and loading the test set only then
// would put a file read and a parse in the middle of the job's epoch end:
// every rank loads it at the start (it is small: Fashion-MNIST's is a sixth
// of the training set). A static job's lead is always rank 0.
absl::StatusOr<TrainingData> LoadData(const WorkerJobOptions& o,
                                      bool may_lead) {
  SHARDPS_ASSIGN_OR_RETURN(Dataset train, LoadDatasetSpec(o.dataset, true));
  if (o.train_limit > 0) train.Truncate(o.train_limit);
  TrainingData data{std::move(train), std::nullopt};
  if (may_lead) {
    absl::StatusOr<Dataset> loaded =
        LoadDatasetSpec(o.dataset, false,
                        {data.train.num_features(), data.train.num_classes()});
    if (loaded.ok()) {
      data.test = *std::move(loaded);
      if (o.test_limit > 0) data.test->Truncate(o.test_limit);
    } else if (absl::IsNotFound(loaded.status())) {
      LogWarning("no test set (%s): training without evaluation",
                 loaded.status().message());
    } else {
      return loaded.status();
    }
  }
  LogInfo("dataset %s: %d training samples, %d features, %d classes", o.dataset,
          data.train.num_samples(), data.train.num_features(),
          data.train.num_classes());
  return data;
}

// Loads the data, waits for the cluster (with a coordinator), trains.
absl::Status Train(const WorkerJobOptions& options, Placement placement,
                   coordinator::CoordinatorClient* coordinator) {
  TrainerOptions o = options.trainer;
  o.rank = placement.rank;
  o.num_workers = placement.num_workers;
  SHARDPS_ASSIGN_OR_RETURN(
      TrainingData data,
      LoadData(options, coordinator != nullptr || placement.rank == 0));
  SHARDPS_ASSIGN_OR_RETURN(
      ModelSpec model, ParseModelSpec(options.model, data.train.num_features(),
                                      data.train.num_classes()));
  SHARDPS_ASSIGN_OR_RETURN(
      int64_t steps_per_epoch,
      StepsPerEpoch(data.train.num_samples(), o.batch_size, o.num_workers));
  int64_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
  SHARDPS_ASSIGN_OR_RETURN(v1::OptimizerSpec optimizer,
                           MakeOptimizerSpec(options.optimizer, total_steps));
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           MakeBackend(options.backend, options.threads));
  uint64_t incarnation = 0;  // static mode: none
  if (coordinator != nullptr) {
    SHARDPS_ASSIGN_OR_RETURN(
        placement.servers,
        WaitForCluster(*coordinator, options.connect_timeout));
    o.on_step = [coordinator](int64_t step, int epoch) {
      coordinator->SetProgress(step, epoch);
    };
    const uint32_t rank = o.rank;
    o.active_ranks = [coordinator] { return AliveRanks(coordinator->view()); };
    o.lead = [coordinator, rank] {
      return LeadRank(coordinator->view(), rank) == rank;
    };
    incarnation = options.incarnation;
    o.rejoin_when_dropped = true;
    o.rollback = [coordinator] {
      const v1::ClusterView view = coordinator->view();
      return std::make_pair(view.rollback_id(), view.rollback_step());
    };
  }
  const ClientOptions co =
      MemberClientOptions(options, placement.servers, o.rank, incarnation);
  LogInfo("rank %d of %d, backend %s, %d servers, %s, %s on the wire", o.rank,
          o.num_workers, backend->name(), co.servers.size(),
          DescribeClientSecurity(options.security),
          CompressionName(options.compression));
  if (co.receive_buffer_bytes > 0) {
    LogInfo(
        "every connection to a server has a %.1f KiB TCP receive buffer "
        "(2.5 ms of the link)",
        co.receive_buffer_bytes / 1024.0);
  }
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Create(co));
  Trainer trainer(o, std::move(model), std::move(data.train),
                  std::move(data.test), std::move(backend), std::move(client),
                  optimizer);
  SHARDPS_ASSIGN_OR_RETURN(TrainResult result, trainer.Run());
  LogInfo("done: epoch %d step %d train_loss %.4f%s", result.epoch, result.step,
          result.train_loss,
          result.test_accuracy >= 0
              ? absl::StrFormat(" test_accuracy %.4f", result.test_accuracy)
              : "");
  return absl::OkStatus();
}

// Joins, trains, and tells the coordinator this rank finished (or leaves,
// after a failure).
absl::Status RunCoordinated(const WorkerJobOptions& o) {
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<coordinator::CoordinatorClient> coordinator,
      JoinAsWorker(o.coordinator, o.job_id, o.rank, o.incarnation, o.security,
                   o.label, o.connect_timeout));
  Placement placement;
  placement.rank = coordinator->index();
  placement.num_workers = coordinator->view().num_workers();
  if (o.on_rank) o.on_rank(placement.rank);
  LogInfo("joined job %s as rank %d of %d (%s)", o.job_id, placement.rank,
          placement.num_workers,
          coordinator::DescribeView(coordinator->view()));
  absl::Status status =
      o.num_workers.has_value() && *o.num_workers != placement.num_workers
          ? absl::FailedPreconditionError(absl::StrCat(
                "--num_workers=", *o.num_workers, " but job ", o.job_id,
                " has ", placement.num_workers, " workers"))
          : Train(o, std::move(placement), coordinator.get());
  if (!status.ok()) {
    coordinator->Leave(absl::Now() + o.leave_timeout).IgnoreError();
    return status;
  }
  SHARDPS_RETURN_IF_ERROR(coordinator->Finish(absl::Now() + o.finish_timeout));
  LogInfo("told the coordinator that rank %d finished", coordinator->index());
  return absl::OkStatus();
}

}  // namespace

std::vector<uint32_t> AliveRanks(const v1::ClusterView& view) {
  std::vector<uint32_t> ranks;
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.alive()) ranks.push_back(w.rank());
  }
  return ranks;
}

uint32_t LeadRank(const v1::ClusterView& view, uint32_t self) {
  for (const v1::WorkerSlot& w : view.workers()) {
    if (w.alive() || w.finished() || w.rank() == self) return w.rank();
  }
  return self;
}

bool ReadyToJoin(const v1::ClusterView& view) {
  if (coordinator::ReadyToTrain(view)) return true;
  if (view.global_step() == 0) return false;
  for (const v1::ServerSlot& s : view.servers()) {
    if (!s.alive()) return false;
  }
  return true;
}

absl::StatusOr<std::vector<std::string>> WaitForCluster(
    const coordinator::CoordinatorClient& client, absl::Duration timeout,
    absl::Duration log_every) {
  const absl::Time deadline = absl::Now() + timeout;
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
          absl::ToInt64Seconds(timeout), ": ", view.status().message()));
    }
    view = client.WaitForView(ReadyToJoin,
                              std::min(deadline, absl::Now() + log_every));
  }
  std::vector<std::string> servers;
  for (const v1::ServerSlot& s : view->servers()) {
    servers.push_back(s.address());
  }
  LogInfo("every member joined (%s): training with %d server(s)",
          coordinator::DescribeView(*view), servers.size());
  return servers;
}

absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> JoinAsWorker(
    const std::string& coordinator, const std::string& job_id, int32_t rank,
    uint64_t incarnation, const SecurityOptions& security,
    const std::string& label, absl::Duration timeout) {
  coordinator::JoinOptions join;
  join.client.coordinator = coordinator;
  join.client.incarnation = incarnation;
  join.client.security = security;
  join.role = v1::ROLE_WORKER;
  join.address = label;
  join.requested_index = rank;
  join.job_id = job_id;
  join.timeout = timeout;
  join.on_retry = [](const std::string& line) { LogInfo("%s", line); };
  LogInfo("joining job %s at coordinator %s, rank %s", job_id, coordinator,
          rank < 0 ? "any" : absl::StrCat(rank));
  return coordinator::JoinJob(std::move(join));
}

uint64_t ProcessIncarnation() {
  return static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
}

std::string ProcessLabel() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  return absl::StrCat(name[0] != '\0' ? name : "worker", "/", getpid());
}

absl::Status RunWorker(WorkerJobOptions options) {
  if (options.rank < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank=", options.rank, " must be -1 (any) or at least 0"));
  }
  if (!options.coordinator.empty() && !options.servers.empty()) {
    return absl::InvalidArgumentError(
        "give either --servers (static mode) or --coordinator, not both");
  }
  if (!options.coordinator.empty()) return RunCoordinated(options);
  SHARDPS_ASSIGN_OR_RETURN(Placement placement, StaticPlacement(options));
  if (options.on_rank) options.on_rank(placement.rank);
  return Train(options, std::move(placement), nullptr);
}

}  // namespace shardps::worker
