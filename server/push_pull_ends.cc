// The two ends of a PushPull stream: where its pushes come from (its gRPC
// reads, or the requests' message ring of a co-located worker) and where
// its replies go (gRPC writes, or the replies' ring). They act on their
// reactor under its rules: threads, buffers and locks are described at
// the top of push_pull_reactor.cc.
#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/encoding.h"
#include "common/message_ring.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "server/push_pull_reactor.h"
#include "server/reply_encoding.h"

namespace shardps::server {
namespace {

// How long the ring thread sleeps at most before it looks again whether
// the stream is to finish (see "The ring thread sleeps" in
// push_pull_reactor.cc).
constexpr absl::Duration kRingWaitBound = absl::Milliseconds(200);

}  // namespace

// Pushes in the stream's gRPC messages, one read at a time.
class PushPullReactor::GrpcRequests final : public RequestSource {
 public:
  explicit GrpcRequests(PushPullReactor* reactor) : reactor_(reactor) {}
  void Start() override { ReadNext(); }
  void OnGrpcRead(bool ok) override;
  void Resume() override { ReadNext(); }
  void Stop() override {}  // Pump waits for a StartRead being issued

 private:
  // Asks the receive budget, then reads (at once, or when it admits).
  void ReadNext();
  // Reads, the budget's bytes taken (given back if the stream finishes).
  void Read(int64_t bytes);

  PushPullReactor* const reactor_;  // owns this
  grpc::ByteBuffer buffer_;
  v1::PushPullRequest request_;
  PayloadView payload_;
};

void PushPullReactor::GrpcRequests::OnGrpcRead(bool ok) {
  PushPullReactor& r = *reactor_;
  {
    absl::MutexLock lock(&r.mu_);
    if (!ok) r.reads_done_ = true;
    // A stream being finished takes no more pushes.
    if (r.finishing()) ok = false;
    // Counted first: the store may answer before Push returns.
    if (ok) ++r.unanswered_;
  }
  if (!ok) {
    buffer_.Clear();
    r.FreeReadBytes();
    r.Pump();
    return;
  }
  const absl::Status decoded = DecodeWithPayload(buffer_, &request_, &payload_);
  const bool taken = r.Take(request_, payload_, decoded);
  // The store has copied what it keeps: let go of the received slices.
  payload_.Clear();
  buffer_.Clear();
  r.FreeReadBytes();  // what an early gradient did not take over
  if (!taken) return;
  {
    absl::MutexLock lock(&r.mu_);
    if (r.holds_ > 0) {
      r.read_paused_ = true;  // Release reads on
      return;
    }
  }
  ReadNext();
}

void PushPullReactor::GrpcRequests::ReadNext() {
  PushPullReactor& r = *reactor_;
  {
    absl::MutexLock lock(&r.mu_);
    if (r.finishing()) return;
  }
  const int64_t bytes = r.env_.store->ReadBytes();
  if (r.AskBudget(bytes, [stream = r.shared_from_this(), this, bytes] {
        Read(bytes);
      })) {
    Read(bytes);
  }
}

void PushPullReactor::GrpcRequests::Read(int64_t bytes) {
  PushPullReactor& r = *reactor_;
  bool finishing;
  {
    absl::MutexLock lock(&r.mu_);
    finishing = r.finishing();
    if (!finishing) {
      r.read_bytes_ = bytes;
      ++r.starting_read_;
    }
  }
  if (finishing) {
    r.env_.store->budget().Free(bytes);
    return;
  }
  r.StartRead(&buffer_);
  {
    absl::MutexLock lock(&r.mu_);
    --r.starting_read_;
  }
  r.Pump();  // a finish may have been requested meanwhile
}

// Pushes in the requests' message ring, popped by the ring thread; the
// stream's gRPC read only watches for the client's half-close, and a
// message there finishes the stream with INVALID_ARGUMENT.
class PushPullReactor::RingRequests final : public RequestSource {
 public:
  RingRequests(PushPullReactor* reactor, char* base, uint64_t bytes)
      : reactor_(reactor), ring_(base, bytes) {}
  void Start() override;
  void OnGrpcRead(bool ok) override;
  void Resume() override {}  // the ring thread awaits holds_ == 0 itself
  void Stop() override { ring_.Interrupt(); }

 private:
  // The ring thread: takes pushes from the ring until the stream is to
  // finish, or the client half-closed and left none; then stops.
  void Run();
  // Waits until the store holds none of the stream's gradients, or the
  // stream is to finish.
  void AwaitNoHolds();
  // Waits until the receive budget lets the stream take another push (its
  // payload is in shared memory: only an early gradient costs), or the
  // stream is to finish.
  void AwaitBudget();

  PushPullReactor* const reactor_;  // owns this
  // Only the ring thread uses these.
  MessageRing ring_;
  std::string message_;
  v1::PushPullRequest request_;
  PayloadView no_payload_;  // a ring push's payload is in shared memory
  // Only read reactions use this.
  grpc::ByteBuffer grpc_buffer_;
  // Set by the budget's wake (under the reactor's lock).
  bool admitted_ ABSL_GUARDED_BY(reactor_->mu_) = false;
};

void PushPullReactor::RingRequests::Start() {
  reactor_->StartRead(&grpc_buffer_);
  // The thread's reference keeps the stream alive until the thread ends.
  std::thread([stream = reactor_->shared_from_this(), this] {
    Run();
  }).detach();
}

void PushPullReactor::RingRequests::OnGrpcRead(bool ok) {
  PushPullReactor& r = *reactor_;
  bool misplaced;
  {
    absl::MutexLock lock(&r.mu_);
    if (!ok) r.reads_done_ = true;
    misplaced = ok && !r.finishing();
  }
  grpc_buffer_.Clear();
  if (!misplaced) {
    r.Pump();  // the half-close may be what the stream waited for
    return;
  }
  r.RequestFinish(grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      "a push came through gRPC on a stream whose pushes go through its "
      "message rings"));
}

