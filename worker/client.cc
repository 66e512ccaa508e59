#include "worker/client.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/message_ring.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/transport.h"
#include "common/wire.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/sync_stream.h"

namespace shardps {

// A reply being read: its header fields, its payload, and a compressed one
// gathered.
struct Client::Reply {
  v1::PushPullResponse response;
  PayloadView payload;
  std::string scratch;
};

namespace {

// Raw (byte buffer) forms of the data-path methods; see common/wire.h.
constexpr char kPushPullMethod[] = "/shardps.v1.ParameterServer/PushPull";
constexpr char kPullMethod[] = "/shardps.v1.ParameterServer/Pull";
// A shard owning at most this many bytes is pushed to on one stream.
constexpr int64_t kOneLaneShardBytes = 4 << 20;

}  // namespace

struct Client::Stream {
  size_t index = 0;  // in lanes_
  uint32_t shard = 0;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ParameterServer::Stub> stub;
  std::vector<uint32_t> chunk_ids;  // the chunks this lane carries
  // Bytes of a shared-memory region for this lane: its chunks' gradients,
  // then their weights (used when its shard is in shm_shards_); then, when
  // its shard takes rings, two message rings of ring_bytes each.
  uint64_t shm_bytes = 0;
  uint64_t ring_bytes = 0;
  Reply reply;  // the last reply of a step on this lane

  // Gradient slices gRPC still references; a step returns only once it is
  // zero, so the caller's gradient buffers may then be reused.
  absl::Mutex mu;
  int64_t slices_in_flight ABSL_GUARDED_BY(mu) = 0;
  static void ReleaseSlice(void* lane) {
    Stream* s = static_cast<Stream*>(lane);
    absl::MutexLock lock(&s->mu);
    --s->slices_in_flight;
  }
  // The message of one chunk: `header`, then `bytes` of gradient at `data`
  // (null: none, for no_gradient), referenced rather than copied and
  // counted until gRPC drops it.
  grpc::ByteBuffer Message(const v1::PushPullRequest& header, const void* data,
                           int64_t bytes) {
    if (data == nullptr) return EncodeWithPayload(header, grpc::Slice());
    {
      absl::MutexLock lock(&mu);
      ++slices_in_flight;
    }
    return EncodeWithPayload(
        header, ReferenceSlice(data, bytes, &Stream::ReleaseSlice, this));
  }
  // True once gRPC released every gradient slice (false after `timeout`).
  bool AwaitSlicesReleased(absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(
        absl::Condition(
            +[](int64_t* n) { return *n == 0; }, &slices_in_flight),
        timeout);
  }

  // The lane's PushPull stream, kept open from step to step; null before
  // the first step and after one that failed on it. Only the caller's
  // thread creates and ends it.
  std::unique_ptr<LaneCall> call;

  // The open step on this lane. The caller queues its chunks in `ready` as
  // PushTensor gets them; the call's reactions write them and take the
  // replies.
  bool in_step ABSL_GUARDED_BY(mu) = false;
  std::deque<uint32_t> ready ABSL_GUARDED_BY(mu);  // pushed, not yet written
  int64_t unqueued ABSL_GUARDED_BY(mu) = 0;        // chunks not pushed yet
  // By chunk id: a reply is still expected (the lane's chunks at Open).
  std::vector<bool> expected ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> answered ABSL_GUARDED_BY(mu);
  int taking ABSL_GUARDED_BY(mu) = 0;  // replies being written out
  // The step's first error on this lane (a bad reply, a chunk that could
  // not be encoded, a deadline); the call's own status comes after it.
  absl::Status status ABSL_GUARDED_BY(mu);
  absl::Time writes_done ABSL_GUARDED_BY(mu);  // the step's last write

  // The state of `call` (reset when one starts).
  bool writing ABSL_GUARDED_BY(mu) = false;     // a write is in flight
  bool stopped ABSL_GUARDED_BY(mu) = false;     // write nothing more
  bool reads_over ABSL_GUARDED_BY(mu) = false;  // the stream ended
  bool call_done ABSL_GUARDED_BY(mu) = false;   // OnDone ran
  grpc::Status final_status ABSL_GUARDED_BY(mu);
  // The stream is over or must not be written on any more: the step
  // cannot complete on it.
  bool call_dead() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stopped || reads_over;
  }
};

