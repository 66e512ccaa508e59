// Threads. A Client is driven by one caller thread at a time (its API), and
// by three kinds of thread besides:
//   - gRPC's reactions of its lanes' calls (lane_call.cc): through this
//     LaneOwner they build each chunk's message and take each reply of the
//     open step (open_step.h). They read open_ (set before any lane is
//     armed, reset only after every lane's step ended), chunks_, plan_,
//     layout_ and rollback_id_, none of which changes while a step is open;
//     they write the caller's weight buffers and, for the chunk they carry,
//     its compressed payload and residual (compressor_) and its sparse copy
//     (reader_).
//   - RunParallel threads, one per shard, in Declare, JoinAt, Redeclare,
//     ShardStatus and Pull: each uses its own shard's first lane (its stub
//     or channel, not its step state) and its own answer slot; Pull's also
//     touch their shard's entries of shm_ (its Pull region, its fallback)
//     and of reader_ (Pull refuses to run while a step is open).
//   - RunParallel threads of FinishStep's retries, one per failed lane: each
//     opens and closes that lane's calls (Lane::Retry: a LaneCall per
//     attempt, payloads in the messages), may touch reader_ and compressor_
//     entries of that lane's chunks only, and counts retries_ (atomic).
// Every other member is the caller's. The gradients a step pushes are the
// caller's again when FinishStep (or AbortStep) returns: each lane waits
// for gRPC to drop them first.
#include "worker/client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/run_parallel.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "common/transport.h"
#include "worker/open_step.h"

namespace shardps {

namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

}  // namespace

Client::Client(ClientOptions options)
    : options_(std::move(options)), reader_(options_.compression.weights) {}

Client::~Client() {
  AbortStep();
  // The streams kept open between steps end cleanly, all at once: a hung
  // shard costs one wait, not one per stream.
  for (auto& lane : lanes_) {
    if (lane->call != nullptr) lane->call->BeginClose(/*cancel=*/false);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (auto& lane : lanes_) {
    if (lane->call != nullptr) lane->call->FinishClose(deadline);
  }
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("no parameter servers given");
  }
  if (options.streams_per_shard < 1 || options.streams_per_shard > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams_per_shard=", options.streams_per_shard,
                     " must be in [1, 64]"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("max_attempts must be at least 1");
  }
  if (options.initial_backoff <= absl::ZeroDuration() ||
      options.max_backoff < options.initial_backoff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "initial_backoff=", absl::FormatDuration(options.initial_backoff),
        " must be positive and at most max_backoff=",
        absl::FormatDuration(options.max_backoff)));
  }
  SHARDPS_RETURN_IF_ERROR(ValidateCompression(options.compression));
  if (options.receive_buffer_bytes != 0) {
    SHARDPS_RETURN_IF_ERROR(CheckReceiveBuffer(options.receive_buffer_bytes));
  }
  for (const std::string& s : options.servers) {
    if (s.empty() || s.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("server address \"", s, "\" is not host:port"));
    }
  }
  std::unique_ptr<Client> client(new Client(std::move(options)));
  const ClientOptions& o = client->options_;
  for (uint32_t shard = 0; shard < o.servers.size(); ++shard) {
    for (int k = 0; k < o.streams_per_shard; ++k) {
      client->lanes_.push_back(Lane::Connect(client->lanes_.size(), shard,
                                             o.servers[shard], o.security, k,
                                             o.receive_buffer_bytes));
    }
  }
  return client;
}

v1::DeclareRequest Client::DeclareRequestFor(size_t shard) const {
  v1::DeclareRequest req;
  *req.mutable_layout() = layout_;
  *req.mutable_optimizer() = optimizer_;
  req.set_num_shards(static_cast<uint32_t>(options_.servers.size()));
  req.set_shard_index(static_cast<uint32_t>(shard));
  req.set_rank(options_.rank);
  req.set_incarnation(options_.incarnation);
  if (!shm_.probe_path().empty()) {
    req.set_shared_memory_probe(shm_.probe_path());
  }
  return req;
}

Tensors Client::GradientBuffers() { return shm_.GradientBuffers(); }

Tensors Client::WeightBuffers() { return shm_.WeightBuffers(); }

bool Client::rings(uint32_t shard) const { return shm_.rings(shard); }

std::string Client::DescribeTransport() const {
  return shm_.Describe(declared_states_);
}

void Client::set_rollback_id(uint64_t id) {
  if (id != rollback_id_ && compressor_ != nullptr) compressor_->Reset();
  rollback_id_ = id;
}

