// Threads. A Client is driven by one caller thread at a time (its API), and
// by three kinds of thread besides:
//   - gRPC's reactions of its lanes' calls (lane_call.cc): they build each
//     chunk's message (MessageFor) and take each reply (TakeReply) of the
//     open step. They read open_, chunks_, plan_, layout_ and the
//     compressor's per-chunk state, all fixed while a step is open except
//     the entries of chunks not yet pushed, which no reaction reads; they
//     write the caller's weight buffers, the compressor's residual of the
//     chunk they took, and reader_'s copy of that chunk.
//   - RunParallel threads, one per shard in Declare, JoinAt, Redeclare,
//     ShardStatus and Pull, each using its own shard's lane, answer slot and
//     (Pull) its own shard's entries of shm_ and reader_ (Pull refuses to
//     run while a step is open);
//   - RunParallel threads of FinishStep's retries, one per failed lane: each
//     opens and closes that lane's calls (a LaneCall per attempt, payloads
//     in the messages) and counts retries_ (atomic).
// Every other member is the caller's. The gradients a step pushes are the
// caller's again when FinishStep (or AbortStep) returns: each lane waits
// for gRPC to drop them.
#include "worker/client.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/partitioner.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "common/transport.h"
#include "common/wire.h"

namespace shardps {

// The step between BeginStep and FinishStep.
struct Client::OpenStep {
  int64_t step = 0;
  bool initial_values = false;
  bool push_only = false;
  Tensors weights;                                  // empty for push-only
  ConstTensors gradients;                           // by tensor, as pushed
  std::vector<std::optional<float>> learning_rate;  // by tensor
  std::vector<bool> pushed;                         // by tensor
  // By tensor; bytes, not bits: lane threads read it while the caller
  // writes other tensors' entries.
  std::vector<char> no_gradient;
  // Compressed gradients: by chunk id, the payload sent (owned by the
  // GradientCompressor, valid for the step).
  std::vector<absl::string_view> payloads;
  std::vector<bool> encoded;  // by tensor
  int num_pushed = 0;
  absl::Time start;
};

namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// Runs fn(i) for i in [0, n) on n threads; returns the first error.
absl::Status RunParallel(size_t n,
                         const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  // The calling thread takes the last item itself.
  for (size_t i = 0; i + 1 < n; ++i) {
    threads.emplace_back([&, i] { statuses[i] = fn(i); });
  }
  if (n > 0) statuses[n - 1] = fn(n - 1);
  for (std::thread& t : threads) t.join();
  for (absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Where `bytes` at `p` lie in `region` (none: not all of them, or no
// region).
std::optional<uint64_t> PlaceIn(const SharedRegion* region, const void* p,
                                int64_t bytes) {
  if (region == nullptr) return std::nullopt;
  const auto at = reinterpret_cast<uintptr_t>(p) -
                  reinterpret_cast<uintptr_t>(region->data());
  if (!region->Contains(at, static_cast<uint64_t>(bytes))) return std::nullopt;
  return at;
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
  SHARDPS_RETURN_IF_ERROR(ValidateCompression(options.compression));
  for (const std::string& s : options.servers) {
    if (s.empty() || s.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("server address \"", s, "\" is not host:port"));
    }
  }
  std::unique_ptr<Client> client(new Client(std::move(options)));
  const int max_message = kMaxChunkBytes + kMessageOverheadBytes;
  const ClientOptions& o = client->options_;
  for (uint32_t shard = 0; shard < o.servers.size(); ++shard) {
    for (int k = 0; k < o.streams_per_shard; ++k) {
      auto lane = std::make_unique<Lane>();
      lane->index = client->lanes_.size();
      lane->shard = shard;
      lane->address = o.servers[shard];
      lane->channel = MakeChannel(o.servers[shard], o.security,
                                  ClientChannelArguments(max_message, k));
      lane->stub = v1::ParameterServer::NewStub(lane->channel);
      client->lanes_.push_back(std::move(lane));
    }
  }
  return client;
}

// Declare on one shard, retrying while the shard answers UNAVAILABLE (not
// up yet, or not yet aware of this process) until `deadline`.
absl::Status Client::DeclareOn(size_t shard, const v1::DeclareRequest& req,
                               absl::Time deadline, v1::DeclareResponse* resp) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  absl::Duration backoff = options_.initial_backoff;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);  // servers may still be starting
    const absl::Status s = FromGrpcStatus(lane.stub->Declare(&ctx, req, resp));
    // UNAVAILABLE from the shard itself: it has not yet seen the
    // coordinator's view that admitted this process. Ask again.
    if (!absl::IsUnavailable(s) || absl::Now() + backoff > deadline) {
      return WithPrefix(
          absl::StrCat("Declare on shard ", shard, " at ", lane.address), s);
    }
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
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

// The chunk's gradient goes out compressed (not no_gradient, not initial
// values).
bool Client::Compressed(uint32_t id) const {
  return compressor_ != nullptr && !open_->initial_values &&
         !open_->no_gradient[chunks_[id].tensor] && compressor_->compresses(id);
}

// Where in regions.weights the reply to chunk `c` of the open step is asked
// (the caller's weights lie there, fp32 replies, a stream region); none:
// elsewhere.
std::optional<uint64_t> Client::ReplyInWeightRegion(
    const ChunkSpec& c, const CallRegions& regions) const {
  if (regions.stream == nullptr || open_->push_only ||
      EffectiveEncoding(options_.compression.weights) != v1::ENCODING_FP32) {
    return std::nullopt;
  }
  return PlaceIn(regions.weights, open_->weights[c.tensor].data() + c.offset,
                 c.bytes());
}

// The request of chunk `id` of the open step and, with a stream region,
// names its gradient where it lies in the gradient region or else copies it
// into the stream's region, and asks its reply where the caller's weights
// lie in the weight region or else in the stream's region, where they fit.
// True when the message needs no payload.
bool Client::HeaderFor(uint32_t id, v1::PushPullRequest* header,
                       const CallRegions& regions) {
  const ChunkSpec& c = chunks_[id];
  SharedRegion* region = regions.stream;
  const OpenStep& o = *open_;
  header->Clear();
  header->set_rank(options_.rank);
  header->set_incarnation(options_.incarnation);
  header->set_rollback_id(rollback_id_);
  header->set_step(o.step);
  header->set_chunk_id(id);
  header->set_encoding(Compressed(id) ? compressor_->encoding()
                                      : v1::ENCODING_FP32);
  header->set_push_only(o.push_only);
  // Set on push-only steps too: a stream's pushes all ask for the same.
  header->set_reply_encoding(options_.compression.weights);
  if (o.learning_rate[c.tensor].has_value()) {
    header->set_learning_rate(*o.learning_rate[c.tensor]);
  }
  header->set_no_gradient(o.no_gradient[c.tensor]);
  header->set_initial_values(o.initial_values);
  // Kept in the weight region: the shard writes the weights there.
  // Otherwise into the stream's region; one from before the model was
  // declared again may not fit.
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    header->set_reply_in_weight_region(true);
    header->set_reply_shm_offset(*at);
  } else if (region != nullptr && !open_->push_only &&
             options_.compression.weights != v1::ENCODING_TOPK &&
             region->Contains(plan_.weights_at[id], c.bytes())) {
    header->set_reply_shm_offset(plan_.weights_at[id]);
  }
  if (open_->no_gradient[c.tensor]) return true;
  if (region == nullptr || Compressed(id)) return false;
  const float* gradient = open_->gradients[c.tensor].data() + c.offset;
  // Computed in the gradient region: the shard reads it there.
  if (const std::optional<uint64_t> at =
          PlaceIn(regions.gradients, gradient, c.bytes())) {
    header->set_shm_in_gradient_region(true);
    header->set_shm_offset(*at);
    header->set_shm_bytes(c.bytes());
    return true;
  }
  if (!region->Contains(plan_.gradient_at[id], c.bytes())) return false;
  std::memcpy(region->data() + plan_.gradient_at[id], gradient, c.bytes());
  header->set_shm_offset(plan_.gradient_at[id]);
  header->set_shm_bytes(c.bytes());
  return true;
}

absl::StatusOr<grpc::ByteBuffer> Client::MessageFor(
    Lane* lane, uint32_t id, v1::PushPullRequest* header,
    const CallRegions& regions) {
  const ChunkSpec& c = chunks_[id];
  if (HeaderFor(id, header, regions)) {
    return lane->Message(*header, nullptr, 0);
  }
  if (!Compressed(id)) {
    return lane->Message(*header, open_->gradients[c.tensor].data() + c.offset,
                         c.bytes());
  }
  absl::string_view& payload = open_->payloads[id];
  if (payload.data() == nullptr) {
    // Encoded here, on the lane's thread, as the lane gets to it: lanes
    // encode in parallel, and while earlier chunks are on the wire.
    absl::StatusOr<absl::string_view> encoded = compressor_->Encode(
        id, open_->gradients[c.tensor].data() + c.offset, open_->step);
    if (!encoded.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of tensor ", layout_.tensors(c.tensor).name(),
                       " (chunk ", id, ", tensor elements from ", c.offset,
                       "): ", encoded.status().message()));
    }
    payload = *encoded;
  }
  return lane->Message(*header, payload.data(), payload.size());
}

