// shardps::Client: a worker's connection to every parameter shard. It
// declares the model, then each step streams gradient chunks to their shards
// (all shards and several streams per shard in parallel) and writes the
// updated weights back into the caller's buffers. Retries with backoff are
// safe: the servers apply each (rank, step, chunk) once.
//
// Thread-compatible: one step at a time per Client; use one Client per
// worker thread.
//
// Errors. Every call names the shard (index and address) in its message.
// Besides the codes listed per call, any call that reaches a shard may
// return UNAUTHENTICATED or PERMISSION_DENIED (credentials refused; see
// SecurityOptions), and INTERNAL for a malformed reply. In a job with a
// coordinator the shards fence off processes and steps that are no longer
// the job's:
//   ABORTED: a stale incarnation (another process holds this rank, or the
//     rank left the job or was expelled: join the job again), or a push
//     from before the job's last rollback (set_rollback_id older than the
//     shard's: go back to the rollback's step and redo the steps from there).
//   FAILED_PRECONDITION with must_join(): this process is new to a running
//     job; its pushes are refused until JoinAt.
//   UNAVAILABLE: a shard is down or restarting, or has not yet seen the
//     coordinator's view that admitted this process (the calls below retry
//     it up to their deadline first).
#ifndef SHARDPS_WORKER_CLIENT_H_
#define SHARDPS_WORKER_CLIENT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/backoff.h"
#include "common/chunking.h"
#include "common/security.h"
#include "common/shared_memory.h"
#include "common/step_hyperparameters.h"
#include "shardps/v1/parameter_server.grpc.pb.h"
#include "worker/compression.h"
#include "worker/lane_call.h"
#include "worker/lane_plan.h"
#include "worker/reply_reader.h"
#include "worker/shm_regions.h"

namespace shardps {

class OpenStep;  // worker/open_step.h

struct ClientOptions {
  // Address (host:port) of shard i at index i.
  std::vector<std::string> servers;
  uint32_t rank = 0;
  // This process's incarnation in a coordinated job (JoinRequest.incarnation);
  // 0 in a static job.
  uint64_t incarnation = 0;
  // TLS, client certificate and bearer token (default: plaintext).
  SecurityOptions security;
  // Parallel streams, each on its own connection, per shard.
  int streams_per_shard = 2;
  // > 0: the TCP receive buffer of every connection to a shard
  // (common/transport.h's ReceiveBufferBytesForLink of this worker's link),
  // so that the shards' replies converging on this worker's link keep a
  // few ms of it in flight instead of overflowing the queue before it;
  // 0: the kernel's autotuned one.
  int receive_buffer_bytes = 0;
  // Deadline of one attempt of a step, and of Declare while waiting for the
  // servers to come up.
  absl::Duration rpc_timeout = absl::Seconds(300);
  absl::Duration connect_timeout = absl::Seconds(120);
  // Deadline of Redeclare and ShardStatus: they ask where the shards are,
  // and a caller polling them wants an answer soon rather than late.
  absl::Duration probe_timeout = absl::Seconds(10);
  // Attempts per step on UNAVAILABLE or DEADLINE_EXCEEDED, with exponential
  // backoff from initial_backoff up to max_backoff.
  int max_attempts = 6;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(5);
  // The delays between attempts (initial_backoff doubling up to
  // max_backoff), and between asks to a shard that is not up yet (capped
  // at 1 s: it comes up any moment).
  Backoff RetryBackoff() const { return Backoff(initial_backoff, max_backoff); }
  Backoff WaitBackoff() const {
    return Backoff(initial_backoff,
                   std::max(initial_backoff, absl::Seconds(1)));
  }
  // How gradients and weights cross the wire (worker/compression.h): fp32
  // both ways by default.
  Compression compression;
  // With a shard on this machine (it can open this process's memfds),
  // fp32 and bf16 payloads of PushPull streams and Pulls go through shared
  // memory and only their headers through gRPC (common/shared_memory.h).
  // Shards elsewhere, or started with --shared_memory=false, get everything
  // in the messages.
  bool shared_memory = true;
  // With shared memory and fp32 gradients (any weight encoding but TOPK),
  // PushPull streams pass their headers through message rings in their
  // regions too (common/message_ring.h), and gRPC carries only the
  // streams' ends: no gRPC thread wakes up per chunk on either side.
  bool shared_memory_rings = true;
  // Two-phase steps: each chunk's sealed reply also carries the weights of
  // the update at clip coefficient 1 (PushPullRequest.speculative_weights),
  // kept by the shards when the step neither clips nor skips, so that the
  // weights flow while later chunks are still pushed, as in a one-phase
  // step, and the decision's replies are empty. A step that clips after
  // all costs about what it would without: the speculative weights took a
  // direction of the link the first phase leaves idle, and the shards one
  // more update. Asked of shards this client does not reach through
  // shared memory (there the weights cost no link time, the copy only
  // CPU), unless its last two two-phase steps both clipped or skipped (a
  // run that clips every step costs the shards no wasted updates); never
  // with sparse (TOPK) weights.
  bool speculative_weights = true;
};

// How one step is taken (Client::BeginStep).
struct StepOptions {
  // A two-phase step (PushPullRequest.second_phase): the shards answer each
  // chunk with its sum of squares, the client combines them into the
  // global norm of the averaged gradient (GradNorm) and sends every chunk
  // the step's decision (clip, skip), and only then do the weights come.
  // One more round trip of small messages than a one-phase step.
  bool second_phase = false;
  // The loss was multiplied by this (> 0): the shards unscale, and a step
  // whose norm is not finite is skipped on every shard. Two-phase only.
  std::optional<float> loss_scale;
  // Global-norm clipping (torch's clip_grad_norm_): the averaged gradient
  // is multiplied by min(1, max_grad_norm / (norm + 1e-6)). Two-phase only;
  // SetMaxGradNorm may set it until FinishStep.
  std::optional<float> max_grad_norm;
};

// A two-phase step's decision (v1::StepDecision).
struct StepDecision {
  float clip_coefficient = 1;
  bool skip = false;
};

// The decision of a two-phase step whose norm is `norm`: skip when it is
// not finite, else clip to max_grad_norm (if any) as torch does.
StepDecision DecideStep(double norm, std::optional<float> max_grad_norm);

// A tensor's values, in layout order; the client reads gradients from and
// writes weights into these.
using ConstTensors = std::vector<absl::Span<const float>>;
using Tensors = std::vector<absl::Span<float>>;

// One tensor's optimizer state (Client::ReadOptimizerState).
struct TensorOptimizerState {
  int64_t optimizer_steps = 0;
  // The optimizer's slots (v1::ChunkOptimizerState.slots), each as long as
  // the tensor.
  std::vector<std::vector<float>> slots;
};

class Client : private LaneOwner {
 public:
  // INVALID_ARGUMENT for bad options. Connects lazily.
  static absl::StatusOr<std::unique_ptr<Client>> Create(ClientOptions options);
  ~Client() override;

