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
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/partitioner.h"
#include "common/run_parallel.h"
#include "common/shm_protocol.h"
#include "common/status.h"
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
                                             o.servers[shard], o.security, k));
    }
  }
  return client;
}

// Declare on one shard, retrying while the shard answers UNAVAILABLE (not
// up yet, or not yet aware of this process) until `deadline`.
absl::Status Client::DeclareOn(size_t shard, const v1::DeclareRequest& req,
                               absl::Time deadline, v1::DeclareResponse* resp) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  Backoff backoff = options_.WaitBackoff();
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);  // servers may still be starting
    const absl::Status s = FromGrpcStatus(lane.stub->Declare(&ctx, req, resp));
    // UNAVAILABLE from the shard itself: it has not yet seen the
    // coordinator's view that admitted this process. Ask again.
    if (!absl::IsUnavailable(s) || absl::Now() + backoff.Peek() > deadline) {
      return WithPrefix(
          absl::StrCat("Declare on shard ", shard, " at ", lane.address), s);
    }
    absl::SleepFor(backoff.Next());
  }
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

absl::Status Client::Declare(const v1::Layout& layout,
                             const v1::OptimizerSpec& optimizer) {
  if (open_ != nullptr) {
    return absl::FailedPreconditionError("Declare while a step is open");
  }
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(layout));
  const uint32_t num_shards = static_cast<uint32_t>(options_.servers.size());
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  std::vector<uint32_t> shard_of = PartitionChunks(chunks, num_shards);
  SHARDPS_RETURN_IF_ERROR(SetLayout(layout));
  optimizer_ = optimizer;
  if (options_.shared_memory) shm_.MakeProbe();
  std::vector<v1::DeclareResponse> declared(num_shards);
  SHARDPS_RETURN_IF_ERROR(DeclareOnEvery(shard_of, &declared));
  SHARDPS_RETURN_IF_ERROR(TakeSteps(declared));
  // Rings carry headers only: every payload must go through the region.
  const bool ringable = options_.shared_memory_rings &&
                        options_.compression.gradients == v1::ENCODING_FP32 &&
                        options_.compression.weights != v1::ENCODING_TOPK;
  shm_.SetShards(declared, ringable);
  declared_states_ = std::move(declared);
  Plan(std::move(chunks), std::move(shard_of));
  declared_ = true;
  return absl::OkStatus();
}

// The layout as this client declares it (with sparse weights, its ratio).
absl::Status Client::SetLayout(const v1::Layout& layout) {
  layout_ = layout;
  if (options_.compression.weights != v1::ENCODING_TOPK) {
    return absl::OkStatus();
  }
  // Sparse weights are the model's: every worker declares the same.
  const float ratio =
      static_cast<float>(options_.compression.weights_topk_ratio);
  if (layout.sparse_weights_ratio() != 0 &&
      layout.sparse_weights_ratio() != ratio) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the layout's sparse_weights_ratio ", layout.sparse_weights_ratio(),
        " is not this client's weight encoding topk:", ratio));
  }
  layout_.set_sparse_weights_ratio(ratio);
  layout_.set_sparse_weights_min_elements(options_.compression.min_elements);
  return absl::OkStatus();
}

// Declare on every shard at once, each checked to own the chunks this
// worker computed for it.
absl::Status Client::DeclareOnEvery(
    absl::Span<const uint32_t> shard_of,
    std::vector<v1::DeclareResponse>* declared) {
  const size_t num_shards = declared->size();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  return RunParallel(num_shards, [&](size_t shard) {
    v1::DeclareResponse& resp = (*declared)[shard];
    SHARDPS_RETURN_IF_ERROR(
        DeclareOn(shard, DeclareRequestFor(shard), deadline, &resp));
    std::vector<uint32_t> want;
    for (size_t i = 0; i < shard_of.size(); ++i) {
      if (shard_of[i] == shard) want.push_back(static_cast<uint32_t>(i));
    }
    if (std::vector<uint32_t>(resp.chunk_ids().begin(),
                              resp.chunk_ids().end()) != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", shard, " at ",
          lanes_[shard * options_.streams_per_shard]->address,
          " owns other chunks than this worker computed: is it started with "
          "--shard_index=",
          shard, " --num_shards=", num_shards, "?"));
    }
    return absl::OkStatus();
  });
}