// One lane's PushPull stream as a callback reactor: gRPC's threads write
// the chunks the caller queues, one message at a time, and take each reply
// as it arrives, so no thread of ours waits on the network. The stream
// stays open across steps (the servers answer pushes of any step on it);
// a hold keeps it alive between them. Every Start* is issued with the
// lane's mutex released (gRPC may run a reaction inline).
class Client::LaneCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  LaneCall(Client* client, Stream* lane) : client_(client), lane_(lane) {}

  void Start() ABSL_LOCKS_EXCLUDED(lane_->mu) {
    {
      absl::MutexLock lock(&lane_->mu);
      lane_->writing = lane_->stopped = lane_->reads_over = false;
      lane_->call_done = false;
      lane_->final_status = grpc::Status::OK;
    }
    // A region of this call's own: a call that ended may still have a
    // reply being written into its region by the shard.
    if (client_->shared_memory(lane_->shard) && lane_->shm_bytes > 0) {
      const bool rings = client_->rings(lane_->shard);
      absl::StatusOr<std::unique_ptr<SharedRegion>> region =
          SharedRegion::Create(lane_->shm_bytes +
                               (rings ? 2 * lane_->ring_bytes : 0));
      // Without one (out of memory or descriptors) the payloads go in the
      // messages.
      if (region.ok()) {
        region_ = *std::move(region);
        ctx_.AddMetadata(kSharedMemoryMetadata,
                         absl::StrCat(region_->path(), " ", region_->size()));
        // Gradients computed in the client's gradient region are read
        // from there, and weights kept in its weight region written there:
        // this call keeps the regions it names alive.
        gradients_ = client_->gradient_region_;
        weights_ = client_->weight_region_;
        if (gradients_ != nullptr) {
          ctx_.AddMetadata(
              kSharedMemoryGradientsMetadata,
              absl::StrCat(gradients_->path(), " ", gradients_->size()));
        }
        if (weights_ != nullptr) {
          ctx_.AddMetadata(
              kSharedMemoryWeightsMetadata,
              absl::StrCat(weights_->path(), " ", weights_->size()));
        }
        if (rings) {
          // shm_bytes is a multiple of 64: the rings start at cache lines.
          char* at = region_->data() + lane_->shm_bytes;
          requests_ = std::make_unique<MessageRing>(at, lane_->ring_bytes);
          replies_ = std::make_unique<MessageRing>(at + lane_->ring_bytes,
                                                   lane_->ring_bytes);
          ctx_.AddMetadata(
              kSharedMemoryRingsMetadata,
              absl::StrCat(lane_->shm_bytes, " ", lane_->ring_bytes));
        }
      }
    }
    const grpc::internal::RpcMethod method(
        kPushPullMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
    grpc::internal::ClientCallbackReaderWriterFactory<
        grpc::ByteBuffer, grpc::ByteBuffer>::Create(lane_->channel.get(),
                                                    method, &ctx_, this);
    AddHold();  // writes start from the caller's thread too
    StartRead(&read_buf_);
    StartCall();
  }

  bool ring() const { return requests_ != nullptr; }
  // The stream names other gradient or weight regions than the client's
  // current ones (or none where the client has them now).
  bool NamesOtherBuffers() const {
    return region_ != nullptr && (gradients_ != client_->gradient_region_ ||
                                  weights_ != client_->weight_region_);
  }
  Client::CallRegions regions() const {
    return {region_.get(), gradients_.get(), weights_.get()};
  }

  // Writes the next queued chunk unless a write is in flight; with rings,
  // every queued chunk (caller's thread only).
  void Pump() ABSL_LOCKS_EXCLUDED(lane_->mu) {
    if (ring()) {
      PumpRing();
      return;
    }
    uint32_t id;
    {
      absl::MutexLock lock(&lane_->mu);
      if (lane_->writing || lane_->stopped || lane_->ready.empty()) return;
      id = lane_->ready.front();
      lane_->ready.pop_front();
      lane_->writing = true;
    }
    absl::StatusOr<grpc::ByteBuffer> message =
        client_->ChunkMessage(lane_, id, &header_, regions());
    if (!message.ok()) {
      {
        absl::MutexLock lock(&lane_->mu);
        lane_->writing = false;
        Stop(message.status());
      }
      ctx_.TryCancel();
      return;
    }
    write_buf_ = *std::move(message);
    StartWrite(&write_buf_);
  }

  // Ends the call and waits for gRPC to be done with it: a clean end
  // (half-close, the server finishes) when `cancel` is false and nothing
  // is in flight, else a cancel. Caller's thread only, once.
  void Close(bool cancel) ABSL_LOCKS_EXCLUDED(lane_->mu) {
    BeginClose(cancel);
    FinishClose(absl::Now() + absl::Seconds(5));
  }
  // Close in two halves, so that many calls can end in parallel: the
  // half-close (or cancel), then the wait, up to `deadline` for a clean
  // end before it cancels.
  void BeginClose(bool cancel) ABSL_LOCKS_EXCLUDED(lane_->mu) {
    {
      absl::MutexLock lock(&lane_->mu);
      clean_ =
          !cancel && !lane_->writing && !lane_->stopped && !lane_->reads_over;
      lane_->stopped = true;
    }
    if (clean_) {
      StartWritesDone();
    } else {
      ctx_.TryCancel();
    }
  }
  void FinishClose(absl::Time deadline) ABSL_LOCKS_EXCLUDED(lane_->mu) {
    if (clean_) {
      bool ended;
      {
        absl::MutexLock lock(&lane_->mu);
        ended = lane_->mu.AwaitWithDeadline(absl::Condition(&lane_->reads_over),
                                            deadline);
      }
      if (!ended) ctx_.TryCancel();
    }
    RemoveHold();
    absl::MutexLock lock(&lane_->mu);
    lane_->mu.Await(absl::Condition(&lane_->call_done));
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(lane_->mu) {
    // Drops this buffer's reference to the gradient (ReleaseSlice takes
    // the lane's mutex).
    write_buf_.Clear();
    {
      absl::MutexLock lock(&lane_->mu);
      lane_->writing = false;
      if (!ok) lane_->stopped = true;  // broken: the call's status says why
      if (lane_->ready.empty() && lane_->unqueued == 0) {
        lane_->writes_done = absl::Now();
      }
    }
    if (ok) Pump();
  }

  // With rings: takes the replies that came (caller's thread only) and,
  // unless `deadline` has passed, waits for the rest until the step's
  // every reply is in, an error stops the lane, or the stream ended.
  void TakeRingReplies(absl::Time deadline) ABSL_LOCKS_EXCLUDED(lane_->mu) {
    for (;;) {
      const uint32_t seen = replies_->wakeups();
      bool over;
      {
        // Read first: the shard put every reply in the ring before it
        // ended the stream.
        absl::MutexLock lock(&lane_->mu);
        over = lane_->reads_over || lane_->stopped;
      }
      absl::Status s = TakeRing();
      bool complete;
      {
        absl::MutexLock lock(&lane_->mu);
        if (!s.ok()) Stop(s);
        complete = lane_->answered.size() == lane_->chunk_ids.size();
      }
      if (!s.ok()) {
        ctx_.TryCancel();
        return;
      }
      const absl::Time now = absl::Now();
      if (complete || over || now >= deadline) return;
      // OnDone interrupts the wait; the cap only bounds a lost wake-up.
      replies_->WaitSince(seen, std::min(deadline - now, absl::Seconds(1)));
    }
  }

  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(lane_->mu) {
    if (!ok) {
      {
        absl::MutexLock lock(&lane_->mu);
        lane_->reads_over = true;
      }
      if (ring()) replies_->Interrupt();
      return;
    }
    if (ring()) {
      read_buf_.Clear();
      {
        absl::MutexLock lock(&lane_->mu);
        Stop(absl::InternalError(
            "bad reply: the shard answered through gRPC on a stream whose "
            "replies go through its message ring"));
      }
      ctx_.TryCancel();
      replies_->Interrupt();
      return;
    }
    absl::Status s = DecodeWithPayload(read_buf_, &lane_->reply.response,
                                       &lane_->reply.payload);
    bool took = false;
    {
      absl::MutexLock lock(&lane_->mu);
      // Outside a step nothing is asked: the step's buffers are not there.
      // A stopped stream's replies are still taken: a failed write does
      // not undo what the shard answered before it ended the stream, and
      // the step's buffers stay until Close has seen OnDone.
      if (s.ok() && !lane_->in_step) {
        s = absl::InternalError(absl::StrCat("bad reply: server sent chunk ",
                                             lane_->reply.response.chunk_id(),
                                             " which was not pushed"));
      }
      took = s.ok();
      if (took) ++lane_->taking;
    }
    if (took) s = client_->TakeReply(lane_, &expected_view(), regions());
    lane_->reply.payload.Clear();
    read_buf_.Clear();
    bool again;
    {
      absl::MutexLock lock(&lane_->mu);
      if (took) --lane_->taking;
      if (s.ok()) lane_->answered.push_back(lane_->reply.response.chunk_id());
      if (!s.ok()) Stop(s);
      again = s.ok();
    }
    if (again) {
      StartRead(&read_buf_);
    } else {
      ctx_.TryCancel();
    }
  }

  void OnDone(const grpc::Status& s) override ABSL_LOCKS_EXCLUDED(lane_->mu) {
    if (ring()) {
      {
        absl::MutexLock lock(&lane_->mu);
        lane_->final_status = s;
        lane_->reads_over = true;
      }
      replies_->Interrupt();  // before call_done: this may be gone after
    }
    absl::MutexLock lock(&lane_->mu);
    lane_->final_status = s;
    lane_->reads_over = true;
    lane_->call_done = true;  // the last touch: Close may destroy this now
  }

 private:
  // Appends every queued chunk's header to the requests' ring and wakes
  // the shard once.
  void PumpRing() ABSL_LOCKS_EXCLUDED(lane_->mu) {
    {
      absl::MutexLock lock(&lane_->mu);
      if (lane_->stopped) return;
      ring_ids_.assign(lane_->ready.begin(), lane_->ready.end());
      lane_->ready.clear();
    }
    absl::Status s;
    for (uint32_t id : ring_ids_) {
      if (!client_->IntoRegion(id, &header_, regions()) ||
          (!header_.push_only() && !header_.has_reply_shm_offset())) {
        s = absl::UnavailableError(absl::StrCat(
            kSharedMemoryErrorPrefix, "chunk ", id,
            " does not fit the stream's region (declared again?)"));
        break;
      }
      header_.SerializeToString(&ring_bytes_);
      s = requests_->Append(ring_bytes_);
      if (!s.ok()) {
        s = absl::UnavailableError(
            absl::StrCat(kSharedMemoryErrorPrefix,
                         "the stream's request ring: ", s.message()));
        break;
      }
    }
    requests_->Publish();
    {
      absl::MutexLock lock(&lane_->mu);
      if (!s.ok()) Stop(s);
      if (lane_->ready.empty() && lane_->unqueued == 0) {
        lane_->writes_done = absl::Now();
      }
    }
    if (!s.ok()) ctx_.TryCancel();
  }
  // Takes every reply in the replies' ring.
  absl::Status TakeRing() {
    for (;;) {
      absl::StatusOr<bool> popped = replies_->Pop(&ring_bytes_);
      if (!popped.ok()) {
        return absl::InternalError(absl::StrCat(
            "bad reply: the stream's reply ring: ", popped.status().message()));
      }
      if (!*popped) return absl::OkStatus();
      Reply& r = lane_->reply;
      r.payload.Clear();
      if (!r.response.ParseFromString(ring_bytes_)) {
        return absl::InternalError(
            "bad reply: a malformed PushPullResponse in the stream's reply "
            "ring");
      }
      {
        absl::MutexLock lock(&lane_->mu);
        if (!lane_->in_step) {
          return absl::InternalError(
              absl::StrCat("bad reply: server sent chunk ",
                           r.response.chunk_id(), " which was not pushed"));
        }
      }
      SHARDPS_RETURN_IF_ERROR(
          client_->TakeReply(lane_, &expected_view(), regions()));
      absl::MutexLock lock(&lane_->mu);
      lane_->answered.push_back(r.response.chunk_id());
    }
  }
  void Stop(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane_->mu) {
    if (lane_->status.ok()) lane_->status = s;
    lane_->stopped = true;
  }
  // The lane's expected replies, read by TakeReply on this reaction only
  // (entries of this lane's chunks).
  std::vector<bool>& expected_view() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return lane_->expected;
  }

  Client* const client_;
  Stream* const lane_;
  grpc::ClientContext ctx_;
  bool clean_ = false;  // BeginClose half-closed (caller's thread only)
  std::unique_ptr<SharedRegion> region_;  // null: payloads in the messages
  // The client's gradient and weight regions this call named (null: none).
  std::shared_ptr<const SharedRegion> gradients_;
  std::shared_ptr<const SharedRegion> weights_;
  // The message rings in region_ (null: none), used by the caller's thread
  // only, and its scratch.
  std::unique_ptr<MessageRing> requests_;
  std::unique_ptr<MessageRing> replies_;
  std::vector<uint32_t> ring_ids_;
  std::string ring_bytes_;
  grpc::ByteBuffer read_buf_;   // the read flow's
  grpc::ByteBuffer write_buf_;  // the write flow's, until OnWriteDone
  v1::PushPullRequest header_;  // the write flow's
};

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

}  // namespace

