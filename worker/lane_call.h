// A Lane is one (shard, stream) path of a Client and the state of the step
// on it; its LaneCall is the lane's PushPull stream, a gRPC callback reactor
// kept open from step to step. The call asks its owner (LaneOwner, the
// Client) for each chunk's message and hands it each reply; it never sees
// the client's step or regions otherwise. Threads: see lane_call.cc.
#ifndef SHARDPS_WORKER_LANE_CALL_H_
#define SHARDPS_WORKER_LANE_CALL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/message_ring.h"
#include "common/security.h"
#include "common/shared_memory.h"
#include "grpcpp/support/client_callback.h"
#include "shardps/v1/parameter_server.grpc.pb.h"
#include "worker/reply_reader.h"
#include "worker/shm_regions.h"

namespace shardps {

struct Lane;

// What a new call names (all empty: payloads in the messages). The call
// holds the gradient and weight regions while it lives.
struct RegionsToName {
  uint32_t rank = 0;           // the pusher's, named too (kRankMetadataKey)
  bool stream_region = false;  // a region of its own for payloads
  bool rings = false;          // and message rings in it
  std::shared_ptr<const SharedRegion> gradients;
  std::shared_ptr<const SharedRegion> weights;
};

// The lane's owner, as its call sees it. Called from the caller's thread
// and from gRPC reactions, never with the lane's mutex held; for one lane,
// never from two threads at once.
class LaneOwner {
 public:
  virtual ~LaneOwner() = default;
  // The message of chunk `id` of the open step (its header built in
  // *header), payloads through `regions` where they fit (Lane::Message
  // references the gradient). `last`: no other chunk of the step follows
  // it on the lane (PushPullRequest.last_of_step). InvalidArgument naming
  // the tensor for a gradient its encoding cannot carry.
  virtual absl::StatusOr<grpc::ByteBuffer> MessageFor(
      Lane* lane, uint32_t id, bool last, v1::PushPullRequest* header,
      const CallRegions& regions) = 0;
  // For a message ring: fills *header for chunk `id` (`last` as above)
  // with its gradient and its reply in `regions`; false when they do not
  // fit there.
  virtual bool HeaderFor(uint32_t id, bool last, v1::PushPullRequest* header,
                         const CallRegions& regions) = 0;
  // Takes lane->reply (of a chunk of the open step): writes its weights and
  // clears it in `expected` (by chunk id). InternalError for a reply to a
  // chunk not expected on this lane.
  virtual absl::Status TakeReply(Lane* lane, std::vector<bool>* expected,
                                 const CallRegions& regions) = 0;
};

class LaneCall;

// One (shard, stream) lane: its connection, its chunks, and the step on it.
// The fields above `mu` are set when the client is made or declares, and
// read without the lock.
struct Lane {
  Lane();
  ~Lane();
  // Lane `index`, the `k`th of shard `shard` at `address`, on a connection
  // of its own (connected lazily) with a TCP receive buffer of
  // `receive_buffer_bytes` (0: the kernel's).
  static std::unique_ptr<Lane> Connect(size_t index, uint32_t shard,
                                       const std::string& address,
                                       const SecurityOptions& security, int k,
                                       int receive_buffer_bytes);

  size_t index = 0;  // among the client's lanes
  uint32_t shard = 0;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ParameterServer::Stub> stub;
  std::vector<uint32_t> chunk_ids;  // the chunks this lane carries
  // Its stream region's payload bytes (its chunks' gradients, then their
  // weights), and each of its message rings' (right after them).
  uint64_t shm_bytes = 0;
  uint64_t ring_bytes = 0;
  Reply reply;  // the last reply of a step on this lane

  // The lane's PushPull stream, kept open from step to step; null before
  // the first step and after one that failed on it. Only the thread that
  // runs the step (the caller's; a retry's) creates and ends it.
  std::unique_ptr<LaneCall> call;