// must_join(), max_version() and start_step() from the shards' answers.
absl::Status Client::TakeSteps(
    const std::vector<v1::DeclareResponse>& declared) {
  must_join_ = false;
  max_version_ = 0;
  int64_t lo = declared[0].next_step();
  int64_t hi = lo;
  for (const v1::DeclareResponse& resp : declared) {
    must_join_ = must_join_ || resp.must_join();
    max_version_ = std::max(max_version_, resp.max_version());
    lo = std::min(lo, resp.next_step());
    hi = std::max(hi, resp.next_step());
  }
  // Resume where the servers are (a restored checkpoint's step). A worker
  // that died mid-step may have left one shard a step ahead: start from the
  // lowest, which that shard answers as a retry.
  // A process new to a running job takes its step from JoinAt instead:
  // the job moves on while the shards answer one by one, so they may be
  // steps apart.
  if (!must_join_ && hi - lo > 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shards are at steps ", lo, " to ", hi,
                     ": restore every shard from the same checkpoint"));
  }
  start_step_ = lo;
  return absl::OkStatus();
}

// The new chunk map's lanes, regions and per-chunk state.
void Client::Plan(std::vector<ChunkSpec> chunks,
                  std::vector<uint32_t> shard_of) {
  plan_ = PlanLanes(layout_, chunks, shard_of,
                    static_cast<uint32_t>(options_.servers.size()),
                    options_.streams_per_shard);
  for (size_t l = 0; l < lanes_.size(); ++l) {
    lanes_[l]->chunk_ids = plan_.lane_chunks[l];
    lanes_[l]->shm_bytes = plan_.stream[l].payload_bytes;
    lanes_[l]->ring_bytes = plan_.stream[l].rings.bytes;
  }
  shm_.DeclarePulls(plan_.pull_region_bytes);
  std::vector<int64_t> tensor_elements;
  for (const v1::TensorSpec& t : layout_.tensors()) {
    tensor_elements.push_back(NumElements(t));
  }
  shm_.DeclareBuffers(plan_.tensor_at, std::move(tensor_elements),
                      plan_.buffer_bytes);
  // A model declared again keeps its residuals only if it is the same.
  if (options_.compression.gradients != v1::ENCODING_FP32 &&
      (compressor_ == nullptr || !compressor_->SameChunks(chunks))) {
    compressor_ =
        std::make_unique<GradientCompressor>(options_.compression, chunks);
  }
  reader_.Declare(chunks);
  chunks_ = std::move(chunks);
  shard_of_ = std::move(shard_of);
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
    Lane* lane, uint32_t id, v1::PushPullRequest* header,
    const CallRegions& regions) {
  return open_->MessageFor(lane, id, header, regions);
}

bool Client::HeaderFor(uint32_t id, v1::PushPullRequest* header,
                       const CallRegions& regions) {
  return open_->HeaderFor(id, header, regions);
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
  open_ =
      std::make_unique<OpenStep>(model, step, weights, initial_values, options);
  for (auto& lane : lanes_) {
    if (lane->chunk_ids.empty()) continue;
    lane->BeginStep(this, NamesFor(*lane), lane->chunk_ids, chunks_.size(),
                    open_->start());
  }
  return absl::OkStatus();
}

absl::Status Client::CheckStepOptions(const StepOptions& options) const {
  auto bad = [](const std::optional<float>& v) {
    return v.has_value() && !(std::isfinite(*v) && *v > 0);
  };
  if (bad(options.loss_scale) || bad(options.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        bad(options.loss_scale) ? "loss scale " : "max_grad_norm ",
        bad(options.loss_scale) ? *options.loss_scale : *options.max_grad_norm,
        " must be finite and > 0"));
  }
  if (!options.second_phase &&
      (options.loss_scale.has_value() || options.max_grad_norm.has_value())) {
    return absl::InvalidArgumentError(
        "a loss scale or max_grad_norm needs a two-phase step "
        "(StepOptions::second_phase)");
  }
  const v1::Encoding g = options_.compression.gradients;
  if (options.loss_scale.has_value() &&
      (g == v1::ENCODING_INT8 || g == v1::ENCODING_TOPK)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaling with ", v1::Encoding_Name(g),
        " gradients: an overflow must reach the servers as inf, which only "
        "FP32, BF16 and FP16 gradients carry"));
  }
  return absl::OkStatus();
}