  // Declares the model on every shard and computes the chunk map. Waits up
  // to connect_timeout for servers that are not up yet. start_step() then
  // tells where the servers are (0 for a new model, the step of a restored
  // checkpoint) and declared() what each shard answered.
  //   INVALID_ARGUMENT: a bad layout, or a rank the job does not have.
  //   FAILED_PRECONDITION: a shard holds a different model, is another
  //     shard index or count than this client computed, or the shards are
  //     more than a step apart (not restored from the same checkpoint).
  //   ABORTED: a stale incarnation (see above).
  //   UNAVAILABLE, DEADLINE_EXCEEDED: a shard did not answer within
  //     connect_timeout.
  absl::Status Declare(const v1::Layout& layout,
                       const v1::OptimizerSpec& optimizer);
  // Before Declare: how gradients and weights cross the wire from now on
  // (ClientOptions::compression), e.g. bf16 both ways for a bf16 model,
  // which it then carries exactly. INVALID_ARGUMENT for a bad one;
  // FAILED_PRECONDITION after Declare.
  absl::Status SetCompression(const Compression& compression);
  const Compression& compression() const { return options_.compression; }
  // After Declare: each shard's answer, by shard index (its consistency
  // mode, versions, last rollback, active ranks; see DeclareResponse).
  const std::vector<v1::DeclareResponse>& declared() const {
    return declared_states_;
  }
  // Declares the same model again on every shard and returns each shard's
  // answer, by shard index; the Client's own state (start_step(),
  // must_join(), the chunk map) is unchanged. Declare is idempotent, so
  // this is how a worker asks the shards where they are: their versions,
  // the last rollback they applied, the ranks they wait for. Waits up to
  // probe_timeout for a shard that is restarting (it may create the model
  // on a shard that restarted without it, as Declare would).
  //   FAILED_PRECONDITION: before Declare, or a shard holds another model.
  //   ABORTED: a stale incarnation.
  //   UNAVAILABLE, DEADLINE_EXCEEDED: a shard did not answer in time.
  absl::StatusOr<std::vector<v1::DeclareResponse>> Redeclare();

