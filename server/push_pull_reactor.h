// One PushPull stream of a shard: a gRPC callback reactor fed by one
// RequestSource (the stream's gRPC reads, or a co-located worker's message
// ring) and answering through one ReplyChannel (gRPC writes, or the ring
// back), talking to its shard only through a StreamEnv. Threads, buffers
// and locks: push_pull_reactor.cc.
#ifndef SHARDPS_SERVER_PUSH_PULL_REACTOR_H_
#define SHARDPS_SERVER_PUSH_PULL_REACTOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/wire.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/chunk.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "server/shm_stream.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// Counts of the shard's shared-memory use, for GetStatus. Thread-safe.
struct ShmCounters {
  // Pushes read from a worker's gradient region.
  std::atomic<uint64_t> gradient_pushes{0};
  // Replies asked in a worker's weight region.
  std::atomic<uint64_t> weight_replies{0};
};

// Fault injection for tests: when `every` > 0, every Nth reply of the
// shard's streams is dropped and its stream ends with UNAVAILABLE, as if
// the network lost it. Thread-safe.
class ReplyFaults {
 public:
  explicit ReplyFaults(int64_t every) : every_(every) {}
  // True when this reply is to be dropped.
  bool DropNext() {
    if (every_ <= 0) return false;
    return (replies_.fetch_add(1) + 1) % every_ == 0;
  }

 private:
  const int64_t every_;
  std::atomic<int64_t> replies_{0};
};

// What a stream uses of its shard, borrowed: all must outlive every stream
// (the service owns them and outlives its calls).
struct StreamEnv {
  ParameterStore* store = nullptr;
  ServerMetrics* metrics = nullptr;  // null: none
  ShmCounters* counters = nullptr;
  ReplyFaults* faults = nullptr;
};

// Where a stream's pushes come from. The reactor calls Start once; the
// source hands each push to the reactor (PushPullReactor::Take) until the
// stream finishes or the client half-closes, then marks itself stopped.
class RequestSource {
 public:
  virtual ~RequestSource() = default;
  virtual void Start() = 0;
  // gRPC's read completed (a gRPC reaction): `ok` with a message in the
  // buffer the source gave StartRead, else the client half-closed.
  virtual void OnGrpcRead(bool ok) = 0;
  // The store released the stream's held gradients: reading may go on.
  virtual void Resume() = 0;
  // The stream is to finish: stop soon (from any thread, outside the lock).
  virtual void Stop() = 0;
};

// Where a stream's replies go. Every method runs under the reactor's lock,
// so a channel keeps no lock of its own.
class ReplyChannel {
 public:
  virtual ~ReplyChannel() = default;
  // Whether a reply can carry its weights in the message (false: only
  // through shared memory, so every push must name reply_shm_offset).
  virtual bool carries_payloads() const = 0;
  // Sends, or queues, the reply of chunk `chunk_id`: its `header` and the
  // part of its weights that did not go into shared memory (`payload`,
  // empty: none). Sets *answered when it left at once (else at
  // WriteDone). Not OK: the status the stream ends with.
  virtual grpc::Status Send(uint32_t chunk_id,
                            const v1::PushPullResponse& header,
                            grpc::Slice payload, bool* answered) = 0;
  // gRPC's write queue: whether a write is in flight; the next reply to
  // write (null: none waiting); StartWriting marks it in flight and
  // WriteDone takes it off. A ring sends at once: never any.
  virtual bool writing() const = 0;
  virtual const grpc::ByteBuffer* next() const = 0;
  virtual void StartWriting() = 0;
  virtual void WriteDone() = 0;
};