// What a new call of a step on `lane` names: shared memory where its shard
// uses it, and the current gradient and weight regions.
RegionsToName Client::NamesFor(const Lane& lane) const {
  RegionsToName names;
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

absl::Status Client::SetMaxGradNorm(float max_norm) {
  if (open_ == nullptr || !open_->options().second_phase) {
    return absl::FailedPreconditionError(
        "max_grad_norm is set on an open two-phase step: BeginStep with "
        "StepOptions::second_phase first");
  }
  StepOptions options = open_->options();
  options.max_grad_norm = max_norm;
  SHARDPS_RETURN_IF_ERROR(CheckStepOptions(options));
  open_->set_max_grad_norm(max_norm);
  return absl::OkStatus();
}

absl::Status Client::PushChunksOf(int tensor, absl::Span<const float> gradient,
                                  std::optional<float> learning_rate,
                                  bool no_gradient) {
  if (open_ == nullptr) {
    return absl::FailedPreconditionError("no step is open: BeginStep first");
  }
  SHARDPS_RETURN_IF_ERROR(
      open_->Push(tensor, gradient, learning_rate, no_gradient));
  const uint32_t first = plan_.first_chunk[tensor];
  const uint32_t end = plan_.first_chunk[tensor + 1];
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
                                std::optional<float> learning_rate) {
  return PushChunksOf(tensor, gradient, learning_rate, false);
}

absl::Status Client::PushNoGradient(int tensor,
                                    std::optional<float> learning_rate) {
  return PushChunksOf(tensor, {}, learning_rate, true);
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

absl::StatusOr<double> Client::GradNorm() {
  if (open_ == nullptr || !open_->options().second_phase) {
    return absl::FailedPreconditionError(
        "GradNorm needs an open two-phase step (StepOptions::second_phase)");
  }
  if (!open_->norm().has_value()) {
    SHARDPS_RETURN_IF_ERROR(CheckAllPushed());
    SHARDPS_RETURN_IF_ERROR(EndPhase());
    absl::StatusOr<double> norm = open_->Norm();
    if (!norm.ok()) {
      AbortStep();
      return norm.status();
    }
    open_->set_norm(*norm);
  }
  return *open_->norm();
}

StepDecision DecideStep(double norm, std::optional<float> max_grad_norm) {
  StepDecision decision;
  decision.skip = !std::isfinite(norm);
  if (!decision.skip && max_grad_norm.has_value()) {
    // As torch's clip_grad_norm_ computes it in float32: max_norm /
    // (total + 1e-6) is reciprocal(total + 1e-6) * max_norm, clamped to 1.
    const float inverse = 1.0f / (static_cast<float>(norm) + 1e-6f);
    decision.clip_coefficient = std::min(1.0f, inverse * *max_grad_norm);
  }
  return decision;
}

absl::Status Client::SendDecision(double norm) {
  const StepDecision decision =
      DecideStep(norm, open_->options().max_grad_norm);
  if (const std::optional<StepDecision>& applied = open_->applied()) {
    if (applied->skip != decision.skip ||
        applied->clip_coefficient != decision.clip_coefficient) {
      const int64_t step = open_->step();
      AbortStep();
      return absl::InvalidArgumentError(absl::StrFormat(
          "step %d: this worker decides clip coefficient %.9g%s, but a shard "
          "already applied %.9g%s from another worker: every worker of a "
          "step must clip with the same max_grad_norm",
          step, decision.clip_coefficient, decision.skip ? " (skip)" : "",
          applied->clip_coefficient, applied->skip ? " (skip)" : ""));
    }
  }
  last_grad_norm_ = norm;
  last_step_skipped_ = decision.skip;
  StartPhase2(decision);
  return absl::OkStatus();
}

void Client::StartPhase2(const StepDecision& decision) {
  open_->Decide(decision);
  for (auto& lane : lanes_) {
    const std::vector<uint32_t> ids = open_->Pending(lane->chunk_ids);
    if (ids.empty()) continue;
    lane->BeginStep(this, NamesFor(*lane), ids, chunks_.size(), open_->start());
    for (uint32_t id : ids) lane->Queue(id);
    lane->call->Pump();
  }
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

absl::Status Client::JoinAt(int64_t step) {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before JoinAt");
  }
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  SHARDPS_RETURN_IF_ERROR(
      RunParallel(options_.servers.size(), [&](size_t shard) {
        v1::DeclareRequest req = DeclareRequestFor(shard);
        req.set_join(true);
        req.set_join_step(step);
        v1::DeclareResponse resp;
        return DeclareOn(shard, req, deadline, &resp);
      }));
  must_join_ = false;
  start_step_ = step;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::DeclareResponse>> Client::Redeclare() {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before Redeclare");
  }
  std::vector<v1::DeclareResponse> out(options_.servers.size());
  const absl::Time deadline = absl::Now() + options_.probe_timeout;
  SHARDPS_RETURN_IF_ERROR(RunParallel(out.size(), [&](size_t shard) {
    return DeclareOn(shard, DeclareRequestFor(shard), deadline, &out[shard]);
  }));
  return out;
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