void Client::set_rollback_id(uint64_t id) {
  if (id != rollback_id_ && compressor_ != nullptr) compressor_->Reset();
  rollback_id_ = id;
}

// Writes a reply's weights into the open step's buffers, from where its push
// asked for them (HeaderFor), and clears the chunk in `expected`.
absl::Status Client::TakeReply(Lane* lane, std::vector<bool>* expected,
                               const CallRegions& regions) {
  const uint32_t id = lane->reply.response.chunk_id();
  if (id >= chunks_.size() || plan_.lane_of[id] != lane->index ||
      !(*expected)[id]) {
    return absl::InternalError(
        absl::StrCat("bad reply: server sent chunk ", id,
                     " which was not pushed or was answered already"));
  }
  (*expected)[id] = false;
  // Acknowledged: what this payload dropped is the chunk's residual now.
  if (Compressed(id)) compressor_->Commit(id);
  if (open_->push_only) {
    // The shard moved its copy of what workers hold without telling this
    // one.
    reader_.Forget(id);
    return absl::OkStatus();
  }
  const ChunkSpec& c = chunks_[id];
  float* out = open_->weights[c.tensor].data() + c.offset;
  // Where this chunk's push asked for its reply (HeaderFor).
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    return reader_.Read(&lane->reply, c, out, regions.weights, *at);
  }
  return reader_.Read(&lane->reply, c, out, regions.stream,
                      plan_.weights_at[id]);
}

