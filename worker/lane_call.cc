// Threads. A lane is touched by three kinds of thread:
//   - the stepping thread: the caller's (BeginStep, Queue, EndStep from
//     Client::Open, PushTensor, FinishStep) or, for a retry, the RunParallel
//     thread that owns this lane's retry (Retry). It alone creates, starts
//     and closes `call`, queues chunks (Queue), pumps a ring's writes and
//     takes a ring's replies (PumpRing, TakeRingReplies: the rings and their
//     scratch are its), and waits for the step's end (EndStep);
//   - gRPC's reactions: OnWriteDone writes the next queued chunk (Pump
//     then runs there, building the message through LaneOwner::MessageFor
//     into write_buf_ and header_, which belong to the write flow),
//     OnReadDone takes a reply through LaneOwner::TakeReply (read_buf_ and
//     Lane::reply belong to the read flow, which is one at a time), OnDone
//     records the end;
//   - whichever thread gRPC drops a gradient slice on (ReleaseSlice).
// Lane::mu guards the step's state (ready, unqueued, asked, expected,
// answered, taking, status, writes_done), the call's (writing, stopped,
// reads_over, call_done, final_status) and slices_in_flight; nothing is
// called with it held: no Start*, no owner callback, no cancel. Buffers:
// the gradients are the caller's until EndStep has seen every slice
// dropped; the weights are written by whichever flow takes the reply; the
// stream region is the call's (it dies with the call, after OnDone).
#include "worker/lane_call.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "common/transport.h"
#include "common/wire.h"
#include "grpcpp/support/sync_stream.h"

namespace shardps {
namespace {

// Raw (byte buffer) forms of the data-path methods; see common/wire.h.
constexpr char kPushPullMethod[] = "/shardps.v1.ParameterServer/PushPull";
constexpr char kPullMethod[] = "/shardps.v1.ParameterServer/Pull";

}  // namespace

Lane::Lane() = default;
Lane::~Lane() = default;

std::unique_ptr<Lane> Lane::Connect(size_t index, uint32_t shard,
                                    const std::string& address,
                                    const SecurityOptions& security, int k,
                                    int receive_buffer_bytes) {
  const int max_message = kMaxChunkBytes + kMessageOverheadBytes;
  auto lane = std::make_unique<Lane>();
  lane->index = index;
  lane->shard = shard;
  lane->address = address;
  lane->channel =
      MakeChannel(address, security,
                  ClientChannelArguments(max_message, k, receive_buffer_bytes));
  lane->stub = v1::ParameterServer::NewStub(lane->channel);
  return lane;
}

void Lane::ReleaseSlice(void* lane) {
  Lane* l = static_cast<Lane*>(lane);
  absl::MutexLock lock(&l->mu);
  --l->slices_in_flight;
}

grpc::ByteBuffer Lane::Message(const v1::PushPullRequest& header,
                               const void* data, int64_t bytes) {
  if (data == nullptr) return EncodeWithPayload(header, grpc::Slice());
  {
    absl::MutexLock lock(&mu);
    ++slices_in_flight;
  }
  return EncodeWithPayload(
      header, ReferenceSlice(data, bytes, &Lane::ReleaseSlice, this));
}

bool Lane::AwaitSlicesReleased(absl::Duration timeout) {
  absl::MutexLock lock(&mu);
  return mu.AwaitWithTimeout(
      absl::Condition(
          +[](int64_t* n) { return *n == 0; }, &slices_in_flight),
      timeout);
}

bool Lane::Arm(absl::Span<const uint32_t> ids, size_t num_chunks,
               absl::Time start) {
  absl::MutexLock lock(&mu);
  if (call != nullptr && call_dead()) return false;
  in_step = true;
  ready.clear();
  unqueued = static_cast<int64_t>(ids.size());
  asked = ids.size();
  expected.assign(num_chunks, false);
  for (uint32_t id : ids) expected[id] = true;
  answered.clear();
  replied.assign(num_chunks, false);
  status = absl::OkStatus();
  writes_done = start;
  return true;
}

bool Lane::AwaitReplied(uint32_t id, absl::Time deadline) {
  if (call == nullptr || call->ring()) return false;
  absl::MutexLock lock(&mu);
  if (!in_step || id >= replied.size()) return false;
  const auto over = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return replied[id] || reads_over || !status.ok();
  };
  mu.AwaitWithDeadline(absl::Condition(&over), deadline);
  return replied[id];
}