  // One step: pushes `gradients` (computed on the weights of version `step`)
  // and writes the weights after the step into `weights`. Each span must
  // hold its tensor's element count. Retries UNAVAILABLE and
  // DEADLINE_EXCEEDED up to max_attempts times, then returns them.
  //   INVALID_ARGUMENT: a buffer of the wrong size, or a non-finite
  //     gradient (with compression: a value the encoding cannot carry,
  //     non-finite or beyond fp16's range; nothing of the step is sent).
  //   FAILED_PRECONDITION: before Declare; a shard without the model (it
  //     restarted empty: declare again); must_join() and no JoinAt yet.
  //   OUT_OF_RANGE: `step` is not the shard's (from the past or the
  //     future, or before this rank's join step).
  //   ABORTED: after a rollback the push did not know of, or for a stale
  //     incarnation (see above).
  //   NOT_FOUND: a chunk the shard does not hold; RESOURCE_EXHAUSTED: a
  //     message over the shard's size limit.
  absl::Status PushPull(int64_t step, const ConstTensors& gradients,
                        const Tensors& weights);
  // After Declare: this process is new to a running job (must_join()), so
  // the servers wait for it only from the step it declares with JoinAt.
  bool must_join() const { return must_join_; }
  // After Declare: the largest version of any chunk (a join step must not
  // be below it).
  int64_t max_version() const { return max_version_; }
  // Declares on every shard that this rank joins at `step`; start_step()
  // becomes `step`. Waits up to connect_timeout for a shard that is not up.
  //   OUT_OF_RANGE: a shard has already passed `step` (pick a later one).
  //   INVALID_ARGUMENT: a negative step.
  //   FAILED_PRECONDITION: before Declare, or a static job (no
  //     coordinator: nobody can join while it runs).
  //   ABORTED: a stale incarnation.
  //   UNAVAILABLE, DEADLINE_EXCEEDED: a shard did not answer in time.
  absl::Status JoinAt(int64_t step);

  // Pushes without waiting for weights (acknowledged per chunk); the same
  // codes as PushPull.
  absl::Status Push(int64_t step, const ConstTensors& gradients);