// LaneOwner: a lane's call speaks for the open step (a lane is armed only
// while one is).
absl::StatusOr<grpc::ByteBuffer> Client::MessageFor(
    Lane* lane, uint32_t id, bool last, v1::PushPullRequest* header,
    const CallRegions& regions) {
  return open_->MessageFor(lane, id, last, header, regions);
}

bool Client::HeaderFor(uint32_t id, bool last, v1::PushPullRequest* header,
                       const CallRegions& regions) {
  return open_->HeaderFor(id, last, header, regions);
}

absl::Status Client::TakeReply(Lane* lane, std::vector<bool>* expected,
                               const CallRegions& regions) {
  return open_->TakeReply(lane, expected, regions);
}

absl::Status Client::CheckTensors(const ConstTensors& gradients,
                                  const Tensors* weights) const {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before any step");
  }
  const int n = layout_.tensors_size();
  if (static_cast<int>(gradients.size()) != n ||
      (weights != nullptr && static_cast<int>(weights->size()) != n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model has ", n, " tensors; got ", gradients.size(), " gradients",
        weights ? absl::StrCat(" and ", weights->size(), " weight buffers")
                : ""));
  }
  for (int t = 0; t < n; ++t) {
    const int64_t want = NumElements(layout_.tensors(t));
    if (static_cast<int64_t>(gradients[t].size()) != want ||
        (weights != nullptr &&
         static_cast<int64_t>((*weights)[t].size()) != want)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", layout_.tensors(t).name(), " has ", want,
                       " elements; a buffer given for it has another size"));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::SetCompression(const Compression& compression) {
  if (declared_) {
    return absl::FailedPreconditionError(
        "the wire's encodings are set before Declare");
  }
  SHARDPS_RETURN_IF_ERROR(ValidateCompression(compression));
  options_.compression = compression;
  reader_ = ReplyReader(compression.weights);
  return absl::OkStatus();
}

// BeginStep for every kind of step (push-only: null weights).
absl::Status Client::Open(int64_t step, const Tensors* weights,
                          bool initial_values, const StepOptions& options) {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before any step");
  }
  if (open_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", open_->step(), " is still open: FinishStep first"));
  }
  if (weights != nullptr) {
    ConstTensors shapes(weights->begin(), weights->end());
    SHARDPS_RETURN_IF_ERROR(CheckTensors(shapes, nullptr));
  }
  StepModel model;
  model.options = &options_;
  model.rollback_id = &rollback_id_;
  model.layout = &layout_;
  model.chunks = &chunks_;
  model.plan = &plan_;
  model.compressor = compressor_.get();
  model.reader = &reader_;
  const bool speculate = options.second_phase && weights != nullptr &&
                         !initial_values && options_.speculative_weights &&
                         clipped_in_a_row_ < 2 &&
                         options_.compression.weights != v1::ENCODING_TOPK;
  open_ = std::make_unique<OpenStep>(model, step, weights, initial_values,
                                     options, speculate);
  for (auto& lane : lanes_) {
    if (lane->chunk_ids.empty()) continue;
    lane->BeginStep(this, NamesFor(*lane), lane->chunk_ids, chunks_.size(),
                    open_->start());
  }
  return absl::OkStatus();
}

// What a new call of a step on `lane` names: shared memory where its shard
// uses it, and the current gradient and weight regions.
RegionsToName Client::NamesFor(const Lane& lane) const {
  RegionsToName names;
  names.rank = options_.rank;
  names.stream_region = shm_.shared_memory(lane.shard);
  names.rings = shm_.rings(lane.shard);
  names.gradients = shm_.gradient_region();
  names.weights = shm_.weight_region();
  return names;
}

absl::Status Client::BeginStep(int64_t step, const Tensors& weights,
                               const StepOptions& options) {
  SHARDPS_RETURN_IF_ERROR(CheckStepOptions(options));
  return Open(step, &weights, false, options);
}

