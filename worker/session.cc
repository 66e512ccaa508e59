#include "worker/session.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/client/cluster_view.h"
#include "coordinator/collective_reduce.h"
#include "worker/worker_job.h"

namespace shardps::worker {
namespace {

// A loop driven from outside has no planned end: a worker that rejoins
// goes to the next epoch start whatever it is.
constexpr int64_t kNoLastStep = std::numeric_limits<int64_t>::max() / 4;

// Leaving is a courtesy (the lease expires anyway); finishing is what ends
// the job, worth waiting for.
constexpr absl::Duration kLeaveTimeout = absl::Seconds(3);
constexpr absl::Duration kFinishTimeout = absl::Seconds(60);

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Start(
    SessionOptions options) {
  if (options.rank < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " must be -1 (any) or >= 0"));
  }
  if (!options.coordinator.empty() && !options.servers.empty()) {
    return absl::InvalidArgumentError(
        "give either the servers (a static job) or a coordinator, not both");
  }
  if (options.coordinator.empty() && options.servers.empty()) {
    return absl::InvalidArgumentError(
        "no coordinator and no servers given: set SHARDPS_COORDINATOR "
        "(host:port) or SHARDPS_SERVERS (host:port,...)");
  }
  if (options.label.empty()) options.label = ProcessLabel();
  const uint64_t incarnation =
      options.coordinator.empty() ? 0 : ProcessIncarnation();
  std::unique_ptr<Session> session(new Session);
  Session& s = *session;
  if (options.coordinator.empty()) {
    s.rank_ = static_cast<uint32_t>(std::max(options.rank, 0));
    s.num_workers_ = options.num_workers.value_or(1);
    if (s.rank_ >= s.num_workers_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", s.rank_, " must be below the job's ",
                       s.num_workers_, " workers"));
    }
    s.servers_ = options.servers;
  } else {
    SHARDPS_ASSIGN_OR_RETURN(
        s.coordinator_,
        JoinAsWorker(options.coordinator, options.job_id, options.rank,
                     incarnation, options.security, options.label,
                     options.connect_timeout));
    s.rank_ = s.coordinator_->index();
    s.num_workers_ = s.coordinator_->view().num_workers();
    LogInfo("joined job %s as rank %d of %d (%s)", options.job_id, s.rank_,
            s.num_workers_, coordinator::DescribeView(s.coordinator_->view()));
    if (options.num_workers.has_value() &&
        *options.num_workers != s.num_workers_) {
      s.Leave().IgnoreError();
      return absl::FailedPreconditionError(absl::StrCat(
          "this worker expects ", *options.num_workers, " workers but job ",
          options.job_id, " has ", s.num_workers_));
    }
    absl::StatusOr<std::vector<std::string>> servers =
        WaitForCluster(*s.coordinator_, options.connect_timeout);
    if (!servers.ok()) {
      s.Leave().IgnoreError();
      return servers.status();
    }
    s.servers_ = *std::move(servers);
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(
      MemberClientOptions(options, s.servers_, s.rank_, incarnation));
  if (!client.ok()) {
    s.Leave().IgnoreError();
    return client.status();
  }
  s.client_ = *std::move(client);
  s.options_ = std::move(options);
  return session;
}

Session::~Session() {
  if (client_ != nullptr) client_->AbortStep();
  if (!done_) Leave().IgnoreError();
}

bool Session::IsLead() const {
  if (coordinator_ == nullptr) return rank_ == 0;
  return LeadRank(coordinator_->view(), rank_) == rank_;
}

absl::Status Session::Declare(const v1::Layout& layout,
                              const v1::OptimizerSpec& optimizer,
                              const ConstTensors& initial, Tensors weights) {
  SHARDPS_RETURN_IF_ERROR(client_->Declare(layout, optimizer));
  LogInfo("%s", client_->DescribeTransport());
  weights_ = std::move(weights);
  recovery_.reset();
  bool provided = false;
  for (const v1::TensorSpec& t : layout.tensors()) {
    provided = provided || t.init().kind() == v1::InitSpec::KIND_PROVIDED;
  }
  step_ = client_->start_step();
  if (client_->must_join()) return absl::OkStatus();  // StartEpochs joins
  bool awaiting = false;
  for (const v1::DeclareResponse& r : client_->declared()) {
    awaiting = awaiting || r.awaiting_values();
  }
  if (provided && awaiting && rank_ == 0) {
    if (initial.empty()) {
      return absl::InvalidArgumentError(
          "rank 0 declares a model with provided initial values but gave "
          "none");
    }
    LogInfo("sending the model's initial values (%d tensors)",
            layout.tensors_size());
    return client_->Initialize(initial, weights_);
  }
  return client_->PullWhenReady(weights_, options_.connect_timeout);
}

Recovery& Session::recovery() {
  if (recovery_ == nullptr) {
    RollbackNews rollback;
    if (coordinator_ != nullptr) {
      coordinator::CoordinatorClient* c = coordinator_.get();
      rollback = [c] {
        const v1::ClusterView view = c->view();
        return std::make_pair(view.rollback_id(), view.rollback_step());
      };
    }
    recovery_ = std::make_unique<Recovery>(
        options_.recovery, client_.get(), weights_, steps_per_epoch_,
        kNoLastStep, rollback, /*rejoin_when_dropped=*/coordinator_ != nullptr);
    recovery_->Start();
  }
  return *recovery_;
}