  // A step pushed one tensor at a time, as backward produces the gradients:
  //   BeginStep(step, &weights);
  //   PushTensor(t, gradient_t) (or PushNoGradient(t)) once per tensor, in
  //     any order, each starting that tensor's chunks on their way at once;
  //   FinishStep() waits for every reply and retries what failed.
  // PushPull is this with every tensor pushed in layout order. Weights are
  // written into `weights` as their replies arrive, possibly before the
  // last PushTensor: a caller that still reads its weights during backward
  // passes other buffers. Gradient buffers are read until FinishStep
  // returns. One step at a time; the calls come from one thread at a time.
  //   FAILED_PRECONDITION: before Declare, or a step is already open.
  //   INVALID_ARGUMENT: StepOptions that are not valid (a loss scale or
  //     max_grad_norm that is not finite and > 0, either without
  //     second_phase, a loss scale with INT8 or TOPK gradients, which
  //     cannot carry an overflow).
  absl::Status BeginStep(int64_t step, const Tensors& weights,
                         const StepOptions& options = {});
  //   INVALID_ARGUMENT (nothing sent): a tensor index out of range, one
  //     pushed twice in the step, a gradient of the wrong size,
  //     hyperparameters out of range (CheckStepHyperparameters), a value
  //     the compression cannot carry.
  //   FAILED_PRECONDITION: no step is open.
  // The fields set in `hyperparameters` replace the declared learning rate
  // (and schedule), momentum and betas for this tensor's update
  // (PushPullRequest.learning_rate, momentum, beta1, beta2); unset ones
  // keep them. The servers refuse a field the tensor's optimizer does not
  // use.
  absl::Status PushTensor(int tensor, absl::Span<const float> gradient,
                          const StepHyperparameters& hyperparameters = {});
  // The first `ready` elements of `gradient` are final: their chunks start
  // on their way now, while the caller computes the rest (a large weight's
  // gradient computed in blocks of rows). The tensor counts as pushed once
  // a call (or PushTensor) passes all its elements, from the same buffer
  // and with the same hyperparameters; `ready` below an earlier call's
  // sends nothing more. Compressed gradients go only whole. Errors as
  // PushTensor's, and INVALID_ARGUMENT (nothing sent) for `ready` outside
  // [0, its size] or another buffer or hyperparameters than the first
  // part's.
  absl::Status PushTensorPart(int tensor, absl::Span<const float> gradient,
                              int64_t ready,
                              const StepHyperparameters& hyperparameters = {});
  // While a one-phase step with weights is open, once `tensor` is pushed:
  // waits until the weights of its first `elements` (every chunk holding
  // one of them) are in the step's weight buffers, so that the caller may
  // read them while the rest arrives (the next step's first layer, computed
  // ahead). Up to the step's deadline (rpc_timeout from its start). False,
  // changing nothing, when they are not: a lane failed (FinishStep retries
  // and reports it), replies that come through shared-memory rings (taken
  // by FinishStep), a two-phase or push-only step, no step open, or a
  // tensor not pushed or out of range.
  bool AwaitWeights(int tensor, int64_t elements);
  // This rank has no gradient for `tensor` at this step
  // (PushPullRequest.no_gradient): when no rank has one, the servers skip
  // the tensor's update. Same errors as PushTensor.
  absl::Status PushNoGradient(int tensor,
                              const StepHyperparameters& hyperparameters = {});
  // Waits for every reply of the open step, retrying UNAVAILABLE and
  // DEADLINE_EXCEEDED up to max_attempts times, and closes the step (also
  // on error). FAILED_PRECONDITION naming the tensors not pushed (the
  // step's streams are cancelled); otherwise the codes of PushPull.
  absl::Status FinishStep();
  // Two-phase steps, after every tensor is pushed: waits for every chunk's
  // sum of squares (retrying as FinishStep does) and returns the global
  // norm of the step's averaged (and unscaled) gradient, as
  // torch.nn.utils.clip_grad_norm_ computes it, in double: the chunks'
  // sums added in chunk id order, so it is the same on every worker and
  // for any number of shards. Not finite when a gradient was not (loss
  // scaling). FinishStep then sends the decision. On error the step is
  // closed (as by FinishStep). FAILED_PRECONDITION: no two-phase step is
  // open, or tensors are not pushed yet (named).
  absl::StatusOr<double> GradNorm();
  // Sets the open two-phase step's max_grad_norm (StepOptions).
  // INVALID_ARGUMENT: not finite and > 0; FAILED_PRECONDITION: no
  // two-phase step is open.
  absl::Status SetMaxGradNorm(float max_norm);
  // After a two-phase FinishStep: the step's global norm (GradNorm) and
  // whether every shard skipped it (a norm that is not finite).
  double last_grad_norm() const { return last_grad_norm_; }
  bool last_step_skipped() const { return last_step_skipped_; }
  // Cancels the open step, if any: what was pushed stays pushed (the
  // servers keep it; pushing the step again is safe).
  void AbortStep();
  bool step_open() const { return open_ != nullptr; }
  // Tensors of the open step not pushed yet (0 when none is open).
  int tensors_left() const;

  // Sends `values` as the model's initial weights (tensors whose InitSpec is
  // KIND_PROVIDED: a shard keeps the first values it gets) and writes what
  // the servers hold into `weights` (then the values, unless another worker
  // was first). Same codes as PushPull.
  absl::Status Initialize(const ConstTensors& values, const Tensors& weights);
  // Pull, but while a chunk still waits for its initial values (UNAVAILABLE
  // from the shard) asks again until `timeout` has passed; then
  // DEADLINE_EXCEEDED naming what it waited for.
  absl::Status PullWhenReady(const Tensors& weights, absl::Duration timeout);
  // Reads the current weights of every chunk, retrying UNAVAILABLE and
  // DEADLINE_EXCEEDED as PushPull does.
  //   INVALID_ARGUMENT: a buffer of the wrong size.
  //   FAILED_PRECONDITION: before Declare, or a shard without the model.
  // `fp32`: in fp32 whatever ClientOptions::compression.weights says (the
  // servers' weights exactly, e.g. to save them).
  absl::Status Pull(const Tensors& weights, bool fp32 = false);