// BeginStep for every kind of step (push-only: null weights).
absl::Status Client::Open(int64_t step, const Tensors* weights,
                          bool initial_values) {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before any step");
  }
  if (open_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", open_->step, " is still open: FinishStep first"));
  }
  if (weights != nullptr) {
    ConstTensors shapes(weights->begin(), weights->end());
    SHARDPS_RETURN_IF_ERROR(CheckTensors(shapes, nullptr));
  }
  auto o = std::make_unique<OpenStep>();
  const size_t n = layout_.tensors_size();
  o->step = step;
  o->initial_values = initial_values;
  o->push_only = weights == nullptr;
  if (weights != nullptr) o->weights = *weights;
  o->gradients.resize(n);
  o->learning_rate.assign(n, std::nullopt);
  o->pushed.assign(n, false);
  o->no_gradient.assign(n, false);
  if (compressor_ != nullptr) {
    o->payloads.assign(chunks_.size(), {});
    o->encoded.assign(n, false);
  }
  o->start = absl::Now();
  open_ = std::move(o);
  for (auto& lane : lanes_) {
    if (lane->chunk_ids.empty()) continue;
    lane->OpenStep(this, NamesFor(*lane), chunks_.size(), open_->start);
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

absl::Status Client::BeginStep(int64_t step, const Tensors& weights) {
  return Open(step, &weights, false);
}

absl::Status Client::PushChunksOf(int tensor, absl::Span<const float> gradient,
                                  std::optional<float> learning_rate,
                                  bool no_gradient) {
  if (open_ == nullptr) {
    return absl::FailedPreconditionError("no step is open: BeginStep first");
  }
  OpenStep& o = *open_;
  if (tensor < 0 || tensor >= layout_.tensors_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor index ", tensor, " is out of range: the model has ",
        layout_.tensors_size(), " tensors"));
  }
  const v1::TensorSpec& spec = layout_.tensors(tensor);
  if (o.pushed[tensor]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", spec.name(), " was already pushed at step ", o.step));
  }
  const int64_t want = NumElements(spec);
  if (!no_gradient && static_cast<int64_t>(gradient.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.name(), " has ", want,
                     " elements; its gradient has ", gradient.size()));
  }
  if (learning_rate.has_value() &&
      !(std::isfinite(*learning_rate) && *learning_rate >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the learning rate of tensor ", spec.name(),
                     " must be finite and >= 0, got ", *learning_rate));
  }
  if (compressor_ != nullptr && !no_gradient && !o.initial_values &&
      !o.encoded[tensor]) {
    // Encoded before anything of the tensor is queued: a value the
    // encoding cannot carry sends nothing of it.
    SHARDPS_RETURN_IF_ERROR(EncodeTensor(tensor, gradient));
  }
  o.pushed[tensor] = true;
  o.no_gradient[tensor] = no_gradient;
  o.gradients[tensor] = gradient;
  o.learning_rate[tensor] = learning_rate;
  ++o.num_pushed;
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

