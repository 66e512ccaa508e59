// Threads. gRPC runs the stream's reactions (OnReadDone, OnWriteDone,
// OnCancel, OnDone) on its callback threads; the store calls Deliver, Fail
// and Release from whichever thread completes a chunk's step; a stream
// with message rings also has a thread of its own, the ring thread
// (RingRequests::Run), which pops pushes from the requests' ring and takes
// them. One ring thread per such stream: started with it, holding a
// reference to it, and stopped before the stream finishes. Nothing else
// runs stream code.
//
// Buffers. Each source owns what it reads into and nobody else touches it:
// GrpcRequests' buffer_, request_ and payload_ belong to gRPC's read (from
// StartRead to OnReadDone) and then to that read reaction; RingRequests'
// message_ and request_ belong to the ring thread, and the buffer of its
// gRPC read (which only watches for the half-close) to the read reactions.
// So a gRPC message on a ring stream is refused without touching what the
// ring thread is working on. A gRPC reply belongs to GrpcReplies' queue
// under mu_, and to gRPC from StartWrite to OnWriteDone (a deque's
// references survive push_back); a ring reply is built and appended under
// mu_, the replies' ring having one producer.
//
// Locks. mu_ guards the stream's state (what it waits for before it
// finishes, the holds, where replies go) and its reply channel. It is never
// held across StartRead, StartWrite, Finish or the store's Push: Pump
// decides under it and acts outside it.
//
// The ring thread sleeps on the requests' ring's futex. Every reason for it
// to wake is announced there: the worker's Publish of a push, and Pump's
// Interrupt (RingRequests::Stop) once the stream is to finish or the client
// half-closed with nothing unanswered. The sleep is still bounded
// (kRingWaitBound) because the futex word lies in the worker's memory: a
// worker that rewrites it could swallow an Interrupt, and an unbounded
// sleep would then hold the stream, and the server's shutdown, forever.
#include "server/push_pull_reactor.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/encoding.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "common/step_hyperparameters.h"
#include "server/reply_encoding.h"

namespace shardps::server {

PushPullReactor* PushPullReactor::Start(const StreamEnv& env,
                                        StreamRegions regions,
                                        std::optional<uint32_t> rank) {
  auto reactor =
      std::make_shared<PushPullReactor>(env, std::move(regions), rank);
  reactor->self_ = reactor;
  reactor->source_->Start();
  return reactor.get();
}

PushPullReactor::PushPullReactor(const StreamEnv& env, StreamRegions regions,
                                 std::optional<uint32_t> rank)
    : env_(env),
      regions_(std::move(regions)),
      rank_(rank),
      source_stopped_(!regions_.rings.has_value()) {
  if (!regions_.rings.has_value()) {
    source_ = GrpcSource(this);
    channel_ = GrpcChannel();
    return;
  }
  const shm::RingPlace& place = *regions_.rings;
  char* const base = regions_.stream->data() + place.offset;
  source_ = RingSource(this, base, place.bytes);
  channel_ = RingChannel(base + place.bytes, place.bytes, env_.faults);
}

PushPullReactor::~PushPullReactor() {
  // Gradients still held when the stream went (a reset dropped them).
  int64_t held;
  {
    absl::MutexLock lock(&mu_);
    held = held_bytes_;
  }
  if (held > 0) env_.store->budget().Free(held);
}

bool PushPullReactor::AskBudget(int64_t bytes, std::function<void()> admitted) {
  std::optional<uint32_t> rank;
  std::optional<int64_t> next_step;
  {
    absl::MutexLock lock(&mu_);
    rank = rank_;
    next_step = next_step_;
  }
  return env_.store->budget().TryRead(rank, bytes, std::move(admitted),
                                      next_step);
}

void PushPullReactor::Hold(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  ++holds_;
  held_bytes_ += bytes;
  // The push came in a read that took its bytes already: the hold takes
  // those over, and the budget only what they do not cover.
  const int64_t covered = std::min(bytes, read_bytes_);
  read_bytes_ -= covered;
  env_.store->budget().Take(bytes - covered);
}

void PushPullReactor::FreeReadBytes() {
  int64_t bytes;
  {
    absl::MutexLock lock(&mu_);
    bytes = std::exchange(read_bytes_, 0);
  }
  if (bytes > 0) env_.store->budget().Free(bytes);
}

absl::Status PushPullReactor::TakeReplyEncoding(
    const v1::PushPullRequest& request) {
  v1::Encoding asked = request.reply_encoding();
  SHARDPS_RETURN_IF_ERROR(CheckReplyEncoding(asked, /*sparse=*/true));
  asked = EffectiveEncoding(asked);
  absl::MutexLock lock(&mu_);
  if (!reply_encoding_.has_value()) reply_encoding_ = asked;
  if (*reply_encoding_ == asked) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "push of chunk ", request.chunk_id(), " from rank ", request.rank(),
      " asks for weights as ", EncodingName(asked), " but this stream's first",
      " push asked for ", EncodingName(*reply_encoding_)));
}