  // The optimizer state of every tensor at `step` (the servers'
  // ChunkOptimizerState, assembled from the chunks): its optimizer's step
  // count and slots, each a tensor-length array (torch's optimizer
  // state_dict). Retries as Pull.
  //   FAILED_PRECONDITION: a step open, before Declare, or a chunk not at
  //     `step` (another rank's step is in flight).
  absl::StatusOr<std::vector<TensorOptimizerState>> ReadOptimizerState(
      int64_t step);
  // Replaces the optimizer state of the tensors whose entry is set (one
  // entry per tensor), chunk by chunk on every shard, at `step`: their
  // next updates continue from it. Retries as Pull (writing twice is
  // harmless).
  //   INVALID_ARGUMENT: wrong count of entries, slots or lengths; the
  //     servers' refusals (non-finite values) name the chunk.
  //   FAILED_PRECONDITION: a step open, before Declare, a chunk not at
  //     `step`, or a checkpoint of `step` already written.
  // A refused chunk leaves the ones before it written.
  absl::Status WriteOptimizerState(
      int64_t step,
      const std::vector<std::optional<TensorOptimizerState>>& states);

  // Each shard's status report, by shard index: the operator's view
  // (counters, checkpoints), not part of the training protocol -- workers
  // use declared() and Redeclare(). UNAVAILABLE or DEADLINE_EXCEEDED (after
  // probe_timeout) when a shard does not answer.
  absl::StatusOr<std::vector<v1::GetStatusResponse>> ShardStatus();

  // After Declare: one buffer per tensor, in layout order, for the caller
  // to compute its gradients in. A gradient pushed from its buffer
  // (PushTensor, PushPull) reaches the shards on this machine without a
  // copy: they read it from this process's shared memory
  // (PushPullRequest.shm_in_gradient_region). Empty when no shard uses
  // shared memory. The rules of the step hold as for any gradient buffer
  // (read until FinishStep returns). The buffers move to a fresh region
  // after a step that failed on some stream (even if retries then
  // completed it) and after a Declare of another layout, so take them
  // again for every step; until then they keep what was written into them.
  // Buffers left behind by a failed step stay readable until the next
  // failed step.
  Tensors GradientBuffers();
  // After Declare, like GradientBuffers: one buffer per tensor for the
  // caller to keep its weights in. Replies of a step whose weights are
  // these buffers are written into them by the shards on this machine
  // (PushPullRequest.reply_in_weight_region), fp32 weights only. They move
  // with the gradient buffers, keeping their values; take them again for
  // every step.
  Tensors WeightBuffers();

  // Time the last PushPull/Push took until every gradient chunk was handed
  // to the transport (the rest of the step is waiting for replies).
  absl::Duration last_push_time() const { return last_push_time_; }

  // After Declare: payloads to and from shard `shard` go through shared
  // memory.
  bool shared_memory(uint32_t shard) const { return shm_.shared_memory(shard); }
  // Some shard's replies come through shared-memory message rings (taken
  // by FinishStep: AwaitWeights cannot wait for them).
  bool replies_through_rings() const {
    for (const auto& lane : lanes_) {
      if (shm_.rings(lane->shard)) return true;
    }
    return false;
  }
  // After Declare: PushPull streams to shard `shard` pass their headers
  // through message rings.
  bool rings(uint32_t shard) const;
  // After Declare, for the log: how payloads travel to each shard, e.g.
  // "shared memory with shards 0, 1" or "gRPC to every shard (shard 0:
  // <why not shared memory>)".
  std::string DescribeTransport() const;
  // The chunk map after Declare, in one line: how many chunks of what size,
  // and how far the busiest shard's bytes are over the mean (every worker
  // pushes and pulls a shard's bytes, so the busiest shard's link bounds a
  // step across a network), with the flag that balances them where it is
  // over 5 %.
  std::string DescribeChunks() const;

  // Attempts that failed and were retried, since creation.
  int64_t retries() const { return retries_.load(); }
  // Gradient and weight regions made since creation (GradientBuffers(),
  // WeightBuffers(): one of each at the first Declare, another after each
  // step that failed on a stream).
  int64_t buffer_regions() const { return shm_.buffer_regions(); }

  int64_t start_step() const { return start_step_; }
  const std::vector<ChunkSpec>& chunks() const { return chunks_; }
  const v1::Layout& layout() const { return layout_; }
  const v1::OptimizerSpec& optimizer() const { return optimizer_; }
  uint32_t rank() const { return options_.rank; }
  // Sets the rollback later pushes say they know of (PushPullRequest). A
  // new one drops the error-feedback residuals: the steps they came from
  // were undone.
  void set_rollback_id(uint64_t id);