void Lane::BeginStep(LaneOwner* owner, const RegionsToName& names,
                     absl::Span<const uint32_t> ids, size_t num_chunks,
                     absl::Time start) {
  if (call != nullptr &&
      call->NamesOtherBuffers(names.gradients.get(), names.weights.get())) {
    // Its stream names a gradient or weight region that was replaced
    // (after a failed step, or a Declare of another layout): a new stream
    // names the current ones.
    call->Close(/*cancel=*/false);
    call.reset();
  }
  // A reply that ends the stream meanwhile fails this step, not the last
  // one.
  if (!Arm(ids, num_chunks, start)) {
    // The server ended it between steps (restarted, or shut down), or
    // sent what nobody asked for: a new stream for this step.
    call->Close(/*cancel=*/true);
    call.reset();
    Arm(ids, num_chunks, start);
  }
  if (call == nullptr) {
    call = std::make_unique<LaneCall>(owner, this);
    call->Start(names);
  }
}

absl::Status Lane::Retry(LaneOwner* owner, absl::Span<const uint32_t> ids,
                         size_t num_chunks, absl::Duration timeout,
                         std::vector<uint32_t>* answered_out) {
  const absl::Time deadline = absl::Now() + timeout;
  Arm(ids, num_chunks, absl::Now());
  call = std::make_unique<LaneCall>(owner, this);
  call->Start(RegionsToName());
  for (uint32_t id : ids) Queue(id);
  call->Pump();
  answered_out->clear();
  const absl::Status s = EndStep(false, deadline, timeout, answered_out);
  if (call != nullptr) {  // complete (EndStep ends a failed call)
    call->Close(/*cancel=*/false);
    call.reset();
  }
  if (s.ok()) answered_out->assign(ids.begin(), ids.end());
  return s;
}

void Lane::Queue(uint32_t id) {
  absl::MutexLock lock(&mu);
  ready.push_back(id);
  --unqueued;
}

absl::Time Lane::writes_done_at() {
  absl::MutexLock lock(&mu);
  return writes_done;
}

absl::Status Lane::EndStep(bool cancel, absl::Time deadline,
                           absl::Duration timeout,
                           std::vector<uint32_t>* answered_out) {
  absl::Status result;
  bool complete = false;
  if (call != nullptr && call->ring() && !cancel) {
    call->TakeRingReplies(deadline);
  }
  if (call != nullptr && !cancel) {
    absl::MutexLock lock(&mu);
    // Every reply in, an error of ours, or the end of the stream. Not just
    // a failed write: the shard ends a stream with its status after the
    // replies it sent, and a cancel before they are read would replace
    // that status (UNAVAILABLE, which is retried; ABORTED or OUT_OF_RANGE,
    // which the caller acts on) with CANCELLED.
    mu.AwaitWithDeadline(
        absl::Condition(
            +[](Lane* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu) {
              return (l->answered.size() == l->asked && l->taking == 0) ||
                     l->reads_over || !l->status.ok();
            },
            this),
        deadline);
    complete = answered.size() == asked && taking == 0 && status.ok();
    // At once: a stray reply after this finds no step to write into.
    if (complete) in_step = false;
    if (!complete && status.ok() && !reads_over) {
      status = absl::DeadlineExceededError(
          absl::StrCat("no reply for ", asked - answered.size(), " of ", asked,
                       " chunks within ", absl::FormatDuration(timeout)));
    }
  }
  if (call != nullptr && !complete) {
    // The step failed on this stream (or is given up): a new one next time.
    call->Close(/*cancel=*/true);
    absl::MutexLock lock(&mu);
    result = status;
    if (result.ok()) result = FromGrpcStatus(final_status);
    if (result.ok() && !cancel) {
      result =
          absl::InternalError(absl::StrCat("stream ended without replies for ",
                                           asked - answered.size(), " chunks"));
    }
  }
  if (call != nullptr && !complete) call.reset();
  {
    absl::MutexLock lock(&mu);
    in_step = false;
    // Only a failed step's are needed (to retry the rest).
    if (answered_out != nullptr && !complete) *answered_out = answered;
  }
  // The caller may reuse its gradient buffers once the step returns.
  if (!AwaitSlicesReleased(absl::Seconds(60)) && result.ok()) {
    result = absl::InternalError(
        "gRPC still references gradient buffers 60 s after they were sent");
  }
  return result;
}