absl::Status Client::PushChunksOf(int tensor, absl::Span<const float> gradient,
                                  const StepHyperparameters& hyperparameters,
                                  bool no_gradient, int64_t ready) {
  if (open_ == nullptr) {
    return absl::FailedPreconditionError("no step is open: BeginStep first");
  }
  SHARDPS_ASSIGN_OR_RETURN(
      const OpenStep::ChunkRange range,
      open_->Push(tensor, gradient, hyperparameters, no_gradient, ready));
  const uint32_t first = range.begin;
  const uint32_t end = range.end;
  for (uint32_t id = first; id < end; ++id) {
    lanes_[plan_.lane_of[id]]->Queue(id);
  }
  // Each lane the tensor touched starts writing unless it is already.
  for (uint32_t id = first; id < end; ++id) {
    if (id == first || plan_.lane_of[id] != plan_.lane_of[id - 1]) {
      lanes_[plan_.lane_of[id]]->call->Pump();
    }
  }
  // Replies that came through rings meanwhile are written now, while
  // backward goes on, rather than all at the end.
  for (auto& lane : lanes_) {
    if (lane->call != nullptr && lane->call->ring()) {
      lane->call->TakeRingReplies(absl::InfinitePast());
    }
  }
  return absl::OkStatus();
}

absl::Status Client::PushTensor(int tensor, absl::Span<const float> gradient,
                                const StepHyperparameters& hyperparameters) {
  return PushChunksOf(tensor, gradient, hyperparameters, false,
                      static_cast<int64_t>(gradient.size()));
}

absl::Status Client::PushTensorPart(
    int tensor, absl::Span<const float> gradient, int64_t ready,
    const StepHyperparameters& hyperparameters) {
  return PushChunksOf(tensor, gradient, hyperparameters, false, ready);
}

bool Client::AwaitWeights(int tensor, int64_t elements) {
  if (open_ == nullptr || !open_->AwaitsWeights() || tensor < 0 ||
      tensor >= layout_.tensors_size() || !open_->pushed(tensor)) {
    return false;
  }
  const absl::Time deadline = open_->start() + options_.rpc_timeout;
  for (uint32_t id = plan_.first_chunk[tensor];
       id < plan_.first_chunk[tensor + 1] && chunks_[id].offset < elements;
       ++id) {
    if (!lanes_[plan_.lane_of[id]]->AwaitReplied(id, deadline)) return false;
  }
  return true;
}

absl::Status Client::PushNoGradient(
    int tensor, const StepHyperparameters& hyperparameters) {
  return PushChunksOf(tensor, {}, hyperparameters, true, 0);
}

int Client::tensors_left() const {
  return open_ == nullptr ? 0 : open_->tensors_left();
}

// Lane::EndStep up to the step's deadline (rpc_timeout from its start).
absl::Status Client::EndLaneStep(Lane* lane, bool cancel,
                                 std::vector<uint32_t>* answered) {
  const absl::Status status =
      lane->EndStep(cancel, open_->start() + options_.rpc_timeout,
                    options_.rpc_timeout, answered);
  // The shard could not map this stream's region (it moved, or its
  // limits): the retry and later streams carry payloads in the messages.
  if (shm::IsFallback(status)) shm_.Fallback(lane->shard);
  return status;
}

void Client::AbortStep() {
  if (open_ == nullptr) return;
  for (auto& lane : lanes_) {
    if (!lane->chunk_ids.empty()) {
      EndLaneStep(lane.get(), /*cancel=*/true, nullptr).IgnoreError();
    }
  }
  open_.reset();
  shm_.Renew();
  any_failed_ = false;
}

absl::Status Client::EndPhase() {
  std::vector<size_t> failed;
  std::vector<absl::Status> lane_status(lanes_.size());
  std::vector<std::vector<uint32_t>> lane_answered(lanes_.size());
  std::vector<std::vector<uint32_t>> lane_ids(lanes_.size());
  for (size_t l = 0; l < lanes_.size(); ++l) {
    lane_ids[l] = open_->Pending(lanes_[l]->chunk_ids);
    if (lane_ids[l].empty()) continue;
    lane_status[l] = EndLaneStep(lanes_[l].get(), false, &lane_answered[l]);
    if (!lane_status[l].ok()) failed.push_back(l);
  }
  // Retries run one lane per thread; only after a failure.
  const absl::Status status = RunParallel(failed.size(), [&](size_t i) {
    const size_t l = failed[i];
    return RetryLane(lanes_[l].get(), lane_ids[l], lane_status[l],
                     lane_answered[l]);
  });
  if (!failed.empty()) {
    any_failed_ = true;
  }
  if (!status.ok()) {
    open_.reset();
    shm_.Renew();
    any_failed_ = false;
  }
  return status;
}

absl::Status Client::CheckAllPushed() {
  if (open_->tensors_left() == 0) return absl::OkStatus();
  const std::vector<std::string> missing = open_->Missing();
  const int64_t step = open_->step();
  AbortStep();
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, " ended without a push of tensor(s) ",
                   absl::StrJoin(missing, ", ")));
}