Client::Client(ClientOptions options) : options_(std::move(options)) {}
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
      auto lane = std::make_unique<Stream>();
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

absl::Status Client::DeclareOn(size_t shard, const v1::DeclareRequest& req,
                               absl::Time deadline, v1::DeclareResponse* resp) {
  Stream& lane = *lanes_[shard * options_.streams_per_shard];
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
  if (probe_ != nullptr) req.set_shared_memory_probe(probe_->path());
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
  const int k = options_.streams_per_shard;
  layout_ = layout;
  if (options_.compression.weights == v1::ENCODING_TOPK) {
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
  }
  optimizer_ = optimizer;
  if (options_.shared_memory && probe_ == nullptr) {
    // 16 random bytes the shards read back: a shard that can, shares this
    // machine (and its /proc) with this process.
    absl::StatusOr<std::unique_ptr<SharedRegion>> probe =
        SharedRegion::Create(16);
    if (probe.ok()) {
      std::random_device random;
      for (int i = 0; i < 4; ++i) {
        const uint32_t word = random();
        std::memcpy((*probe)->data() + 4 * i, &word, 4);
      }
      probe_token_.assign((*probe)->data(), 16);
      probe_ = *std::move(probe);
    }
  }
  std::vector<v1::DeclareResponse> declared(num_shards);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  SHARDPS_RETURN_IF_ERROR(RunParallel(num_shards, [&](size_t shard) {
    v1::DeclareResponse& resp = declared[shard];
    SHARDPS_RETURN_IF_ERROR(
        DeclareOn(shard, DeclareRequestFor(shard), deadline, &resp));
    std::vector<uint32_t> want;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (shard_of[i] == shard) want.push_back(static_cast<uint32_t>(i));
    }
    if (std::vector<uint32_t>(resp.chunk_ids().begin(),
                              resp.chunk_ids().end()) != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", shard, " at ", lanes_[shard * k]->address,
          " owns other chunks than this worker computed: is it started with "
          "--shard_index=",
          shard, " --num_shards=", num_shards, "?"));
    }
    return absl::OkStatus();
  }));
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
  shm_shards_.assign(num_shards, 0);
  ring_shards_.assign(num_shards, 0);
  // Rings carry headers only: every payload must go through the region.
  const bool ringable = options_.shared_memory_rings &&
                        options_.compression.gradients == v1::ENCODING_FP32 &&
                        options_.compression.weights != v1::ENCODING_TOPK;
  for (uint32_t shard = 0; shard < num_shards; ++shard) {
    shm_shards_[shard] = probe_ != nullptr &&
                         declared[shard].shared_memory_token() == probe_token_;
    ring_shards_[shard] =
        shm_shards_[shard] && ringable && declared[shard].shared_memory_rings();
  }
  declared_states_ = std::move(declared);
  // Spread each shard's chunks over its lanes, largest first. A shard that
  // owns little gains nothing from parallel streams but their threads'
  // wake-ups: it gets one lane.
  for (auto& lane : lanes_) lane->chunk_ids.clear();
  std::vector<int64_t> shard_bytes(num_shards, 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    shard_bytes[shard_of[i]] += chunks[i].bytes();
  }
  std::vector<int64_t> lane_bytes(lanes_.size(), 0);
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return chunks[a].num_elements > chunks[b].num_elements;
  });
  for (size_t i : order) {
    const size_t first = shard_of[i] * k;
    const int lanes = shard_bytes[shard_of[i]] <= kOneLaneShardBytes ? 1 : k;
    size_t best = first;
    for (size_t l = first; l < first + lanes; ++l) {
      if (lane_bytes[l] < lane_bytes[best]) best = l;
    }
    lanes_[best]->chunk_ids.push_back(static_cast<uint32_t>(i));
    lane_bytes[best] += chunks[i].bytes();
  }
  for (auto& lane : lanes_) {
    std::sort(lane->chunk_ids.begin(), lane->chunk_ids.end());
  }
  lane_of_.assign(chunks.size(), 0);
  for (size_t l = 0; l < lanes_.size(); ++l) {
    for (uint32_t id : lanes_[l]->chunk_ids) {
      lane_of_[id] = static_cast<uint32_t>(l);
    }
  }
  // Each lane's region: its chunks' gradients, then their weights, each at
  // a cache line.
  shm_gradient_at_.assign(chunks.size(), 0);
  shm_weights_at_.assign(chunks.size(), 0);
  for (auto& lane : lanes_) {
    uint64_t at = 0;
    auto place = [&at](int64_t bytes) {
      const uint64_t here = at;
      at += (static_cast<uint64_t>(bytes) + 63) / 64 * 64;
      return here;
    };
    for (uint32_t id : lane->chunk_ids) {
      shm_gradient_at_[id] = place(chunks[id].bytes());
    }
    for (uint32_t id : lane->chunk_ids) {
      shm_weights_at_[id] = place(chunks[id].bytes());
    }
    lane->shm_bytes = at;
    lane->ring_bytes =
        MessageRing::BytesFor(lane->chunk_ids.size(), kRingMessageBytes);
  }
  // Each shard's Pull region: the weights of its chunks, each at a cache
  // line.
  shm_pull_at_.assign(chunks.size(), 0);
  pull_region_bytes_.assign(num_shards, 0);
  pull_regions_.clear();
  pull_regions_.resize(num_shards);
  for (size_t id = 0; id < chunks.size(); ++id) {
    uint64_t& at = pull_region_bytes_[shard_of[id]];
    shm_pull_at_[id] = at;
    at += (static_cast<uint64_t>(chunks[id].bytes()) + 63) / 64 * 64;
  }
  // The gradient and weight regions: every tensor, in layout order, each
  // at a cache line.
  std::vector<uint64_t> tensor_at(layout.tensors_size());
  uint64_t buffer_bytes = 0;
  for (int t = 0; t < layout.tensors_size(); ++t) {
    tensor_at[t] = buffer_bytes;
    buffer_bytes +=
        (static_cast<uint64_t>(NumElements(layout.tensors(t))) * 4 + 63) / 64 *
        64;
  }
  const bool any_shm =
      std::find(shm_shards_.begin(), shm_shards_.end(), 1) != shm_shards_.end();
  // Decided once per layout: a Declare of the same model again (a worker
  // that recovers) keeps the buffers the caller holds, and what they hold,
  // whatever the shards now say about shared memory.
  if (tensor_at != tensor_at_) {
    gradient_region_.reset();
    weight_region_.reset();
    if (any_shm && buffer_bytes > 0) {
      NewBufferRegions(buffer_bytes, /*keep_weights=*/false);
    }
  }
  tensor_at_ = std::move(tensor_at);
  first_chunk_.assign(layout.tensors_size() + 1, 0);
  for (const ChunkSpec& c : chunks) ++first_chunk_[c.tensor + 1];
  for (int t = 0; t < layout.tensors_size(); ++t) {
    first_chunk_[t + 1] += first_chunk_[t];
  }
  // A model declared again keeps its residuals only if it is the same.
  if (options_.compression.gradients != v1::ENCODING_FP32 &&
      (compressor_ == nullptr || !compressor_->SameChunks(chunks))) {
    compressor_ =
        std::make_unique<GradientCompressor>(options_.compression, chunks);
  }
  bool same_chunks = copies_.size() == chunks.size();
  for (size_t i = 0; same_chunks && i < chunks.size(); ++i) {
    same_chunks =
        copies_[i].size() == static_cast<size_t>(chunks[i].num_elements);
  }
  if (options_.compression.weights == v1::ENCODING_TOPK && !same_chunks) {
    copies_.clear();
    for (const ChunkSpec& c : chunks) copies_.emplace_back(c.num_elements);
    copy_version_.assign(chunks.size(), -1);
  }
  chunks_ = std::move(chunks);
  shard_of_ = std::move(shard_of);
  declared_ = true;
  return absl::OkStatus();
}