absl::Status PushPullReactor::CheckSharedMemory(
    const v1::PushPullRequest& r) const {
  // Named only on an error: no string built per push.
  auto what = [&r] {
    return absl::StrCat("push of chunk ", r.chunk_id(), " from rank ",
                        r.rank());
  };
  const bool in_gradients = r.shm_in_gradient_region();
  if (in_gradients && r.shm_bytes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " names the gradient region but no bytes in it"));
  }
  const bool in_weights = r.reply_in_weight_region();
  if (in_weights && !r.has_reply_shm_offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(),
                     " asks its reply in the weight region but gives no "
                     "reply_shm_offset"));
  }
  if (in_weights &&
      EffectiveEncoding(r.reply_encoding()) != v1::ENCODING_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " asks its reply in the weight region as ",
                     EncodingName(r.reply_encoding()),
                     ": replies there are ENCODING_FP32 only"));
  }
  // `name` (named by the metadata `key`) is needed but the stream has none.
  auto no_region = [&what](absl::string_view name, absl::string_view key) {
    return absl::InvalidArgumentError(absl::StrCat(
        what(), " refers to shared memory, but its stream names no ", name,
        " (", key, " metadata)"));
  };
  if (r.shm_bytes() > 0 && in_gradients && regions_.gradients == nullptr) {
    return no_region("gradient region", shm::kGradientRegionKey);
  }
  if (r.shm_bytes() > 0 && !in_gradients && regions_.stream == nullptr) {
    return no_region("region", shm::kStreamRegionKey);
  }
  if (r.has_reply_shm_offset() && in_weights && regions_.weights == nullptr) {
    return no_region("weight region", shm::kWeightRegionKey);
  }
  if (r.has_reply_shm_offset() && !in_weights && regions_.stream == nullptr) {
    return no_region("region", shm::kStreamRegionKey);
  }
  return absl::OkStatus();
}

absl::Status PushPullReactor::TakeSharedMemory(const v1::PushPullRequest& r,
                                               const PayloadView& payload,
                                               absl::string_view* shared) {
  if (r.shm_bytes() == 0 && !r.has_reply_shm_offset() &&
      !r.shm_in_gradient_region() && !r.reply_in_weight_region()) {
    return absl::OkStatus();
  }
  SHARDPS_RETURN_IF_ERROR(CheckSharedMemory(r));
  const bool in_gradients = r.shm_in_gradient_region();
  const bool in_weights = r.reply_in_weight_region();
  if (r.shm_bytes() > 0) {
    // Where the payload lies: the worker's gradient region or the stream's.
    const SharedRegion& source =
        in_gradients ? *regions_.gradients : *regions_.stream;
    if (payload.size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("push of chunk ", r.chunk_id(), " from rank ", r.rank(),
                       " has both a payload and ", r.shm_bytes(),
                       " bytes in shared memory"));
    }
    if (!source.Contains(r.shm_offset(), r.shm_bytes())) {
      return absl::InvalidArgumentError(
          absl::StrCat("push of chunk ", r.chunk_id(), " from rank ", r.rank(),
                       ": shared-memory bytes [", r.shm_offset(), ", +",
                       r.shm_bytes(), ") lie outside the ",
                       in_gradients ? "gradient region" : "stream's region",
                       " of ", source.size(), " bytes"));
    }
    *shared = absl::string_view(source.data() + r.shm_offset(), r.shm_bytes());
    if (in_gradients)
      env_.counters->gradient_pushes.fetch_add(1, std::memory_order_relaxed);
  }
  if (r.has_reply_shm_offset()) {
    // Where the reply goes: the worker's weight region or the stream's.
    const SharedRegion& target =
        in_weights ? *regions_.weights : *regions_.stream;
    if (r.reply_shm_offset() >= target.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push of chunk ", r.chunk_id(), " from rank ", r.rank(),
          ": reply_shm_offset ", r.reply_shm_offset(), " lies outside the ",
          in_weights ? "weight region" : "stream's region", " of ",
          target.size(), " bytes"));
    }
    if (in_weights)
      env_.counters->weight_replies.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    reply_at_[r.chunk_id()] = {r.reply_shm_offset(), in_weights};
  }
  return absl::OkStatus();
}