  // Opens a step (or a two-phase step's second phase) on this lane for
  // `ids`, some of its chunks: a call whose stream is dead or names other
  // buffers than `names` is replaced first.
  void BeginStep(LaneOwner* owner, const RegionsToName& names,
                 absl::Span<const uint32_t> ids, size_t num_chunks,
                 absl::Time start) ABSL_LOCKS_EXCLUDED(mu);
  // One retry of `ids` (some of its chunks, of `num_chunks` in all) on a
  // call of its own that names no region (payloads in the messages), up to
  // `timeout`, then closed: the next step opens a call naming the regions.
  // Returns the attempt's error (as EndStep) and the chunks it answered.
  // REQUIRES: call == nullptr (the failed step's call has ended).
  absl::Status Retry(LaneOwner* owner, absl::Span<const uint32_t> ids,
                     size_t num_chunks, absl::Duration timeout,
                     std::vector<uint32_t>* answered) ABSL_LOCKS_EXCLUDED(mu);
  // Chunk `id` is pushed: the call writes it next (Pump).
  void Queue(uint32_t id) ABSL_LOCKS_EXCLUDED(mu);
  // Ends the open step: waits (unless `cancel`) up to `deadline` for its
  // replies, and ends the stream if the step did not complete on it.
  // Returns the lane's error (OK when every reply came; DEADLINE_EXCEEDED
  // naming `timeout` when none came in time) and, when it failed, the
  // chunks answered. Then waits for gRPC to drop the gradients it sent.
  absl::Status EndStep(bool cancel, absl::Time deadline, absl::Duration timeout,
                       std::vector<uint32_t>* answered) ABSL_LOCKS_EXCLUDED(mu);
  // A Pull on this lane's connection, up to `timeout`: sends `req` (its
  // stream region `region`, null: none) and hands each reply to `take`
  // until the stream ends or `take` fails (the call is then cancelled).
  // Returns take's error, else the call's status. Uses no step state: any
  // thread, while no step is open.
  absl::Status Pull(const v1::PullRequest& req, const SharedRegion* region,
                    absl::Duration timeout,
                    const std::function<absl::Status(Reply*)>& take);
  // When the step's last write went out.
  absl::Time writes_done_at() ABSL_LOCKS_EXCLUDED(mu);
  // Waits up to `deadline` until the open step's reply to chunk `id` (one
  // of this lane's) was taken into the caller's buffers. False when it
  // was not: the deadline, the lane's error or the end of its stream, a
  // call that takes replies from a ring (the stepping thread takes those,
  // in EndStep), or no call. The stepping thread's.
  bool AwaitReplied(uint32_t id, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu);

  // The message of one chunk: `header`, then `bytes` of gradient at `data`
  // (null: none), referenced rather than copied and counted until gRPC
  // drops it.
  grpc::ByteBuffer Message(const v1::PushPullRequest& header, const void* data,
                           int64_t bytes) ABSL_LOCKS_EXCLUDED(mu);
  // True once gRPC released every gradient slice (false after `timeout`).
  bool AwaitSlicesReleased(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu);

  absl::Mutex mu;
  // Gradient slices gRPC still references; a step returns only once it is
  // zero, so the caller's gradient buffers may then be reused.
  int64_t slices_in_flight ABSL_GUARDED_BY(mu) = 0;
  // The open step. The stepping thread queues its chunks in `ready` as
  // they are pushed; the call's reactions write them and take the replies.
  bool in_step ABSL_GUARDED_BY(mu) = false;
  std::deque<uint32_t> ready ABSL_GUARDED_BY(mu);  // pushed, not yet written
  int64_t unqueued ABSL_GUARDED_BY(mu) = 0;        // chunks not pushed yet
  size_t asked ABSL_GUARDED_BY(mu) = 0;            // replies the step needs
  // By chunk id: a reply is still expected (the step's chunks at Open).
  std::vector<bool> expected ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> answered ABSL_GUARDED_BY(mu);
  std::vector<bool> replied ABSL_GUARDED_BY(mu);  // by chunk id: answered
  int taking ABSL_GUARDED_BY(mu) = 0;             // replies being written out
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