void PushPullReactor::RingRequests::Run() {
  PushPullReactor& r = *reactor_;
  for (;;) {
    // Read before the state it guards: an Interrupt after this returns at
    // once from WaitSince.
    const uint32_t seen = ring_.wakeups();
    bool half_closed;
    {
      absl::MutexLock lock(&r.mu_);
      if (r.finishing()) break;
      half_closed = r.reads_done_;
    }
    absl::StatusOr<bool> popped = ring_.Pop(&message_);
    if (!popped.ok()) {
      r.RequestFinish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   absl::StrCat("the stream's request ring: ",
                                                popped.status().message())));
      break;
    }
    if (!*popped) {
      if (half_closed) break;  // and nothing left behind
      ring_.WaitSince(seen, kRingWaitBound);
      continue;
    }
    {
      absl::MutexLock lock(&r.mu_);
      if (r.finishing()) break;
      ++r.unanswered_;
    }
    const absl::Status decoded =
        request_.ParseFromString(message_)
            ? absl::OkStatus()
            : absl::InvalidArgumentError(
                  "malformed PushPullRequest in the stream's request ring");
    if (!r.Take(request_, no_payload_, decoded)) break;
    AwaitNoHolds();
    AwaitBudget();
  }
  {
    absl::MutexLock lock(&r.mu_);
    r.source_stopped_ = true;
  }
  r.Pump();
}

void PushPullReactor::RingRequests::AwaitNoHolds() {
  // As a paused gRPC read: at most one early gradient of this stream waits
  // in the store.
  PushPullReactor& r = *reactor_;
  absl::MutexLock lock(&r.mu_);
  r.mu_.Await(absl::Condition(
      +[](PushPullReactor* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
        return s->holds_ == 0 || s->finishing();
      },
      &r));
}

void PushPullReactor::RingRequests::AwaitBudget() {
  PushPullReactor& r = *reactor_;
  if (r.AskBudget(0, [stream = r.shared_from_this(), this] {
        absl::MutexLock lock(&reactor_->mu_);
        admitted_ = true;
      })) {
    return;
  }
  absl::MutexLock lock(&reactor_->mu_);
  reactor_->mu_.Await(absl::Condition(
      +[](RingRequests* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->reactor_->mu_) {
        return s->admitted_ || s->reactor_->finishing();
      },
      this));
  admitted_ = false;
}

// Replies as the stream's gRPC messages, written one at a time in
// completion order.
class PushPullReactor::GrpcReplies final : public ReplyChannel {
 public:
  bool carries_payloads() const override { return true; }
  grpc::Status Send(uint32_t, const v1::PushPullResponse& header,
                    grpc::Slice payload, bool* answered) override {
    queue_.push_back(EncodeWithPayload(header, std::move(payload)));
    *answered = false;
    return grpc::Status::OK;
  }
  bool writing() const override { return writing_; }
  const grpc::ByteBuffer* next() const override {
    return queue_.empty() ? nullptr : &queue_.front();
  }
  void StartWriting() override { writing_ = true; }
  void WriteDone() override {
    writing_ = false;
    queue_.pop_front();
  }

 private:
  std::deque<grpc::ByteBuffer> queue_;
  bool writing_ = false;
};

// Reply headers appended to the replies' message ring; their weights are
// already in shared memory.
class PushPullReactor::RingReplies final : public ReplyChannel {
 public:
  RingReplies(char* base, uint64_t bytes, ReplyFaults* faults)
      : ring_(base, bytes), faults_(faults) {}
  bool carries_payloads() const override { return false; }
  grpc::Status Send(uint32_t chunk_id, const v1::PushPullResponse& header,
                    grpc::Slice payload, bool* answered) override;
  bool writing() const override { return false; }
  const grpc::ByteBuffer* next() const override { return nullptr; }
  void StartWriting() override {}
  void WriteDone() override {}

 private:
  MessageRing ring_;
  ReplyFaults* const faults_;
  std::string bytes_;  // the header being appended
};

grpc::Status PushPullReactor::RingReplies::Send(
    uint32_t chunk_id, const v1::PushPullResponse& header, grpc::Slice payload,
    bool* answered) {
  *answered = false;
  if (payload.size() > 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("the weights of chunk ", chunk_id,
                                     " do not fit where its push asked for "
                                     "them in the stream's region"));
  }
  if (faults_->DropNext()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "injected fault: reply dropped");
  }
  header.SerializeToString(&bytes_);
  const absl::Status appended = ring_.Append(bytes_);
  if (!appended.ok()) {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat(shm::kErrorPrefix,
                     "the stream's reply ring: ", appended.message()));
  }
  ring_.Publish();
  *answered = true;
  return grpc::Status::OK;
}

std::unique_ptr<RequestSource> PushPullReactor::GrpcSource(
    PushPullReactor* reactor) {
  return std::make_unique<GrpcRequests>(reactor);
}

std::unique_ptr<RequestSource> PushPullReactor::RingSource(
    PushPullReactor* reactor, char* base, uint64_t bytes) {
  return std::make_unique<RingRequests>(reactor, base, bytes);
}

std::unique_ptr<ReplyChannel> PushPullReactor::GrpcChannel() {
  return std::make_unique<GrpcReplies>();
}

std::unique_ptr<ReplyChannel> PushPullReactor::RingChannel(
    char* base, uint64_t bytes, ReplyFaults* faults) {
  return std::make_unique<RingReplies>(base, bytes, faults);
}

}  // namespace shardps::server
