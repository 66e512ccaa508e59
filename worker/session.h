// A Session is one worker process's part in a job whose training loop is
// not shardps-worker's (the PyTorch layer, worker/python): it joins the job
// (with a coordinator, heartbeating in the background), declares the model
// with its initial values, pushes each step tensor by tensor and, when the
// job rolls back or drops this worker, gets back in step as shardps-worker
// does (worker/recovery.h). Thread-compatible: one caller at a time.
#ifndef SHARDPS_WORKER_SESSION_H_
#define SHARDPS_WORKER_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "coordinator/client/coordinator_client.h"
#include "worker/client.h"
#include "worker/compression.h"
#include "worker/recovery.h"

namespace shardps::worker {

struct SessionOptions {
  // With a coordinator (host:port): the job to join and the rank asked for
  // (-1: any free one). Static (coordinator empty): the servers in shard
  // order, the rank (-1: 0) and the job's size (unset: 1).
  std::string coordinator;
  std::string job_id = "default";
  std::vector<std::string> servers;
  int32_t rank = -1;
  std::optional<uint32_t> num_workers;
  SecurityOptions security;
  int streams_per_shard = 2;
  int receive_buffer_bytes = 0;     // ClientOptions::receive_buffer_bytes
  bool shared_memory = true;        // ClientOptions::shared_memory
  bool speculative_weights = true;  // ClientOptions::speculative_weights
  Compression compression;          // on the wire (ClientOptions)
  // How long to wait for the coordinator, the other members and the
  // servers to come up; and how long one step may take.
  absl::Duration connect_timeout = absl::Seconds(120);
  absl::Duration rpc_timeout = absl::Seconds(300);
  RecoveryOptions recovery;
  // Shown in the coordinator's view (default: host/pid).
  std::string label;
};

class Session {
 public:
  // Joins the job and waits until it can take this worker. InvalidArgument
  // for bad options; DeadlineExceeded when the coordinator or the members
  // did not come within connect_timeout; the coordinator's refusals as
  // they are (a full job, a wrong job id).
  static absl::StatusOr<std::unique_ptr<Session>> Start(SessionOptions options);
  // Leaves the job unless Finish was called (the coordinator then stops
  // waiting for this rank).
  ~Session();

  uint32_t rank() const { return rank_; }
  uint32_t num_workers() const { return num_workers_; }
  const std::vector<std::string>& servers() const { return servers_; }
  bool coordinated() const { return coordinator_ != nullptr; }
  // This worker does rank 0's duties (evaluating, writing the model): the
  // lowest rank still in the job.
  bool IsLead() const;

  // Declares the model on every shard. `weights` are the caller's buffers
  // that hold the job's weights from now on (they must keep their size and
  // outlive the session): filled with the servers' copy here, after every
  // step and after a recovery. `initial` holds the values of the tensors
  // whose InitSpec is KIND_PROVIDED; rank 0 sends them (the first values a
  // shard gets win), other ranks may pass none and wait for them. A process
  // new to a running job takes the weights in StartEpochs instead.
  // The codes of Client::Declare, Initialize and PullWhenReady.
  absl::Status Declare(const v1::Layout& layout,
                       const v1::OptimizerSpec& optimizer,
                       const ConstTensors& initial, Tensors weights);
  // After Declare: `steps_per_epoch` (> 0) of the data order, so that a
  // worker joining a running job starts at an epoch start. A process new
  // to a running job joins here (waits until the job gets there and takes
  // the weights). Returns the step to go on from (step()).
  absl::StatusOr<int64_t> StartEpochs(int64_t steps_per_epoch);
  // The step pushed next: the job's step this worker is at.
  int64_t step() const { return step_; }
  // The ranks sharing the global batch now, ascending, this one included
  // (as the servers wait for them; else the coordinator's view).
  std::vector<uint32_t> ActiveRanks();

  // One step, tensor by tensor (see Client::BeginStep; `options` makes it
  // a two-phase step: clipping, loss scaling).
  absl::Status BeginStep(const StepOptions& options = {});
  absl::Status PushTensor(int tensor, absl::Span<const float> gradient,
                          const StepHyperparameters& hyperparameters);
  absl::Status PushNoGradient(int tensor,
                              const StepHyperparameters& hyperparameters);
  // Waits for the open step's replies. True: the weights are the job's
  // after the step and step() advanced. False: the job rolled back, or
  // dropped this worker and it joined again: the weights are the job's at
  // step(), from where the loop goes on. Errors: those of
  // Client::FinishStep that recovery cannot explain.
  absl::StatusOr<bool> FinishStep();
  // Two-phase steps, after every push: Client::GradNorm. None when the step
  // failed and the job went back (or on): FinishStep then returns false at
  // once. Errors: those of Client::GradNorm that recovery cannot explain.
  absl::StatusOr<std::optional<double>> GradNorm();
  void AbortStep();
  bool step_open() const { return client_->step_open(); }

  // One collective over the job's live workers (rpc Collective in
  // coordinator.proto): every rank calls the same ones in the same order.
  // `values` holds this rank's tensor (raw little-endian, as the request's
  // dtype and shape say; empty for a barrier and for a broadcast off src)
  // and receives the result. The sequence number is the session's own
  // count. Without a coordinator a job of one worker answers locally (the
  // result of one rank is its own values); a larger static job has no one
  // to match the calls: FailedPrecondition. The codes of rpc Collective.
  absl::StatusOr<std::string> Collective(v1::CollectiveOp op,
                                         v1::CollectiveDtype dtype,
                                         const std::vector<int64_t>& shape,
                                         std::string values, int32_t src,
                                         absl::Duration timeout);

  // Tells the coordinator how far training got (for `shardps-ctl status`
  // and for workers that join later). No-op without a coordinator.
  void SetProgress(int64_t step, int64_t epoch);
  // This rank completed its training (the job ends when every rank has);
  // afterwards the session may not push. No-op without a coordinator.
  absl::Status Finish();
  // This rank leaves the job (its steps stop waiting for it).
  absl::Status Leave();

  Client& client() { return *client_; }

 private:
  Session() = default;
  // Recovery for the current steps_per_epoch_ (made when first needed).
  Recovery& recovery();

  SessionOptions options_;
  std::unique_ptr<coordinator::CoordinatorClient> coordinator_;
  uint32_t rank_ = 0;
  uint32_t num_workers_ = 1;
  std::vector<std::string> servers_;
  std::unique_ptr<Client> client_;
  Tensors weights_;
  std::unique_ptr<Recovery> recovery_;
  int64_t steps_per_epoch_ = 1;
  int64_t step_ = 0;
  uint64_t collectives_ = 0;  // called so far: the last sequence number
  bool done_ = false;         // Finish or Leave was called
  // GradNorm lost the open step to a recovery: FinishStep returns false.
  bool recovered_ = false;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_SESSION_H_