bool PushPullReactor::Take(const v1::PushPullRequest& request,
                           const PayloadView& payload, absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      rank_ = request.rank();  // what the pushes say wins
      next_step_ = request.step() + (request.last_of_step() ? 1 : 0);
    }
  }
  if (status.ok()) status = TakeReplyEncoding(request);
  absl::string_view shared;
  if (status.ok()) status = TakeSharedMemory(request, payload, &shared);
  if (status.ok() && !channel_->carries_payloads() && !request.push_only() &&
      !request.has_reply_shm_offset()) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "push of chunk ", request.chunk_id(), " from rank ", request.rank(),
        " came through the stream's message ring without reply_shm_offset: "
        "its reply could not carry the weights"));
  }
  // The store copies the bytes out of the region before it checks them.
  StringByteSource shared_payload(shared);
  if (status.ok()) {
    PushArgs args;
    args.rank = request.rank();
    args.incarnation = request.incarnation();
    args.rollback_id = request.rollback_id();
    args.step = request.step();
    args.chunk_id = request.chunk_id();
    args.encoding = request.encoding();
    args.push_only = request.push_only();
    args.hyperparameters = StepHyperparametersOf(request);
    args.no_gradient = request.no_gradient();
    args.initial_values = request.initial_values();
    args.second_phase = request.second_phase();
    if (request.has_loss_scale()) args.loss_scale = request.loss_scale();
    args.speculative_weights = request.speculative_weights();
    if (request.has_decision()) {
      args.decision = StepDecision{request.decision().clip_coefficient(),
                                   request.decision().skip()};
    }
    args.payload = request.shm_bytes() > 0
                       ? static_cast<const ByteSource*>(&shared_payload)
                       : &payload;
    status = env_.store->Push(args, shared_from_this());
  }
  if (status.ok()) return true;
  if (env_.metrics != nullptr) env_.metrics->Rejected(status);
  {
    absl::MutexLock lock(&mu_);
    --unanswered_;
  }
  RequestFinish(ToGrpcStatus(status));
  return false;
}

void PushPullReactor::Release() {
  int64_t freed = 0;
  bool resume = false;
  {
    absl::MutexLock lock(&mu_);
    if (--holds_ == 0) freed = std::exchange(held_bytes_, 0);
    resume = holds_ == 0 && read_paused_;
    if (resume) read_paused_ = false;
  }
  if (freed > 0) env_.store->budget().Free(freed);
  if (resume) source_->Resume();
}

void PushPullReactor::Deliver(ChunkReply reply) {
  const uint32_t id = reply.chunk_id;
  v1::Encoding encoding;
  std::optional<uint64_t> at;
  SharedRegion* region = regions_.stream.get();
  {
    absl::MutexLock lock(&mu_);
    if (finishing()) return;
    encoding = reply_encoding_.value_or(v1::ENCODING_FP32);
    auto it = reply_at_.find(id);
    if (it != reply_at_.end()) {
      at = it->second.first;
      if (it->second.second) region = regions_.weights.get();
    }
  }
  // Encoded outside the lock: a BF16 reply converts the whole chunk.
  v1::PushPullResponse header;
  grpc::Slice payload;
  EncodeReply(std::move(reply), encoding, env_.store, env_.metrics, region, at,
              &header, &payload);
  grpc::Status sent;
  {
    absl::MutexLock lock(&mu_);
    if (finishing()) return;
    bool answered = false;
    sent = channel_->Send(id, header, std::move(payload), &answered);
    if (answered) --unanswered_;
  }
  if (!sent.ok()) {
    RequestFinish(std::move(sent));
  } else {
    Pump();
  }
}

void PushPullReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    channel_->WriteDone();
    --unanswered_;
  }
  if (!ok) {
    RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "stream broke while writing a reply"));
    return;
  }
  Pump();
}

void PushPullReactor::RequestFinish(grpc::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (!finish_wanted_.has_value()) finish_wanted_ = std::move(status);
  }
  Pump();
}

void PushPullReactor::Pump() {
  const grpc::ByteBuffer* next = nullptr;
  std::optional<grpc::Status> finish;
  bool drop = false;
  bool stop_source = false;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || channel_->writing()) return;
    std::optional<grpc::Status> done;  // what the stream ends with, if now
    if (finish_wanted_.has_value()) {
      if (starting_read_ > 0) return;  // ReadNext pumps again
      done = *finish_wanted_;
    } else if (channel_->next() != nullptr) {
      drop = env_.faults->DropNext();
      if (!drop) {
        channel_->StartWriting();
        next = channel_->next();
      }
    } else if (reads_done_ && unanswered_ == 0) {
      done = grpc::Status::OK;
    }
    if (done.has_value() && !source_stopped_) {
      stop_source = true;  // the source pumps again as it stops
    } else if (done.has_value()) {
      finished_ = true;
      finish = std::move(done);
    }
  }
  if (stop_source) {
    source_->Stop();
  } else if (drop) {
    RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "injected fault: reply dropped"));
  } else if (next != nullptr) {
    StartWrite(next);
  } else if (finish.has_value()) {
    Finish(*finish);
  }
}

}  // namespace shardps::server