// Compression: checks that the chunks of `tensor` can be encoded (each is
// encoded when its lane sends it). InvalidArgument naming the tensor and
// element when a value cannot be.
absl::Status Client::EncodeTensor(int tensor,
                                  absl::Span<const float> gradient) {
  OpenStep& o = *open_;
  for (uint32_t id = plan_.first_chunk[tensor];
       id < plan_.first_chunk[tensor + 1]; ++id) {
    const ChunkSpec& c = chunks_[id];
    if (!compressor_->compresses(id)) continue;
    const absl::Status s =
        compressor_->CheckValues(id, gradient.data() + c.offset, o.step);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of tensor ", layout_.tensors(tensor).name(), " (chunk ", id,
          ", tensor elements from ", c.offset, "): ", s.message()));
    }
  }
  o.encoded[tensor] = true;
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
  return open_ == nullptr ? 0 : layout_.tensors_size() - open_->num_pushed;
}

// Lane::EndStep up to the step's deadline (rpc_timeout from its start).
absl::Status Client::EndLaneStep(Lane* lane, bool cancel,
                                 std::vector<uint32_t>* answered) {
  const absl::Status status =
      lane->EndStep(cancel, open_->start + options_.rpc_timeout,
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
}

absl::Status Client::FinishStep() {
  if (open_ == nullptr) {
    return absl::FailedPreconditionError("no step is open: BeginStep first");
  }
  if (open_->num_pushed < layout_.tensors_size()) {
    std::vector<std::string> missing;
    for (int t = 0; t < layout_.tensors_size(); ++t) {
      if (!open_->pushed[t]) missing.push_back(layout_.tensors(t).name());
    }
    const int64_t step = open_->step;
    AbortStep();
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " ended without a push of tensor(s) ",
                     absl::StrJoin(missing, ", ")));
  }
  std::vector<size_t> failed;
  std::vector<absl::Status> lane_status(lanes_.size());
  std::vector<std::vector<uint32_t>> lane_answered(lanes_.size());
  for (size_t l = 0; l < lanes_.size(); ++l) {
    if (lanes_[l]->chunk_ids.empty()) continue;
    lane_status[l] = EndLaneStep(lanes_[l].get(), false, &lane_answered[l]);
    if (!lane_status[l].ok()) failed.push_back(l);
  }
  // Retries run one lane per thread; only after a failure.
  const absl::Status status = RunParallel(failed.size(), [&](size_t i) {
    return RetryLane(lanes_[failed[i]].get(), lane_status[failed[i]],
                     lane_answered[failed[i]]);
  });
  absl::Time pushed = open_->start;
  for (const auto& lane : lanes_) {
    pushed = std::max(pushed, lane->writes_done_at());
  }
  last_push_time_ = pushed - open_->start;
  open_.reset();
  if (!failed.empty()) shm_.Renew();
  return status;
}