absl::Status Client::FinishStep() {
  if (open_ == nullptr) {
    return absl::FailedPreconditionError("no step is open: BeginStep first");
  }
  SHARDPS_RETURN_IF_ERROR(CheckAllPushed());
  if (open_->options().second_phase) {
    // The decision goes out only now: max_grad_norm may be set until here.
    SHARDPS_ASSIGN_OR_RETURN(const double norm, GradNorm());
    SHARDPS_RETURN_IF_ERROR(SendDecision(norm));
  }
  SHARDPS_RETURN_IF_ERROR(EndPhase());
  absl::Time pushed = open_->start();
  for (const auto& lane : lanes_) {
    pushed = std::max(pushed, lane->writes_done_at());
  }
  last_push_time_ = pushed - open_->start();
  open_.reset();
  if (any_failed_) shm_.Renew();
  any_failed_ = false;
  return absl::OkStatus();
}

// After the step failed on `lane` with `s`: retries the lane's chunks not
// in `answered` while the error is retryable, up to max_attempts in all,
// each attempt on a call of its own that is closed when it ends (the next
// step opens one naming the regions). Returns the last error, naming the
// step and the shard.
absl::Status Client::RetryLane(Lane* lane, absl::Span<const uint32_t> ids,
                               absl::Status s,
                               const std::vector<uint32_t>& answered) {
  std::vector<bool> done(chunks_.size(), false);
  for (uint32_t id : answered) done[id] = true;
  std::vector<uint32_t> pending;
  for (uint32_t id : ids) {
    if (!done[id]) pending.push_back(id);
  }
  Backoff backoff = options_.RetryBackoff();
  for (int attempt = 1;
       !pending.empty() && IsRetryable(s) && attempt < options_.max_attempts;
       ++attempt) {
    retries_.fetch_add(1);
    absl::SleepFor(backoff.Next());
    std::vector<uint32_t> now_answered;
    s = lane->Retry(this, pending, chunks_.size(), options_.rpc_timeout,
                    &now_answered);
    for (uint32_t id : now_answered) done[id] = true;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](uint32_t id) { return done[id]; }),
                  pending.end());
  }
  if (pending.empty()) s = absl::OkStatus();
  return WithPrefix(absl::StrCat("step ", open_->step(), " on shard ",
                                 lane->shard, " at ", lane->address),
                    s);
}

// The whole step at once: every tensor pushed in layout order.
absl::Status Client::Step(int64_t step, const ConstTensors& gradients,
                          const Tensors* weights, bool initial_values) {
  SHARDPS_RETURN_IF_ERROR(CheckTensors(gradients, weights));
  SHARDPS_RETURN_IF_ERROR(Open(step, weights, initial_values));
  if (compressor_ != nullptr && !initial_values) {
    // Every tensor encoded before any is queued: a gradient the encoding
    // cannot carry sends nothing of the step.
    for (int t = 0; t < layout_.tensors_size(); ++t) {
      const absl::Status encoded = open_->EncodeTensor(t, gradients[t]);
      if (!encoded.ok()) {
        AbortStep();
        return encoded;
      }
    }
  }
  for (int t = 0; t < layout_.tensors_size(); ++t) {
    const absl::Status pushed = PushTensor(t, gradients[t]);
    if (!pushed.ok()) {
      AbortStep();
      return pushed;
    }
  }
  return FinishStep();
}
absl::Status Client::PushPull(int64_t step, const ConstTensors& gradients,
                              const Tensors& weights) {
  return Step(step, gradients, &weights);
}
absl::Status Client::Push(int64_t step, const ConstTensors& gradients) {
  return Step(step, gradients, nullptr);
}
absl::Status Client::Initialize(const ConstTensors& values,
                                const Tensors& weights) {
  return Step(0, values, &weights, /*initial_values=*/true);
}

absl::StatusOr<std::vector<v1::GetStatusResponse>> Client::ShardStatus() {
  std::vector<v1::GetStatusResponse> out(options_.servers.size());
  SHARDPS_RETURN_IF_ERROR(RunParallel(out.size(), [&](size_t shard) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.probe_timeout));
    Lane& lane = *lanes_[shard * options_.streams_per_shard];
    return WithPrefix(
        absl::StrCat("GetStatus of shard ", shard, " at ", lane.address),
        FromGrpcStatus(
            lane.stub->GetStatus(&ctx, v1::GetStatusRequest(), &out[shard])));
  }));
  return out;
}

}  // namespace shardps