void Client::NewBufferRegions(uint64_t bytes, bool keep_weights) {
  absl::StatusOr<std::unique_ptr<SharedRegion>> gradients =
      SharedRegion::Create(bytes);
  absl::StatusOr<std::unique_ptr<SharedRegion>> weights =
      SharedRegion::Create(bytes);
  // Without them (out of memory or descriptors) gradients and weights are
  // copied, or, when renewing, the old ones stay.
  if (!gradients.ok() || !weights.ok()) return;
  if (keep_weights && weight_region_ != nullptr) {
    std::memcpy((*weights)->data(), weight_region_->data(), bytes);
  }
  ++buffer_regions_;
  gradient_region_ = *std::move(gradients);
  weight_region_ = *std::move(weights);
}

void Client::RenewBufferRegions() {
  // A stream that ended without finishing the step may still have a push
  // being read, or a reply being written, by its shard: later steps use
  // regions of their own (the weights carried over), and streams that name
  // the old ones are replaced (Open). The old ones stay mapped until the
  // next renewal: the caller may still read what it left there.
  if (gradient_region_ == nullptr) return;
  retired_gradient_region_ = gradient_region_;
  retired_weight_region_ = weight_region_;
  NewBufferRegions(gradient_region_->size(), /*keep_weights=*/true);
}