absl::StatusOr<int64_t> Session::StartEpochs(int64_t steps_per_epoch) {
  if (steps_per_epoch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an epoch must have at least one step, got ", steps_per_epoch));
  }
  if (client_->declared().empty()) {
    return absl::FailedPreconditionError("StartEpochs before Declare");
  }
  if (steps_per_epoch != steps_per_epoch_) recovery_.reset();
  steps_per_epoch_ = steps_per_epoch;
  if (client_->must_join()) {
    SHARDPS_ASSIGN_OR_RETURN(step_, recovery().JoinRunningJob());
    SHARDPS_RETURN_IF_ERROR(
        client_->PullWhenReady(weights_, options_.connect_timeout));
    LogInfo("joined the running job at step %d", step_);
  }
  return step_;
}

std::vector<uint32_t> Session::ActiveRanks() {
  std::function<std::vector<uint32_t>()> view_ranks;
  if (coordinator_ != nullptr) {
    coordinator::CoordinatorClient* c = coordinator_.get();
    view_ranks = [c] { return AliveRanks(c->view()); };
  }
  return RanksSharingTheBatch(client_.get(), view_ranks, num_workers_, rank_);
}

absl::Status Session::BeginStep(const StepOptions& options) {
  if (done_) {
    return absl::FailedPreconditionError(
        "this worker already finished or left the job");
  }
  recovery();  // knows the job's rollback before the first push
  recovered_ = false;
  return client_->BeginStep(step_, weights_, options);
}

absl::StatusOr<std::optional<double>> Session::GradNorm() {
  if (recovered_) return std::nullopt;
  if (client_->tensors_left() > 0 || !client_->step_open()) {
    return client_->GradNorm();  // the caller's to fix
  }
  absl::StatusOr<double> norm = client_->GradNorm();
  if (norm.ok()) return *norm;
  SHARDPS_ASSIGN_OR_RETURN(step_, recovery().Recover(norm.status(), step_));
  LogInfo("step failed (%s): going on from step %d", norm.status().message(),
          step_);
  recovered_ = true;
  return std::nullopt;
}

absl::Status Session::PushTensor(int tensor, absl::Span<const float> gradient,
                                 const StepHyperparameters& hyperparameters) {
  return client_->PushTensor(tensor, gradient, hyperparameters);
}

absl::Status Session::PushNoGradient(
    int tensor, const StepHyperparameters& hyperparameters) {
  return client_->PushNoGradient(tensor, hyperparameters);
}

absl::StatusOr<bool> Session::FinishStep() {
  if (recovered_) {
    recovered_ = false;
    return false;
  }
  // A tensor not pushed is the caller's to fix; the job's refusals (a
  // rollback, a drop) are recovered from.
  if (client_->tensors_left() > 0) return client_->FinishStep();
  const absl::Status pushed = client_->FinishStep();
  if (pushed.ok()) {
    ++step_;
    return true;
  }
  SHARDPS_ASSIGN_OR_RETURN(step_, recovery().Recover(pushed, step_));
  LogInfo("step failed (%s): going on from step %d", pushed.message(), step_);
  return false;
}

void Session::AbortStep() { client_->AbortStep(); }

absl::StatusOr<std::string> Session::Collective(
    v1::CollectiveOp op, v1::CollectiveDtype dtype,
    const std::vector<int64_t>& shape, std::string values, int32_t src,
    absl::Duration timeout) {
  v1::CollectiveRequest request;
  request.set_sequence(++collectives_);
  request.set_op(op);
  request.set_dtype(dtype);
  for (int64_t d : shape) request.add_shape(d);
  request.set_src(src);
  request.set_timeout_ms(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  if (coordinator_ == nullptr) {
    if (num_workers_ > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "collectives go through the coordinator, and this static job of ",
          num_workers_,
          " workers has none: start it with a coordinator "
          "(SHARDPS_COORDINATOR, as shardps-local does)"));
    }
    request.set_values(values);
    SHARDPS_RETURN_IF_ERROR(coordinator::ValidateCollective(request, rank_));
    return values;  // the result over one rank
  }
  request.set_values(std::move(values));
  SHARDPS_ASSIGN_OR_RETURN(v1::CollectiveResponse response,
                           coordinator_->Collective(std::move(request)));
  return std::move(*response.mutable_values());
}

void Session::SetProgress(int64_t step, int64_t epoch) {
  if (coordinator_ != nullptr) coordinator_->SetProgress(step, epoch);
}

absl::Status Session::Finish() {
  if (done_) return absl::OkStatus();
  done_ = true;
  if (coordinator_ == nullptr) return absl::OkStatus();
  SHARDPS_RETURN_IF_ERROR(coordinator_->Finish(absl::Now() + kFinishTimeout));
  LogInfo("told the coordinator that rank %d finished", rank_);
  return absl::OkStatus();
}

absl::Status Session::Leave() {
  if (done_) return absl::OkStatus();
  done_ = true;
  if (coordinator_ == nullptr) return absl::OkStatus();
  return coordinator_->Leave(absl::Now() + kLeaveTimeout);
}

}  // namespace shardps::worker