// After the step failed on `lane` with `s`: retries the lane's chunks not
// in `answered` while the error is retryable, up to max_attempts in all,
// each attempt on a call of its own that is closed when it ends (the next
// step opens one naming the regions). Returns the last error, naming the
// step and the shard.
absl::Status Client::RetryLane(Lane* lane, absl::Status s,
                               const std::vector<uint32_t>& answered) {
  std::vector<bool> done(chunks_.size(), false);
  for (uint32_t id : answered) done[id] = true;
  std::vector<uint32_t> pending;
  for (uint32_t id : lane->chunk_ids) {
    if (!done[id]) pending.push_back(id);
  }
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;
       !pending.empty() && IsRetryable(s) && attempt < options_.max_attempts;
       ++attempt) {
    retries_.fetch_add(1);
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
    // A call of its own for what is pending, its payloads in the messages.
    const absl::Time deadline = absl::Now() + options_.rpc_timeout;
    lane->OpenRetry(this, RegionsToName(), pending, chunks_.size());
    std::vector<uint32_t> now_answered;
    s = lane->EndStep(false, deadline, options_.rpc_timeout, &now_answered);
    if (lane->call != nullptr) {  // complete: the next step opens its own
      lane->call->Close(/*cancel=*/false);
      lane->call.reset();
    }
    if (s.ok()) now_answered = pending;
    for (uint32_t id : now_answered) done[id] = true;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](uint32_t id) { return done[id]; }),
                  pending.end());
  }
  if (pending.empty()) s = absl::OkStatus();
  return WithPrefix(absl::StrCat("step ", open_->step, " on shard ",
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
      const absl::Status encoded = EncodeTensor(t, gradients[t]);
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

absl::Status Client::PullShard(uint32_t shard, const Tensors& weights) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  const size_t owned = std::count(shard_of_.begin(), shard_of_.end(), shard);
  // Pull sends sparse weights whole.
  const bool sparse = options_.compression.weights == v1::ENCODING_TOPK;
  absl::Duration backoff = options_.initial_backoff;
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    v1::PullRequest req;
    req.set_encoding(sparse ? v1::ENCODING_FP32 : options_.compression.weights);
    SharedRegion* region = sparse ? nullptr : shm_.PullRegion(shard);
    if (region != nullptr) {
      auto& offsets = *req.mutable_reply_shm_offsets();
      for (uint32_t id = 0; id < chunks_.size(); ++id) {
        if (shard_of_[id] == shard) offsets[id] = plan_.pull_at[id];
      }
    }
    size_t received = 0;
    status = lane.Pull(req, region, options_.rpc_timeout, [&](Reply* r) {
      const uint32_t id = r->response.chunk_id();
      if (id >= chunks_.size() || shard_of_[id] != shard) {
        return absl::InternalError(
            absl::StrCat("server sent chunk ", id, " which it does not own"));
      }
      const ChunkSpec& c = chunks_[id];
      SHARDPS_RETURN_IF_ERROR(reader_.Read(r, c,
                                           weights[c.tensor].data() + c.offset,
                                           region, plan_.pull_at[id]));
      ++received;
      return absl::OkStatus();
    });
    if (status.ok() && received != owned) {
      status = absl::InternalError(absl::StrCat(
          "Pull returned ", received, " chunks; the shard owns ", owned));
    }
    if (status.ok()) break;
    // The shard may still be writing into this call's region.
    if (region != nullptr) shm_.DropPullRegion(shard);
    // The shard cannot map it: over gRPC.
    if (shm::IsFallback(status)) shm_.Fallback(shard);
    if (!IsRetryable(status) || attempt >= options_.max_attempts) break;
    retries_.fetch_add(1);
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  return WithPrefix(
      absl::StrCat("Pull from shard ", shard, " at ", lane.address), status);
}

absl::Status Client::Pull(const Tensors& weights) {
  if (open_ != nullptr) {
    // Its lanes' readers use the same reply buffers (and sparse copies).
    return absl::FailedPreconditionError(absl::StrCat(
        "Pull while step ", open_->step, " is open: FinishStep first"));
  }
  ConstTensors shapes(weights.begin(), weights.end());
  SHARDPS_RETURN_IF_ERROR(CheckTensors(shapes, nullptr));
  return RunParallel(options_.servers.size(), [&](size_t shard) {
    return PullShard(static_cast<uint32_t>(shard), weights);
  });
}

absl::Status Client::PullWhenReady(const Tensors& weights,
                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = options_.initial_backoff;
  while (true) {
    absl::Status s = Pull(weights);
    if (!absl::IsUnavailable(s)) return s;
    if (absl::Now() + backoff > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the model's weights were not ready within ",
                       absl::FormatDuration(timeout), ": ", s.message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
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