Tensors Client::TensorsIn(const SharedRegion* region) const {
  Tensors buffers;
  if (region == nullptr) return buffers;
  for (int t = 0; t < layout_.tensors_size(); ++t) {
    buffers.emplace_back(
        reinterpret_cast<float*>(region->data() + tensor_at_[t]),
        NumElements(layout_.tensors(t)));
  }
  return buffers;
}

Tensors Client::GradientBuffers() { return TensorsIn(gradient_region_.get()); }

Tensors Client::WeightBuffers() { return TensorsIn(weight_region_.get()); }

bool Client::rings(uint32_t shard) const {
  return shared_memory(shard) && shard < ring_shards_.size() &&
         ring_shards_[shard];
}

std::string Client::DescribeTransport() const {
  std::vector<std::string> shm;
  std::string why;
  for (uint32_t s = 0; s < shm_shards_.size(); ++s) {
    if (shm_shards_[s]) {
      shm.push_back(absl::StrCat(s));
    } else if (why.empty() && s < declared_states_.size()) {
      why = declared_states_[s].shared_memory_error();
      if (why.empty()) why = "no shared memory asked";
      why = absl::StrCat(" (shard ", s, ": ", why, ")");
    }
  }
  if (shm.empty()) return absl::StrCat("payloads over gRPC", why);
  if (shm.size() == shm_shards_.size()) {
    bool all_rings = true;
    for (uint32_t s = 0; s < shm_shards_.size(); ++s) {
      all_rings = all_rings && rings(s);
    }
    return all_rings ? "payloads and headers through shared memory (message "
                       "rings) with every shard"
                     : "payloads through shared memory with every shard";
  }
  return absl::StrCat("payloads through shared memory with shards ",
                      absl::StrJoin(shm, ", "), ", over gRPC to the rest", why);
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

void Client::FillHeader(uint32_t id, v1::PushPullRequest* header) const {
  const OpenStep& o = *open_;
  const uint32_t tensor = chunks_[id].tensor;
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
  if (o.learning_rate[tensor].has_value()) {
    header->set_learning_rate(*o.learning_rate[tensor]);
  }
  header->set_no_gradient(o.no_gradient[tensor]);
  header->set_initial_values(o.initial_values);
}

bool Client::Compressed(uint32_t id) const {
  return compressor_ != nullptr && !open_->initial_values &&
         !open_->no_gradient[chunks_[id].tensor] && compressor_->compresses(id);
}

std::optional<uint64_t> Client::PlaceIn(const SharedRegion* region,
                                        const void* p, int64_t bytes) {
  if (region == nullptr) return std::nullopt;
  const auto at = reinterpret_cast<uintptr_t>(p) -
                  reinterpret_cast<uintptr_t>(region->data());
  if (!region->Contains(at, static_cast<uint64_t>(bytes))) return std::nullopt;
  return at;
}

std::optional<uint64_t> Client::ReplyInWeightRegion(
    const ChunkSpec& c, const CallRegions& regions) const {
  if (regions.stream == nullptr || open_->push_only ||
      EffectiveEncoding(options_.compression.weights) != v1::ENCODING_FP32) {
    return std::nullopt;
  }
  return PlaceIn(regions.weights, open_->weights[c.tensor].data() + c.offset,
                 c.bytes());
}

bool Client::IntoRegion(uint32_t id, v1::PushPullRequest* header,
                        const CallRegions& regions) {
  const ChunkSpec& c = chunks_[id];
  SharedRegion* region = regions.stream;
  FillHeader(id, header);
  // Kept in the weight region: the shard writes the weights there.
  // Otherwise into the stream's region; one from before the model was
  // declared again may not fit.
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    header->set_reply_in_weight_region(true);
    header->set_reply_shm_offset(*at);
  } else if (region != nullptr && !open_->push_only &&
             options_.compression.weights != v1::ENCODING_TOPK &&
             region->Contains(shm_weights_at_[id], c.bytes())) {
    header->set_reply_shm_offset(shm_weights_at_[id]);
  }
  if (open_->no_gradient[c.tensor]) return true;
  if (region != nullptr && !Compressed(id)) {
    // Computed in the gradient region: the shard reads it there.
    if (const std::optional<uint64_t> at =
            PlaceIn(regions.gradients,
                    open_->gradients[c.tensor].data() + c.offset, c.bytes())) {
      header->set_shm_in_gradient_region(true);
      header->set_shm_offset(*at);
      header->set_shm_bytes(c.bytes());
      return true;
    }
  }
  if (region != nullptr && !Compressed(id) &&
      region->Contains(shm_gradient_at_[id], c.bytes())) {
    std::memcpy(region->data() + shm_gradient_at_[id],
                open_->gradients[c.tensor].data() + c.offset, c.bytes());
    header->set_shm_offset(shm_gradient_at_[id]);
    header->set_shm_bytes(c.bytes());
    return true;
  }
  return false;
}

absl::StatusOr<grpc::ByteBuffer> Client::ChunkMessage(
    Stream* lane, uint32_t id, v1::PushPullRequest* header,
    const CallRegions& regions) {
  const ChunkSpec& c = chunks_[id];
  if (IntoRegion(id, header, regions)) {
    return lane->Message(*header, nullptr, 0);
  }
  if (Compressed(id)) {
    absl::string_view& payload = open_->payloads[id];
    if (payload.data() == nullptr) {
      // Encoded here, on the lane's thread, as the lane gets to it: lanes
      // encode in parallel, and while earlier chunks are on the wire.
      absl::StatusOr<absl::string_view> encoded = compressor_->Encode(
          id, open_->gradients[c.tensor].data() + c.offset, open_->step);
      if (!encoded.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient of tensor ", layout_.tensors(c.tensor).name(), " (chunk ",
            id, ", tensor elements from ", c.offset,
            "): ", encoded.status().message()));
      }
      payload = *encoded;
    }
    return lane->Message(*header, payload.data(), payload.size());
  }
  return lane->Message(*header, open_->gradients[c.tensor].data() + c.offset,
                       c.bytes());
}