 private:
  explicit Client(ClientOptions options);

  // LaneOwner: the open step's messages and replies, for its lanes' calls.
  absl::StatusOr<grpc::ByteBuffer> MessageFor(
      Lane* lane, uint32_t id, bool last, v1::PushPullRequest* header,
      const CallRegions& regions) override;
  bool HeaderFor(uint32_t id, bool last, v1::PushPullRequest* header,
                 const CallRegions& regions) override;
  absl::Status TakeReply(Lane* lane, std::vector<bool>* expected,
                         const CallRegions& regions) override;
  // Declare's parts, and a Declare on one shard.
  absl::Status SetLayout(const v1::Layout& layout);
  absl::Status DeclareOnEvery(absl::Span<const uint32_t> shard_of,
                              std::vector<v1::DeclareResponse>* declared);
  absl::Status TakeSteps(const std::vector<v1::DeclareResponse>& declared);
  void Plan(std::vector<ChunkSpec> chunks, std::vector<uint32_t> shard_of);
  absl::Status DeclareOn(size_t shard, const v1::DeclareRequest& req,
                         absl::Time deadline, v1::DeclareResponse* resp);
  v1::DeclareRequest DeclareRequestFor(size_t shard) const;
  absl::Status CheckTensors(const ConstTensors& gradients,
                            const Tensors* weights) const;
  absl::Status Open(int64_t step, const Tensors* weights, bool initial_values,
                    const StepOptions& options = {});
  // Queues the chunks of `tensor` its first `ready` elements made
  // sendable (OpenStep::Push).
  absl::Status PushChunksOf(int tensor, absl::Span<const float> gradient,
                            const StepHyperparameters& hyperparameters,
                            bool no_gradient, int64_t ready);
  absl::Status Step(int64_t step, const ConstTensors& gradients,
                    const Tensors* weights, bool initial_values = false);
  absl::Status EndLaneStep(Lane* lane, bool cancel,
                           std::vector<uint32_t>* answered);
  absl::Status RetryLane(Lane* lane, absl::Span<const uint32_t> ids,
                         absl::Status s, const std::vector<uint32_t>& answered);
  // Waits for the current phase's replies on every lane, retrying, as
  // FinishStep does; closes the step on error.
  absl::Status EndPhase();
  // Sends every chunk still without weights the step's decision.
  void StartPhase2(const StepDecision& decision);
  // The decision from the step's norm and max_grad_norm, sent (after
  // checking it against one a shard already applied).
  absl::Status SendDecision(double norm);
  // FAILED_PRECONDITION naming the tensors the open step lacks (the step
  // is then aborted).
  absl::Status CheckAllPushed();
  absl::Status CheckStepOptions(const StepOptions& options) const;
  RegionsToName NamesFor(const Lane& lane) const;
  absl::Status PullShard(uint32_t shard, const Tensors& weights, bool fp32);
  // One unary call to shard `shard`, retried as Pull retries.
  absl::Status CallShard(
      uint32_t shard, absl::string_view what,
      const std::function<grpc::Status(v1::ParameterServer::Stub*,
                                       grpc::ClientContext*)>& call);

  ClientOptions options_;
  std::vector<std::unique_ptr<Lane>> lanes_;  // shard-major
  v1::Layout layout_;
  v1::OptimizerSpec optimizer_;
  bool must_join_ = false;
  uint64_t rollback_id_ = 0;
  int64_t max_version_ = 0;
  std::vector<ChunkSpec> chunks_;
  std::vector<uint32_t> shard_of_;
  std::vector<v1::DeclareResponse> declared_states_;  // by shard
  bool declared_ = false;
  int64_t start_step_ = 0;
  std::atomic<int64_t> retries_{0};
  absl::Duration last_push_time_;
  double last_grad_norm_ = 0;
  bool any_failed_ = false;  // a stream of the open step failed
  bool last_step_skipped_ = false;
  // How many of the last two-phase steps clipped or skipped, in a row: from
  // two on, the next one does not ask for speculative weights.
  int clipped_in_a_row_ = 0;
  LanePlan plan_;                   // of the declared chunk map
  std::unique_ptr<OpenStep> open_;  // the step between BeginStep and FinishStep
  // Lossy gradient encodings: each chunk's payload and residual.
  std::unique_ptr<GradientCompressor> compressor_;
  ShmRegions shm_;
  ReplyReader reader_;
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_CLIENT_H_
