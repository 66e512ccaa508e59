// The data-parallel training loop of one worker: each step it computes the
// gradient of its slice of the global batch, pushes it to the parameter
// servers and continues with the weights they return. Rank 0 also evaluates,
// writes the per-epoch metrics and the final model. Thread-compatible.
#ifndef SHARDPS_WORKER_TRAINER_H_
#define SHARDPS_WORKER_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/backend.h"
#include "worker/client.h"
#include "worker/dataset.h"
#include "worker/model.h"
#include "worker/worker_metrics.h"

namespace shardps::worker {

struct TrainerOptions {
  uint32_t rank = 0;
  uint32_t num_workers = 1;
  int64_t batch_size = 256;  // global
  int epochs = 10;
  int64_t max_steps = 0;  // 0: no limit
  uint64_t seed = 1;
  int eval_every_epochs = 1;
  uint64_t chunk_bytes = 256 << 10;
  // Rank 0 only; empty: not written.
  std::string metrics_csv;
  std::string model_out;
  // Called after every step with the steps completed and the current epoch
  // (from 1), on the training thread; must not block. May be empty.
  std::function<void(int64_t step, int epoch)> on_step;
  // Testing only: a pause before every step (an artificially slow worker).
  absl::Duration step_delay;
  // The ranks training now, ascending (with a coordinator: those alive in
  // its view). Asked at the start of every epoch: the global batch is split
  // over them, so the data is re-sharded when workers leave or join. Empty
  // function: every rank of num_workers.
  std::function<std::vector<uint32_t>()> active_ranks;
  // Whether this worker does rank 0's duties (evaluation, metrics, the
  // model file): the lowest rank still in the job. Asked at every epoch's
  // end. Empty function: rank 0.
  std::function<bool()> lead;
  // With a coordinator: a worker the servers dropped (it stopped
  // heartbeating long enough to be expired, then came back) joins the job
  // again at the next epoch start instead of failing.
  bool rejoin_when_dropped = false;
  // With a coordinator: the newest job-wide rollback as (rollback id, step)
  // (ClusterView.rollback_id, rollback_step). When a step fails and a newer
  // rollback shows, the worker waits for every shard to be reset, takes the
  // weights and goes on from that step (same data position). Empty
  // function: no rollbacks.
  std::function<std::pair<uint64_t, int64_t>()> rollback;
  // Told about every step; null: no metrics. Must outlive the Trainer.
  WorkerMetrics* metrics = nullptr;
};

// Optimizer settings as given on the command line.
struct OptimizerFlags {
  std::string name = "sgd";
  double lr = 0.1;
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = 0.0;
  std::string schedule = "cosine";  // constant | cosine | step:SIZE:GAMMA
  int64_t warmup_steps = 0;
};

// The server-side optimizer for a run of `total_steps` updates (the cosine
// schedule decays to 0 over them). InvalidArgument naming the bad flag.
absl::StatusOr<v1::OptimizerSpec> MakeOptimizerSpec(const OptimizerFlags& f,
                                                    int64_t total_steps);

// Steps per epoch (the last partial batch is dropped) and checks that the
// batch suits the data and the workers. InvalidArgument otherwise.
absl::StatusOr<int64_t> StepsPerEpoch(int64_t num_samples, int64_t batch_size,
                                      uint32_t num_workers);

// The layout the servers hold for `model`, parameters in Params() order.
v1::Layout ModelLayout(const ModelSpec& model, uint64_t seed,
                       uint64_t chunk_bytes);

struct TrainResult {
  int epoch = 0;
  int64_t step = 0;
  double train_loss = 0.0;
  double test_accuracy = -1.0;  // -1: not evaluated
};

class Trainer {
 public:
  // Takes ownership of everything. `test` may be empty (no evaluation).
  Trainer(TrainerOptions options, ModelSpec model, Dataset train,
          std::optional<Dataset> test, std::unique_ptr<Backend> backend,
          std::unique_ptr<Client> client, v1::OptimizerSpec optimizer);

  // Declares the model, trains, and (rank 0) writes metrics and the model.
  absl::StatusOr<TrainResult> Run();

 private:
  struct EpochStats;
  absl::Status Step(int64_t step, absl::Span<const int64_t> indices,
                    EpochStats* stats);
  absl::StatusOr<EvalResult> Evaluate();
  // A worker new to a running job: declares the first epoch start the
  // servers have not passed as its join step, waits for the job to get
  // there and returns that step.
  absl::StatusOr<int64_t> JoinRunningJob(int64_t steps_per_epoch,
                                         int64_t total_steps);
  // After a step failed with `why`: when the job rolled back, the
  // rollback's step once every shard is there; when the servers dropped
  // this worker, declares again and returns the epoch start it joins at;
  // otherwise (or when neither shows within a while) returns `why`.
  // `at`: the step that failed.
  absl::StatusOr<int64_t> Recover(const absl::Status& why, int64_t at,
                                  int64_t steps_per_epoch, int64_t total_steps);
  // Waits until every shard applied rollback `id` to `step`, then takes
  // the weights (true). False when every shard applied it long ago (it
  // needed no reset, or the job moved on): nothing to go back to. `at`: the
  // step this worker was at.
  absl::StatusOr<bool> AwaitRollback(uint64_t id, int64_t step, int64_t at);
  // Waits until every chunk of every shard is at `step` at least, declaring
  // the join at `step` again now and then; tolerates shards that are away
  // for a while.
  absl::Status AwaitJobAt(int64_t step);
  // The ranks sharing this epoch's batches (including this one).
  std::vector<uint32_t> EpochRanks() const;
  absl::Status WriteMetricsRow(int epoch, int64_t step, const EpochStats& s,
                               absl::Duration epoch_time,
                               const EvalResult* eval);
  absl::Status WriteModel(int64_t step);
  Tensors WeightViews();
  ConstTensors GradientViews() const;

  const TrainerOptions options_;
  const ModelSpec model_;
  const std::vector<ParamSpec> params_;
  Dataset train_;
  std::optional<Dataset> test_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Client> client_;
  const v1::OptimizerSpec optimizer_;
  // Workers sharing the current epoch's global batch.
  uint32_t epoch_workers_ = 1;
  bool resumed_ = false;  // started from a restored checkpoint's step
  bool metrics_started_ = false;
  uint64_t seen_rollback_ = 0;  // the last rollback id acted on
  int64_t join_step_ = -1;      // the step this worker joined a job at
  bool sync_ = true;            // the servers' mode is sync
  int64_t eval_batch_ = 0;
  std::vector<std::vector<float>> weights_;
  std::vector<std::vector<float>> grads_;
  std::vector<float> x_;  // one batch of inputs, converted from the dataset
  std::vector<int32_t> labels_;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_TRAINER_H_