void Client::set_rollback_id(uint64_t id) {
  if (id != rollback_id_ && compressor_ != nullptr) compressor_->Reset();
  rollback_id_ = id;
}

absl::Status Client::TakeReply(Stream* lane, std::vector<bool>* expected,
                               const CallRegions& regions) {
  const uint32_t id = lane->reply.response.chunk_id();
  if (id >= chunks_.size() || lane_of_[id] != lane->index || !(*expected)[id]) {
    return absl::InternalError(
        absl::StrCat("bad reply: server sent chunk ", id,
                     " which was not pushed or was answered already"));
  }
  (*expected)[id] = false;
  // Acknowledged: what this payload dropped is the chunk's residual now.
  if (Compressed(id)) compressor_->Commit(id);
  if (open_->push_only) {
    // The shard moved its copy of what workers hold without telling this
    // one: a Pull must fetch it again before sparse replies can follow.
    if (!copy_version_.empty()) copy_version_[id] = -1;
    return absl::OkStatus();
  }
  const ChunkSpec& c = chunks_[id];
  float* out = open_->weights[c.tensor].data() + c.offset;
  // Where this chunk's push asked for its reply (IntoRegion).
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    return ReadWeights(&lane->reply, c, out, regions.weights, *at);
  }
  return ReadWeights(&lane->reply, c, out, regions.stream, shm_weights_at_[id]);
}

absl::Status Client::ReadWeights(Reply* r, const ChunkSpec& c, float* out,
                                 const SharedRegion* region, uint64_t at) {
  const v1::Encoding got = EffectiveEncoding(r->response.encoding());
  const v1::Encoding asked = options_.compression.weights;
  const bool sparse = asked == v1::ENCODING_TOPK;
  // The payload: in the message, or where this chunk's weights lie in the
  // call's region.
  const uint64_t in_shm = r->response.shm_bytes();
  if (in_shm > 0 && (region == nullptr || sparse || r->payload.size() != 0 ||
                     in_shm > static_cast<uint64_t>(c.bytes()) ||
                     !region->Contains(at, in_shm))) {
    return absl::InternalError(absl::StrCat(
        "bad reply: weights of chunk ", c.id, " said to be ", in_shm,
        " bytes of shared memory, which this call did not ask for"));
  }
  StringByteSource shared(in_shm > 0
                              ? absl::string_view(region->data() + at, in_shm)
                              : absl::string_view());
  const ByteSource& payload =
      in_shm > 0 ? static_cast<const ByteSource&>(shared) : r->payload;
  absl::Status s;
  if (got == v1::ENCODING_TOPK && sparse) {
    // k = 0 is fine here: an update that changed nothing.
    if (payload.size() < 4 || (payload.size() - 4) % 8 != 0 ||
        (payload.size() - 4) / 8 > static_cast<uint64_t>(c.num_elements)) {
      s = absl::InvalidArgumentError(absl::StrCat("sparse weights of chunk ",
                                                  c.id, " have ",
                                                  payload.size(), " bytes"));
    }
  } else {
    s = CheckPayload(got, payload.size(), c.num_elements);
    // Sparse weights come whole as FP32 when a reply has no changes.
    if (s.ok() && got != asked && !(sparse && got == v1::ENCODING_FP32)) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "weights of chunk ", c.id, " came as ", EncodingName(got),
          ", not the ", EncodingName(asked), " asked for"));
    }
  }
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("bad reply: ", s.message()));
  }
  float* whole = sparse ? copies_[c.id].data() : out;
  if (got == v1::ENCODING_FP32) {
    // Written in place by the shard (the weight region): nothing to copy.
    if (in_shm == 0 ||
        region->data() + at != reinterpret_cast<const char*>(whole)) {
      payload.CopyTo(reinterpret_cast<char*>(whole));
    }
  } else {
    r->scratch.resize(payload.size());
    payload.CopyTo(r->scratch.data());
    if (got == v1::ENCODING_BF16) {
      DecodeBf16(reinterpret_cast<const uint16_t*>(r->scratch.data()),
                 c.num_elements, whole);
    } else {
      SHARDPS_RETURN_IF_ERROR(ApplyChanges(r, c, r->response.version()));
    }
  }
  if (sparse) {
    copy_version_[c.id] = r->response.version();
    std::memcpy(out, whole, c.bytes());
  }
  return absl::OkStatus();
}

absl::Status Client::ApplyChanges(Reply* r, const ChunkSpec& c,
                                  int64_t version) {
  // The changes of the update to `version`: this worker must hold the copy
  // before it (or already this one: a step redone after a lost reply).
  if (copy_version_[c.id] == version) return absl::OkStatus();
  if (copy_version_[c.id] != version - 1) {
    return absl::InternalError(absl::StrCat(
        "bad reply: the changes of chunk ", c.id, " to version ", version,
        " need its weights of version ", version - 1, "; this worker holds ",
        copy_version_[c.id] < 0 ? std::string("none")
                                : absl::StrCat("version ", copy_version_[c.id]),
        " (Pull first)"));
  }
  const char* p = r->scratch.data();
  uint32_t k;
  std::memcpy(&k, p, 4);
  if (r->scratch.size() != 4 + 8 * static_cast<size_t>(k)) {
    return absl::InternalError(
        absl::StrCat("bad reply: sparse weights of chunk ", c.id, " list ", k,
                     " elements in ", r->scratch.size(), " bytes"));
  }
  // Checked whole before the copy changes.
  int64_t last = -1;
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t i;
    std::memcpy(&i, p + 4 + 4 * static_cast<size_t>(j), 4);
    if (static_cast<int64_t>(i) <= last || i >= c.num_elements) {
      return absl::InternalError(
          absl::StrCat("bad reply: sparse weights of chunk ", c.id,
                       " list element ", i, " out of order or range"));
    }
    last = i;
  }
  float* copy = copies_[c.id].data();
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t i;
    std::memcpy(&i, p + 4 + 4 * static_cast<size_t>(j), 4);
    std::memcpy(copy + i, p + 4 + 4 * static_cast<size_t>(k) + 4 * j, 4);
  }
  return absl::OkStatus();
}