absl::Status Lane::Pull(const v1::PullRequest& req, const SharedRegion* region,
                        absl::Duration timeout,
                        const std::function<absl::Status(Reply*)>& take) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (region != nullptr) {
    ctx.AddMetadata(shm::kStreamRegionKey,
                    shm::FormatRegion(region->path(), region->size()));
  }
  grpc::ByteBuffer request;
  bool own = false;
  grpc::SerializationTraits<v1::PullRequest>::Serialize(req, &request, &own)
      .IgnoreError();
  const grpc::internal::RpcMethod method(
      kPullMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel.get(), method, &ctx, request));
  grpc::ByteBuffer buffer;
  absl::Status reply_error;
  Reply pulled;  // `reply` may be a step's
  while (reader->Read(&buffer)) {
    reply_error = DecodeWithPayload(buffer, &pulled.response, &pulled.payload);
    if (reply_error.ok()) reply_error = take(&pulled);
    if (!reply_error.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  const absl::Status status = FromGrpcStatus(reader->Finish());
  return reply_error.ok() ? status : reply_error;
}

void LaneCall::Start(const RegionsToName& names) {
  {
    absl::MutexLock lock(&lane_->mu);
    lane_->writing = lane_->stopped = lane_->reads_over = false;
    lane_->call_done = false;
    lane_->final_status = grpc::Status::OK;
  }
  ctx_.AddMetadata(kRankMetadataKey, absl::StrCat(names.rank));
  // A region of this call's own: a call that ended may still have a reply
  // being written into its region by the shard. Without one (out of memory
  // or descriptors) the payloads go in the messages.
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      absl::UnavailableError("none asked");
  if (names.stream_region && lane_->shm_bytes > 0) {
    region = SharedRegion::Create(lane_->shm_bytes +
                                  (names.rings ? 2 * lane_->ring_bytes : 0));
  }
  if (region.ok()) {
    region_ = *std::move(region);
    ctx_.AddMetadata(shm::kStreamRegionKey,
                     shm::FormatRegion(region_->path(), region_->size()));
    // Gradients computed in the client's gradient region are read from
    // there, and weights kept in its weight region written there: this
    // call keeps the regions it names alive.
    gradients_ = names.gradients;
    weights_ = names.weights;
    if (gradients_ != nullptr) {
      ctx_.AddMetadata(
          shm::kGradientRegionKey,
          shm::FormatRegion(gradients_->path(), gradients_->size()));
    }
    if (weights_ != nullptr) {
      ctx_.AddMetadata(shm::kWeightRegionKey,
                       shm::FormatRegion(weights_->path(), weights_->size()));
    }
    if (names.rings) {
      // shm_bytes is a multiple of kAlignment: the rings start aligned.
      char* at = region_->data() + lane_->shm_bytes;
      requests_ = std::make_unique<MessageRing>(at, lane_->ring_bytes);
      replies_ = std::make_unique<MessageRing>(at + lane_->ring_bytes,
                                               lane_->ring_bytes);
      ctx_.AddMetadata(shm::kRingsKey,
                       shm::FormatRings({lane_->shm_bytes, lane_->ring_bytes}));
    }
  }
  const grpc::internal::RpcMethod method(
      kPushPullMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
  grpc::internal::ClientCallbackReaderWriterFactory<
      grpc::ByteBuffer, grpc::ByteBuffer>::Create(lane_->channel.get(), method,
                                                  &ctx_, this);
  AddHold();  // writes start from the stepping thread too
  StartRead(&read_buf_);
  StartCall();
}

void LaneCall::Pump() {
  if (ring()) {
    PumpRing();
    return;
  }
  uint32_t id;
  bool last;
  {
    absl::MutexLock lock(&lane_->mu);
    if (lane_->writing || lane_->stopped || lane_->ready.empty()) return;
    id = lane_->ready.front();
    lane_->ready.pop_front();
    lane_->writing = true;
    last = lane_->ready.empty() && lane_->unqueued == 0;
  }
  absl::StatusOr<grpc::ByteBuffer> message =
      owner_->MessageFor(lane_, id, last, &header_, regions());
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

void LaneCall::Close(bool cancel) {
  BeginClose(cancel);
  FinishClose(absl::Now() + absl::Seconds(5));
}

void LaneCall::BeginClose(bool cancel) {
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

void LaneCall::FinishClose(absl::Time deadline) {
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

void LaneCall::OnWriteDone(bool ok) {
  // Drops this buffer's reference to the gradient (ReleaseSlice takes the
  // lane's mutex).
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

void LaneCall::TakeRingReplies(absl::Time deadline) {
  for (;;) {
    const uint32_t seen = replies_->wakeups();
    bool over;
    {
      // Read first: the shard put every reply in the ring before it ended
      // the stream.
      absl::MutexLock lock(&lane_->mu);
      over = lane_->reads_over || lane_->stopped;
    }
    absl::Status s = TakeRing();
    bool complete;
    {
      absl::MutexLock lock(&lane_->mu);
      if (!s.ok()) Stop(s);
      complete = lane_->answered.size() == lane_->asked;
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

void LaneCall::OnReadDone(bool ok) {
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
  if (TakeRead()) {
    StartRead(&read_buf_);
  } else {
    ctx_.TryCancel();
  }
}

bool LaneCall::TakeRead() {
  absl::Status s = DecodeWithPayload(read_buf_, &lane_->reply.response,
                                     &lane_->reply.payload);
  bool took = false;
  {
    absl::MutexLock lock(&lane_->mu);
    // Outside a step nothing is asked: the step's buffers are not there. A
    // stopped stream's replies are still taken: a failed write does not
    // undo what the shard answered before it ended the stream, and the
    // step's buffers stay until Close has seen OnDone.
    if (s.ok() && !lane_->in_step) {
      s = absl::InternalError(absl::StrCat("bad reply: server sent chunk ",
                                           lane_->reply.response.chunk_id(),
                                           " which was not pushed"));
    }
    took = s.ok();
    if (took) ++lane_->taking;
  }
  if (took) s = owner_->TakeReply(lane_, &expected_view(), regions());
  lane_->reply.payload.Clear();
  read_buf_.Clear();
  absl::MutexLock lock(&lane_->mu);
  if (took) --lane_->taking;
  if (s.ok()) {
    lane_->answered.push_back(lane_->reply.response.chunk_id());
    lane_->replied[lane_->reply.response.chunk_id()] = true;
  }
  if (!s.ok()) Stop(s);
  return s.ok();
}

void LaneCall::OnDone(const grpc::Status& s) {
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

void LaneCall::PumpRing() {
  bool ends;  // the last of ring_ids_ is the step's last on the lane
  {
    absl::MutexLock lock(&lane_->mu);
    if (lane_->stopped) return;
    ring_ids_.assign(lane_->ready.begin(), lane_->ready.end());
    lane_->ready.clear();
    ends = lane_->unqueued == 0;
  }
  absl::Status s;
  for (size_t i = 0; i < ring_ids_.size(); ++i) {
    const uint32_t id = ring_ids_[i];
    const bool last = ends && i + 1 == ring_ids_.size();
    if (!owner_->HeaderFor(id, last, &header_, regions()) ||
        (!header_.push_only() && !header_.has_reply_shm_offset())) {
      s = shm::Unavailable(absl::StrCat(
          "chunk ", id, " does not fit the stream's region (declared again?)"));
      break;
    }
    header_.SerializeToString(&ring_bytes_);
    s = requests_->Append(ring_bytes_);
    if (!s.ok()) {
      s = shm::Unavailable(
          absl::StrCat("the stream's request ring: ", s.message()));
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

absl::Status LaneCall::TakeRing() {
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
          "bad reply: a malformed PushPullResponse in the stream's reply ring");
    }
    {
      absl::MutexLock lock(&lane_->mu);
      if (!lane_->in_step) {
        return absl::InternalError(absl::StrCat("bad reply: server sent chunk ",
                                                r.response.chunk_id(),
                                                " which was not pushed"));
      }
    }
    SHARDPS_RETURN_IF_ERROR(
        owner_->TakeReply(lane_, &expected_view(), regions()));
    absl::MutexLock lock(&lane_->mu);
    lane_->answered.push_back(r.response.chunk_id());
    lane_->replied[r.response.chunk_id()] = true;
  }
}

void LaneCall::Stop(const absl::Status& s) {
  if (lane_->status.ok()) lane_->status = s;
  lane_->stopped = true;
}

}  // namespace shardps