// Accepted pushes are answered by the store through Deliver(); the stream
// finishes once the client has half-closed and every accepted push has
// been answered, or at the first rejected push. Shared ownership: gRPC's
// reference ends at OnDone; the store's waiters, and the ring thread, may
// hold theirs longer (Deliver after the finish is a no-op).
class PushPullReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
      public ReplySink,
      public std::enable_shared_from_this<PushPullReactor> {
 public:
  // Starts a stream over `regions` (those its call named); returns the
  // reactor gRPC drives.
  // `rank`: the pusher's, as its call's metadata said (none: learnt from
  // its first push), for the store's receive budget.
  static PushPullReactor* Start(const StreamEnv& env, StreamRegions regions,
                                std::optional<uint32_t> rank = std::nullopt);
  // Use Start.
  PushPullReactor(const StreamEnv& env, StreamRegions regions,
                  std::optional<uint32_t> rank);
  ~PushPullReactor() override;

  void OnReadDone(bool ok) override { source_->OnGrpcRead(ok); }
  void OnWriteDone(bool ok) override;
  void OnCancel() override {
    RequestFinish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override { self_.reset(); }  // may delete this

  // Sends a reply; called by the store from any thread.
  void Deliver(ChunkReply reply) override;
  // Ends the stream with `status` (the shard was reset).
  void Fail(const absl::Status& status) override {
    RequestFinish(ToGrpcStatus(status));
  }
  // The store keeps a gradient of this stream until other workers' arrive:
  // no more reads until it is released.
  void Hold(int64_t bytes) override;
  void Release() override;

 private:
  // The stream's ends (push_pull_ends.cc).
  class GrpcRequests;
  class RingRequests;
  class GrpcReplies;
  class RingReplies;
  static std::unique_ptr<RequestSource> GrpcSource(PushPullReactor* reactor);
  static std::unique_ptr<RequestSource> RingSource(PushPullReactor* reactor,
                                                   char* base, uint64_t bytes);
  static std::unique_ptr<ReplyChannel> GrpcChannel();
  static std::unique_ptr<ReplyChannel> RingChannel(char* base, uint64_t bytes,
                                                   ReplyFaults* faults);

  // Every StartRead, StartWrite and Finish is decided under mu_ and issued
  // outside it (gRPC may run reactions inline). Finish is issued only when
  // no write is in flight, no StartRead is being issued and the source has
  // stopped: once Finish completes gRPC may free the call, so nothing of
  // the stream may start or run after it.
  void Pump();
  void RequestFinish(grpc::Status status);
  // True once the stream is finishing or finished.
  bool finishing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finish_wanted_.has_value() || finished_;
  }
  // Takes the push `request` with `payload` (its message's; empty for a
  // ring's) that `decoded` says parsed, counted in unanswered_ by the
  // source: hands it to the store, or finishes the stream with the error.
  // False when the stream is to read no more.
  bool Take(const v1::PushPullRequest& request, const PayloadView& payload,
            absl::Status decoded);
  // Records the first push's reply encoding; InvalidArgument for one that
  // cannot be sent or differs from it.
  absl::Status TakeReplyEncoding(const v1::PushPullRequest& request);
  // The request's shared-memory fields: points `shared` at its payload in
  // a region (when shm_bytes > 0) and records where its reply goes.
  // InvalidArgument for bytes outside the region, or without one.
  absl::Status TakeSharedMemory(const v1::PushPullRequest& request,
                                const PayloadView& payload,
                                absl::string_view* shared);
  // Asks the store's receive budget for a read of `bytes`: true when it may
  // start now; else `admitted` runs once it may (the bytes then taken).
  bool AskBudget(int64_t bytes, std::function<void()> admitted);
  // Gives back what the read in flight still holds of the budget.
  void FreeReadBytes();
  // InvalidArgument unless the request's shared-memory fields agree with
  // each other and with the regions the stream has.
  absl::Status CheckSharedMemory(const v1::PushPullRequest& r) const;

  const StreamEnv env_;
  // The regions the call named. The pointers are fixed: the shard reads
  // gradients from them as it takes pushes and writes replies into them
  // in Deliver; the rings lie in `regions_.stream`.
  const StreamRegions regions_;
  std::unique_ptr<RequestSource> source_;  // set in the constructor
  std::unique_ptr<ReplyChannel> channel_;  // set in the constructor
  std::shared_ptr<PushPullReactor> self_;  // gRPC's reference, until OnDone

  absl::Mutex mu_;
  // The reply encoding the stream's first push asked for.
  std::optional<v1::Encoding> reply_encoding_ ABSL_GUARDED_BY(mu_);
  // By chunk id: where the reply to its push goes, in regions_.stream or
  // (second) in regions_.weights.
  absl::flat_hash_map<uint32_t, std::pair<uint64_t, bool>> reply_at_
      ABSL_GUARDED_BY(mu_);
  // StartReads being issued (gRPC source): Finish waits for them.
  int starting_read_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;  // the client half-closed
  std::optional<grpc::Status> finish_wanted_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int64_t unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  // Gradients the store holds (Hold, not yet Release); while any is held
  // the source reads nothing more (gRPC: read_paused_), so a stream keeps
  // at most one early gradient in the store.
  int holds_ ABSL_GUARDED_BY(mu_) = 0;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  // The bytes of the held gradients, taken from the store's receive budget
  // and given back when the last hold is released (or the stream ends).
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // What the read in flight took from the budget (gRPC source: one read at
  // a time), until the push is taken; an early gradient takes it over.
  int64_t read_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The pusher's rank (none until known), for the receive budget.
  std::optional<uint32_t> rank_ ABSL_GUARDED_BY(mu_);
  // The least step the stream's next push may be of (none until its first
  // push): the last push's, or the one after it when that push said
  // last_of_step. For the receive budget.
  std::optional<int64_t> next_step_ ABSL_GUARDED_BY(mu_);
  // The source yields no more pushes and runs no more (true for gRPC reads,
  // whose reactions gRPC itself orders before the finish).
  bool source_stopped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PUSH_PULL_REACTOR_H_