absl::Status Client::Attempt(Stream* lane, std::vector<uint32_t>* pending) {
  std::vector<bool> asked(chunks_.size(), false);
  for (uint32_t id : *pending) asked[id] = true;
  std::vector<bool> answered(chunks_.size(), false);
  absl::Status reply_error;
  absl::Status status;
  {  // The call lives in this scope; its end drops gRPC's slice references.
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.rpc_timeout));
    const grpc::internal::RpcMethod method(
        kPushPullMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
    std::unique_ptr<
        grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
        stream(grpc::internal::ClientReaderWriterFactory<
               grpc::ByteBuffer, grpc::ByteBuffer>::Create(lane->channel.get(),
                                                           method, &ctx));
    // A retry: written first, then the replies read (writes never wait for
    // reads: the server reads every message as it arrives).
    v1::PushPullRequest header;
    bool written = true;
    for (uint32_t id : *pending) {
      absl::StatusOr<grpc::ByteBuffer> message =
          ChunkMessage(lane, id, &header, CallRegions());
      if (!message.ok()) {
        reply_error = message.status();
        ctx.TryCancel();
        written = false;
        break;
      }
      if (!stream->Write(*message)) {
        written = false;  // broken: Finish says why
        break;
      }
    }
    if (written) stream->WritesDone();
    {
      absl::MutexLock lock(&lane->mu);
      lane->writes_done = absl::Now();
    }
    grpc::ByteBuffer buffer;
    while (stream->Read(&buffer)) {
      reply_error = DecodeWithPayload(buffer, &lane->reply.response,
                                      &lane->reply.payload);
      if (reply_error.ok()) {
        reply_error = TakeReply(lane, &asked, CallRegions());
      }
      if (!reply_error.ok()) {
        ctx.TryCancel();
        break;
      }
      answered[lane->reply.response.chunk_id()] = true;
    }
    status = FromGrpcStatus(stream->Finish());
  }
  // The caller may reuse its gradient buffers once this returns.
  if (!lane->AwaitSlicesReleased(absl::Seconds(60))) {
    return absl::InternalError(
        "gRPC still references gradient buffers 60 s after the call ended");
  }
  pending->erase(std::remove_if(pending->begin(), pending->end(),
                                [&](uint32_t id) { return answered[id]; }),
                 pending->end());
  if (!reply_error.ok()) return reply_error;
  if (status.ok() && !pending->empty()) {
    return absl::InternalError(absl::StrCat("stream ended without replies for ",
                                            pending->size(), " chunks"));
  }
  return status;
}

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
    // Sets the step's state in the same section that finds the lane's
    // stream alive (false if it is not): a reply that ends the stream
    // meanwhile fails this step, not the last one.
    auto arm = [this](Stream* l) {
      absl::MutexLock lock(&l->mu);
      if (l->call != nullptr && l->call_dead()) return false;
      l->in_step = true;
      l->ready.clear();
      l->unqueued = static_cast<int64_t>(l->chunk_ids.size());
      l->expected.assign(chunks_.size(), false);
      for (uint32_t id : l->chunk_ids) l->expected[id] = true;
      l->answered.clear();
      l->status = absl::OkStatus();
      l->writes_done = open_->start;
      return true;
    };
    if (lane->call != nullptr && lane->call->NamesOtherBuffers()) {
      // Its stream names a gradient or weight region that was replaced
      // (after a failed step, or a Declare of another layout): a new stream
      // names the current ones.
      lane->call->Close(/*cancel=*/false);
      lane->call.reset();
    }
    if (!arm(lane.get())) {
      // The server ended it between steps (restarted, or shut down), or
      // sent what nobody asked for: a new stream for this step.
      lane->call->Close(/*cancel=*/true);
      lane->call.reset();
      arm(lane.get());
    }
    if (lane->call == nullptr) {
      lane->call = std::make_unique<LaneCall>(this, lane.get());
      lane->call->Start();
    }
  }
  return absl::OkStatus();
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
  for (uint32_t id = first_chunk_[tensor]; id < first_chunk_[tensor + 1];
       ++id) {
    Stream* lane = lanes_[lane_of_[id]].get();
    absl::MutexLock lock(&lane->mu);
    lane->ready.push_back(id);
    --lane->unqueued;
  }
  // Each lane the tensor touched starts writing unless it is already.
  for (uint32_t id = first_chunk_[tensor]; id < first_chunk_[tensor + 1];
       ++id) {
    const Stream* lane = lanes_[lane_of_[id]].get();
    if (id == first_chunk_[tensor] || lane_of_[id] != lane_of_[id - 1]) {
      lane->call->Pump();
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

absl::Status Client::EncodeTensor(int tensor,
                                  absl::Span<const float> gradient) {
  OpenStep& o = *open_;
  for (uint32_t id = first_chunk_[tensor]; id < first_chunk_[tensor + 1];
       ++id) {
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

absl::Status Client::EndLaneStep(Stream* lane, bool cancel,
                                 std::vector<uint32_t>* answered) {
  absl::Status status;
  bool complete = false;
  if (lane->call != nullptr && lane->call->ring() && !cancel) {
    lane->call->TakeRingReplies(open_->start + options_.rpc_timeout);
  }
  if (lane->call != nullptr) {
    absl::MutexLock lock(&lane->mu);
    if (!cancel) {
      // Every reply in, an error of ours, or the end of the stream. Not
      // just a failed write: the shard ends a stream with its status after
      // the replies it sent, and a cancel before they are read would
      // replace that status (UNAVAILABLE, which is retried; ABORTED or
      // OUT_OF_RANGE, which the caller acts on) with CANCELLED.
      const absl::Time deadline = open_->start + options_.rpc_timeout;
      lane->mu.AwaitWithDeadline(
          absl::Condition(
              +[](Stream* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu) {
                return (l->answered.size() == l->chunk_ids.size() &&
                        l->taking == 0) ||
                       l->reads_over || !l->status.ok();
              },
              lane),
          deadline);
      complete = lane->answered.size() == lane->chunk_ids.size() &&
                 lane->taking == 0 && lane->status.ok();
      // At once: a stray reply after this finds no step to write into.
      if (complete) lane->in_step = false;
      if (!complete && lane->status.ok() && !lane->reads_over) {
        lane->status = absl::DeadlineExceededError(absl::StrCat(
            "no reply for ", lane->chunk_ids.size() - lane->answered.size(),
            " of ", lane->chunk_ids.size(), " chunks within ",
            absl::FormatDuration(options_.rpc_timeout)));
      }
    }
  }
  if (lane->call != nullptr && !complete) {
    // The step failed on this stream (or is given up): a new one next time.
    lane->call->Close(/*cancel=*/true);
    absl::MutexLock lock(&lane->mu);
    status = lane->status;
    if (status.ok()) status = FromGrpcStatus(lane->final_status);
    if (status.ok() && !cancel) {
      status = absl::InternalError(absl::StrCat(
          "stream ended without replies for ",
          lane->chunk_ids.size() - lane->answered.size(), " chunks"));
    }
  }
  if (lane->call != nullptr && !complete) lane->call.reset();
  if (absl::IsUnavailable(status) &&
      absl::StrContains(status.message(), kSharedMemoryErrorPrefix)) {
    // The shard could not map this stream's region (it moved, or its
    // limits): the retry and later streams carry payloads in the messages.
    shm_shards_[lane->shard] = 0;
  }
  {
    absl::MutexLock lock(&lane->mu);
    lane->in_step = false;
    // Only a failed step's are needed (to retry the rest).
    if (answered != nullptr && !complete) *answered = lane->answered;
  }
  // The caller may reuse its gradient buffers once the step returns.
  if (!lane->AwaitSlicesReleased(absl::Seconds(60)) && status.ok()) {
    status = absl::InternalError(
        "gRPC still references gradient buffers 60 s after they were sent");
  }
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
  RenewBufferRegions();
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
  const int64_t step = open_->step;
  absl::Status status;
  if (!failed.empty()) {
    // Retries run one lane per thread; only after a failure.
    status = RunParallel(failed.size(), [&](size_t i) {
      Stream* lane = lanes_[failed[i]].get();
      absl::Status s = lane_status[failed[i]];
      std::vector<uint32_t> pending;
      std::vector<bool> answered(chunks_.size(), false);
      for (uint32_t id : lane_answered[failed[i]]) answered[id] = true;
      for (uint32_t id : lane->chunk_ids) {
        if (!answered[id]) pending.push_back(id);
      }
      absl::Duration backoff = options_.initial_backoff;
      for (int attempt = 1; !pending.empty() && IsRetryable(s) &&
                            attempt < options_.max_attempts;
           ++attempt) {
        retries_.fetch_add(1);
        absl::SleepFor(backoff);
        backoff = std::min(backoff * 2, options_.max_backoff);
        s = Attempt(lane, &pending);
      }
      if (pending.empty()) s = absl::OkStatus();
      return WithPrefix(absl::StrCat("step ", step, " on shard ", lane->shard,
                                     " at ", lane->address),
                        s);
    });
  }
  absl::Time pushed = open_->start;
  for (const auto& lane : lanes_) {
    absl::MutexLock lock(&lane->mu);
    pushed = std::max(pushed, lane->writes_done);
  }
  last_push_time_ = pushed - open_->start;
  open_.reset();
  if (!failed.empty()) RenewBufferRegions();
  return status;
}

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
  Stream& lane = *lanes_[shard * options_.streams_per_shard];
  absl::Duration backoff = options_.initial_backoff;
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.rpc_timeout));
    v1::PullRequest req;
    // Pull sends sparse weights whole.
    const bool sparse = options_.compression.weights == v1::ENCODING_TOPK;
    req.set_encoding(sparse ? v1::ENCODING_FP32 : options_.compression.weights);
    std::unique_ptr<SharedRegion>& region = pull_regions_[shard];
    if (shared_memory(shard) && !sparse && region == nullptr &&
        pull_region_bytes_[shard] > 0) {
      absl::StatusOr<std::unique_ptr<SharedRegion>> created =
          SharedRegion::Create(pull_region_bytes_[shard]);
      // Without one (out of memory or descriptors) the weights come in
      // the messages.
      if (created.ok()) region = *std::move(created);
    }
    const bool through_shm = shared_memory(shard) && !sparse && region;
    if (through_shm) {
      ctx.AddMetadata(kSharedMemoryMetadata,
                      absl::StrCat(region->path(), " ", region->size()));
      auto& offsets = *req.mutable_reply_shm_offsets();
      for (uint32_t id = 0; id < chunks_.size(); ++id) {
        if (shard_of_[id] == shard) offsets[id] = shm_pull_at_[id];
      }
    }
    grpc::ByteBuffer request;
    bool own = false;
    grpc::SerializationTraits<v1::PullRequest>::Serialize(req, &request, &own)
        .IgnoreError();
    const grpc::internal::RpcMethod method(
        kPullMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
            lane.channel.get(), method, &ctx, request));
    grpc::ByteBuffer buffer;
    size_t received = 0;
    absl::Status reply_error;
    Reply reply;  // the lane's own may be a step's
    while (reader->Read(&buffer)) {
      reply_error = DecodeWithPayload(buffer, &reply.response, &reply.payload);
      const uint32_t id = reply.response.chunk_id();
      if (reply_error.ok() &&
          (id >= chunks_.size() || shard_of_[id] != shard)) {
        reply_error = absl::InternalError(
            absl::StrCat("server sent chunk ", id, " which it does not own"));
      }
      if (reply_error.ok()) {
        const ChunkSpec& c = chunks_[id];
        reply_error =
            ReadWeights(&reply, c, weights[c.tensor].data() + c.offset,
                        through_shm ? region.get() : nullptr, shm_pull_at_[id]);
      }
      if (!reply_error.ok()) {
        ctx.TryCancel();
        break;
      }
      ++received;
    }
    status = FromGrpcStatus(reader->Finish());
    if (!reply_error.ok()) status = reply_error;
    const size_t owned = std::count(shard_of_.begin(), shard_of_.end(), shard);
    if (status.ok() && received != owned) {
      status = absl::InternalError(absl::StrCat(
          "Pull returned ", received, " chunks; the shard owns ", owned));
    }
    if (status.ok()) break;
    // The shard may still be writing into this call's region.
    if (through_shm) region.reset();
    if (absl::IsUnavailable(status) &&
        absl::StrContains(status.message(), kSharedMemoryErrorPrefix)) {
      shm_shards_[shard] = 0;  // the shard cannot map it: over gRPC
    }
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
    Stream& lane = *lanes_[shard * options_.streams_per_shard];
    return WithPrefix(
        absl::StrCat("GetStatus of shard ", shard, " at ", lane.address),
        FromGrpcStatus(
            lane.stub->GetStatus(&ctx, v1::GetStatusRequest(), &out[shard])));
  }));
  return out;
}

}  // namespace shardps
