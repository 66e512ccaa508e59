// The data-parallel training loop of one worker: each step it computes the
// gradient of its slice of the global batch, pushes it to the parameter
// servers and continues with the weights they return. The lead (rank 0, or
// with a coordinator the lowest rank left) also evaluates, writes the
// per-epoch metrics and the final model. Getting back in step after a
// rollback or a drop is Recovery's (worker/recovery.h). Thread-compatible.
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
#include "worker/recovery.h"
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
  uint64_t chunk_bytes = 0;  // 0: AutoChunkBytes of the model
  // The slowest link's rate, for automatic chunks (0: not known).
  int64_t link_bits_per_second = 0;
  // > 0: every step is a two-phase step clipping the global norm of the
  // averaged gradient to this (Client StepOptions::max_grad_norm).
  double clip_grad_norm = 0;
  // Written by the lead only (see `lead`); empty: not written.
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
  // end and before writing the model. Empty function: rank 0. A worker that
  // may become the lead needs the test set to evaluate.
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
  RollbackNews rollback;
  // How long recovery (joining, rollbacks, rejoining) waits.
  RecoveryOptions recovery;
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

// The layout the servers hold for `model`, parameters in Params() order;
// chunk_bytes 0 chooses them (ChooseChunkBytes, for links of that rate and
// elements of that many bytes on the wire: WireBytesPerElement).
v1::Layout ModelLayout(const ModelSpec& model, uint64_t seed,
                       uint64_t chunk_bytes, int64_t link_bits_per_second = 0,
                       int wire_bytes_per_element = 4);

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

  // Declares the model, trains, and (the lead) writes metrics and the model.
  absl::StatusOr<TrainResult> Run();

 private:
  struct EpochStats;
  // One step of the batch `indices`; `next`: the next step's batch, whose
  // first layer is computed ahead while this step's replies arrive (none:
  // the epoch's last step).
  absl::Status Step(int64_t step, absl::Span<const int64_t> indices,
                    absl::Span<const int64_t> next, EpochStats* stats);
  // While `step`'s replies arrive: the first layer of step + 1's batch
  // `next`, a block at a time as the weights of its units come. False when
  // it was not computed (a backend that cannot, replies through rings, a
  // lane that failed): the next step computes it.
  bool ComputeAhead(absl::Span<const int64_t> next);
  // Why no step can compute the next batch's first layer ahead ("": they
  // can).
  std::string NoAheadReason() const;
  absl::StatusOr<EvalResult> Evaluate();
  // The ranks sharing this epoch's batches (including this one).
  std::vector<uint32_t> EpochRanks() const;
  // Run's parts: the backend, buffers and Declare; an epoch's ranks (logged
  // when they change from *last_ranks) and this rank's position among
  // them; an epoch's result, log line, evaluation and metrics row.
  absl::Status Prepare();
  int StartEpoch(int epoch, std::vector<uint32_t>* last_ranks);
  absl::Status EndEpoch(int epoch, int64_t step, bool last,
                        const EpochStats& stats, TrainResult* result);
  absl::Status WriteMetricsRow(int epoch, int64_t step, const EpochStats& s,
                               absl::Duration epoch_time,
                               const EvalResult* eval);
  absl::Status WriteModel(int64_t step);
  // The weights: the client's weight buffers (replies written into them by
  // shards on this machine), else weights_. Taken again for every use:
  // they move after a failed step.
  Tensors WeightViews();
  ConstTensors Params();  // WeightViews(), read-only
  // Where backward writes this step's gradients: the client's gradient
  // buffers (pushed to shards on this machine without a copy), else
  // grads_.
  Tensors GradientBuffers();

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
  int64_t eval_batch_ = 0;
  std::vector<std::vector<float>> weights_;  // when the client has none
  std::vector<std::vector<float>> grads_;    // when the client has none
  std::vector<float> x_;  // one batch of inputs, converted from the dataset
  std::vector<int32_t> labels_;
  // The next step's batch, whose first layer the backend computed ahead
  // (ahead_step_: that step; -1: none).
  std::vector<float> x_ahead_;
  std::vector<int32_t> labels_ahead_;
  std::vector<int64_t> ahead_indices_;
  int64_t ahead_step_ = -1;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_TRAINER_H_