 private:
  // Sets the step's state for `ids` in the same section that finds the
  // call alive (false if it is not).
  bool Arm(absl::Span<const uint32_t> ids, size_t num_chunks, absl::Time start)
      ABSL_LOCKS_EXCLUDED(mu);
  static void ReleaseSlice(void* lane);
};

// A lane's PushPull stream as a callback reactor. Every Start* is issued
// with the lane's mutex released (gRPC may run a reaction inline).
class LaneCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `owner` and `lane` must outlive the call (Close ends it).
  LaneCall(LaneOwner* owner, Lane* lane) : owner_(owner), lane_(lane) {}

  // Starts the stream naming `names` (a region of its own only when the
  // lane has payload bytes and it can be made).
  void Start(const RegionsToName& names) ABSL_LOCKS_EXCLUDED(lane_->mu);
  bool ring() const { return requests_ != nullptr; }
  // The stream names other gradient or weight regions than these.
  bool NamesOtherBuffers(const SharedRegion* gradients,
                         const SharedRegion* weights) const {
    return region_ != nullptr &&
           (gradients_.get() != gradients || weights_.get() != weights);
  }
  // Writes the next queued chunk unless a write is in flight; with rings,
  // every queued chunk (the stepping thread only).
  void Pump() ABSL_LOCKS_EXCLUDED(lane_->mu);
  // With rings: takes the replies that came (the stepping thread only) and,
  // unless `deadline` has passed, waits for the rest until the step's
  // every reply is in, an error stops the lane, or the stream ended.
  void TakeRingReplies(absl::Time deadline) ABSL_LOCKS_EXCLUDED(lane_->mu);
  // Ends the call and waits for gRPC to be done with it: a clean end
  // (half-close, the server finishes) when `cancel` is false and nothing
  // is in flight, else a cancel. Once, from the thread that started it.
  void Close(bool cancel) ABSL_LOCKS_EXCLUDED(lane_->mu);
  // Close in two halves, so that many calls can end in parallel: the
  // half-close (or cancel), then the wait, up to `deadline` for a clean
  // end before it cancels.
  void BeginClose(bool cancel) ABSL_LOCKS_EXCLUDED(lane_->mu);
  void FinishClose(absl::Time deadline) ABSL_LOCKS_EXCLUDED(lane_->mu);

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(lane_->mu);
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(lane_->mu);
  void OnDone(const grpc::Status& s) override ABSL_LOCKS_EXCLUDED(lane_->mu);

 private:
  CallRegions regions() const {
    return {region_.get(), gradients_.get(), weights_.get()};
  }
  // Appends every queued chunk's header to the requests' ring and wakes
  // the shard once.
  void PumpRing() ABSL_LOCKS_EXCLUDED(lane_->mu);
  // Takes every reply in the replies' ring.
  absl::Status TakeRing() ABSL_LOCKS_EXCLUDED(lane_->mu);
  // Takes the reply just read through gRPC; false when the stream must end.
  bool TakeRead() ABSL_LOCKS_EXCLUDED(lane_->mu);
  void Stop(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane_->mu);
  // The lane's expected replies, read by TakeReply on this reaction only
  // (entries of this lane's chunks).
  std::vector<bool>& expected_view() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return lane_->expected;
  }

  LaneOwner* const owner_;
  Lane* const lane_;
  grpc::ClientContext ctx_;
  bool clean_ = false;  // BeginClose half-closed (closing thread only)
  std::unique_ptr<SharedRegion> region_;  // null: payloads in the messages
  // The client's gradient and weight regions this call named (null: none).
  std::shared_ptr<const SharedRegion> gradients_;
  std::shared_ptr<const SharedRegion> weights_;
  // The message rings in region_ (null: none), used by the stepping thread
  // only, and its scratch.
  std::unique_ptr<MessageRing> requests_;
  std::unique_ptr<MessageRing> replies_;
  std::vector<uint32_t> ring_ids_;
  std::string ring_bytes_;
  grpc::ByteBuffer read_buf_;   // the read flow's
  grpc::ByteBuffer write_buf_;  // the write flow's, until OnWriteDone
  v1::PushPullRequest header_;  // the write flow's
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_LANE_CALL_H_
