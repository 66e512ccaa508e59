// A ParameterStore owns the chunks assigned to one shard: weights, optimizer
// slots, version and the contributions pending for the current step, and
// applies the optimizer when a step's contributions are complete (sync) or on
// arrival (async). Thread-safe: every RPC handler of the shard shares it.
#ifndef SHARDPS_SERVER_PARAMETER_STORE_H_
#define SHARDPS_SERVER_PARAMETER_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/chunking.h"
#include "common/encoding.h"
#include "common/thread_pool.h"
#include "server/checkpoint.h"
#include "server/optimizer.h"
#include "shardps/v1/coordinator.pb.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// sync: a step's update waits for every worker. async: each push is applied
// on arrival. ssp (stale synchronous parallel): applied on arrival, but the
// reply to a worker's push of step t waits until every worker has pushed
// step t - staleness, so no worker runs more than `staleness` steps ahead.
enum class Mode { kSync, kAsync, kSsp };

// The protocol's name for `mode` (DeclareResponse.consistency).
v1::Consistency ConsistencyOf(Mode mode);

class ServerMetrics;

struct StoreOptions {
  uint32_t shard_index = 0;
  uint32_t num_shards = 1;
  uint32_t num_workers = 1;
  Mode mode = Mode::kSync;
  int64_t staleness = 0;  // ssp only
  // Accept gradients holding NaN or infinity (rejected by default).
  bool allow_nonfinite = false;
  // Threads that run optimizer updates, in parallel across chunks.
  int update_threads = 2;
  // Checkpoints: when > 0, each chunk's state is copied when its version
  // reaches a multiple of this, and once every owned chunk has its copy of
  // version V, on_checkpoint(V, states) runs on an update thread (it may
  // block to write them; other updates go on).
  int64_t checkpoint_every = 0;
  std::function<void(int64_t step, std::vector<ChunkState> chunks)>
      on_checkpoint;
  // Step, aggregation and staleness histograms; null: none. Must outlive
  // the store.
  ServerMetrics* metrics = nullptr;
};

// The weights of one chunk at one version. Shared with the transport, which
// sends straight from this buffer; the store never writes to a buffer while
// anyone else holds it (copy on write).
using WeightsBuffer = std::shared_ptr<const std::vector<float>>;

// The updated weights of one chunk, for one accepted push.
struct ChunkReply {
  uint32_t chunk_id = 0;
  int64_t version = 0;
  WeightsBuffer weights;  // null for push-only
};

// Receives the reply of each accepted push exactly once, from any thread,
// possibly before Push() returns. Implementations must not block.
class ReplySink {
 public:
  virtual ~ReplySink() = default;
  virtual void Deliver(ChunkReply reply) = 0;
  // The push will never be answered (the shard was reset to a checkpoint):
  // the sink ends its call with `status`. Same threading rules as Deliver.
  virtual void Fail(const absl::Status& status) = 0;
};

// One gradient chunk of one worker, as it came off the wire.
struct PushArgs {
  uint32_t rank = 0;
  uint64_t incarnation = 0;
  // The last rollback the pusher knows of; older than the shard's: ABORTED.
  uint64_t rollback_id = 0;
  int64_t step = 0;
  uint32_t chunk_id = 0;
  v1::Encoding encoding = v1::ENCODING_FP32;
  bool push_only = false;
  // The gradient bytes, copied once into the store when accepted.
  const ByteSource* payload = nullptr;
};

class ParameterStore {
 public:
  explicit ParameterStore(StoreOptions options);
  ~ParameterStore();

  const StoreOptions& options() const { return options_; }

  // Creates the chunks this shard owns, with their initial values and
  // optimizer slots. Idempotent: an identical declaration returns the
  // existing state (created = false). InvalidArgument for a bad layout or
  // optimizer, FailedPrecondition for a view of the cluster that differs from
  // this shard's or a declaration that differs from the existing one.
  absl::StatusOr<v1::DeclareResponse> Declare(const v1::DeclareRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Validates and records one contribution. On success `sink` receives the
  // chunk's updated weights once the update that includes it is applied (sync:
  // when every worker has pushed; async: at once). A push of the step before
  // the chunk's current version is a retry: it is not applied again and gets
  // the current weights. On error nothing changed; the codes are those of the
  // ParameterServer service (see the proto).
  absl::Status Push(const PushArgs& args, std::shared_ptr<ReplySink> sink)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Creates the shard's state from a checkpoint instead of initial values:
  // `chunks` must hold exactly the chunks this shard owns under
  // `declaration`. FailedPrecondition if the shard is already declared or
  // the chunks do not match; InvalidArgument for a bad declaration.
  absl::Status Restore(const v1::DeclareRequest& declaration,
                       std::vector<ChunkState> chunks) ABSL_LOCKS_EXCLUDED(mu_);

  // A job-wide rollback: resets every owned chunk (weights, optimizer
  // slots, version) to `chunks`, the checkpoint this shard's chunks were
  // saved in, drops the contributions of the step in flight and fails every
  // push waiting for a reply with `why`. `rollback_id` is reported by
  // Status(). FailedPrecondition before Declare or for chunks that do not
  // match the declaration (nothing changed then).
  absl::Status ResetTo(std::vector<ChunkState> chunks, const absl::Status& why,
                       uint64_t rollback_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Records a rollback that needed no reset (see ResetTo).
  void NoteRollback(uint64_t rollback_id) { rollback_id_.store(rollback_id); }

  // Copies out the weights of `chunk_id` with their version. NotFound if the
  // chunk is not declared on this shard; FailedPrecondition before Declare.
  absl::StatusOr<ChunkReply> Read(uint32_t chunk_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK when this shard owns `chunk_id`; else NotFound or FailedPrecondition.
  absl::Status CheckOwned(uint32_t chunk_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // The declaration this shard holds; FailedPrecondition before Declare.
  absl::StatusOr<v1::DeclareRequest> declaration() const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Chunk ids this shard owns, ascending; empty before Declare.
  std::vector<uint32_t> OwnedChunks() const ABSL_LOCKS_EXCLUDED(mu_);

  // The shard's report for GetStatus: shape, counters, versions, and the
  // ranks its current step waits for.
  v1::GetStatusResponse Report() const ABSL_LOCKS_EXCLUDED(mu_);

  // A checkpoint at `step` besides the periodic ones: each owned chunk's
  // state is copied when its version reaches `step`, and on_checkpoint(step,
  // ...) runs once every chunk has its copy. Training is unaffected.
  // InvalidArgument for a negative step; FailedPrecondition without
  // on_checkpoint or before Declare; OutOfRange when a chunk has already
  // reached `step` (then nothing is requested).
  absl::Status RequestCheckpoint(int64_t step)
      ABSL_LOCKS_EXCLUDED(mu_, request_mu_);

  // Follows the coordinator's membership (a newer `view` than the last one
  // applied; older ones are ignored). A worker rank that is no longer alive
  // stops being waited for: sync steps that waited only for it complete
  // with the contributions that arrived. A rank held by a new process
  // (another incarnation) is not waited for until that process declares a
  // join step. Before the first view every rank is waited for (a static
  // job, or the first workers still arriving). Returns one line per change,
  // for the log.
  std::vector<std::string> ApplyView(const v1::ClusterView& view)
      ABSL_LOCKS_EXCLUDED(mu_, members_mu_);

  // A sync step some workers pushed and others have not, for longer than a
  // timeout: what it waits for.
  struct StalledChunk {
    uint32_t chunk_id = 0;
    int64_t step = 0;
    std::vector<uint32_t> missing_ranks;
    absl::Duration waiting;
  };
  // Sync chunks whose current step has waited longer than `timeout` since
  // its first contribution.
  std::vector<StalledChunk> Stalled(absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    uint32_t rank = 0;
    bool push_only = false;
    std::shared_ptr<ReplySink> sink;
    int64_t step = 0;  // ssp: the step whose reply waits
  };
  struct Chunk {
    ChunkSpec spec;
    mutable absl::Mutex mu;
    // Written in place when no reply holds it, else replaced by a copy.
    std::shared_ptr<std::vector<float>> weights ABSL_GUARDED_BY(mu);
    std::vector<std::vector<float>> slots ABSL_GUARDED_BY(mu);
    int64_t version ABSL_GUARDED_BY(mu) = 0;
    // Per-rank gradients: sync keeps them for step `version` until every
    // rank has pushed; async uses them as scratch. Allocated at Declare.
    std::vector<std::vector<float>> contributions ABSL_GUARDED_BY(mu);
    std::vector<bool> contributed ABSL_GUARDED_BY(mu);
    uint32_t num_contributed ABSL_GUARDED_BY(mu) = 0;
    absl::Time first_contribution ABSL_GUARDED_BY(mu);
    std::vector<Waiter> waiters ABSL_GUARDED_BY(mu);
    // Sync: the complete step's update is queued (ApplySync will run).
    bool apply_scheduled ABSL_GUARDED_BY(mu) = false;
    // Async and ssp: the last step applied for each rank (-1: none).
    std::vector<int64_t> last_step ABSL_GUARDED_BY(mu);
    // Ssp: replies held back until the slowest rank catches up.
    std::vector<Waiter> held ABSL_GUARDED_BY(mu);
    // Checkpoint copies not yet handed to on_checkpoint.
    std::vector<ChunkState> snapshots ABSL_GUARDED_BY(mu);
    // Versions above the current one to copy (RequestCheckpoint).
    std::vector<int64_t> requested_steps ABSL_GUARDED_BY(mu);
  };
  // Constant once Declare has published it.
  struct State {
    v1::DeclareRequest declaration;
    uint64_t fingerprint = 0;
    std::vector<ChunkSpec> all_chunks;
    std::vector<uint32_t> shard_of;
    std::unique_ptr<Optimizer> optimizer;
    std::vector<std::unique_ptr<Chunk>> owned;  // indexed by chunk id; null
                                                // when another shard owns it
    uint64_t owned_bytes = 0;
    size_t num_owned = 0;
  };

  absl::StatusOr<std::unique_ptr<State>> BuildState(
      const v1::DeclareRequest& req) const;
  // Checks that `chunks` hold exactly the chunks `state` owns, all at one
  // step, with the sizes and optimizer slots of the declaration.
  absl::Status CheckSavedChunks(const State& state,
                                const std::vector<ChunkState>& chunks) const;
  // The chunk for `chunk_id`, or NotFound / FailedPrecondition.
  absl::StatusOr<Chunk*> FindChunk(const State& state, uint32_t chunk_id) const;
  absl::Status CheckPush(const PushArgs& args, const Chunk& chunk) const;
  // Copies the payload into the rank's buffer and checks it is finite.
  absl::Status TakeGradient(const State& state, const PushArgs& args,
                            Chunk* chunk)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  absl::Status PushSync(const State& state, const PushArgs& args, Chunk* chunk,
                        std::shared_ptr<ReplySink> sink);
  absl::Status PushAsync(const State& state, const PushArgs& args, Chunk* chunk,
                         std::shared_ptr<ReplySink> sink);
  // Applies the optimizer with the given contributions (rank order) and
  // returns the replies for `waiters`.
  std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>> ApplyLocked(
      const Optimizer& optimizer, Chunk* chunk,
      const std::vector<const float*>& contributions,
      std::vector<Waiter> waiters) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  void ApplySync(const Optimizer& optimizer, Chunk* chunk)
      ABSL_LOCKS_EXCLUDED(chunk->mu);
  // Checkpoints: copies the chunk's state when its version is due, and
  // schedules the hand-over once every owned chunk has its copy.
  void MaybeSnapshot(Chunk* chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  // `epoch`: reset_epoch_ when the copies were counted; a reset since makes
  // the hand-over a no-op.
  void HandOverCheckpoint(int64_t version, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ssp: true when the reply to `step` may go out (always in async mode).
  bool StalenessAllows(const Chunk& chunk, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) ABSL_LOCKS_EXCLUDED(members_mu_);
  // Ssp: moves the held replies that may now go out into `replies`.
  void ReleaseHeld(
      Chunk* chunk,
      std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>>* replies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  // Counts the bytes and hands `reply` to `sink`. Call without locks.
  void Deliver(ReplySink* sink, ChunkReply reply);
  const State* state() const ABSL_LOCKS_EXCLUDED(mu_);
  // The step `rank` continues from (see DeclareResponse.next_step).
  int64_t NextStep(const State& state, uint32_t rank) const;

  // How this shard treats one worker rank (see ApplyView).
  struct RankState {
    enum class Kind {
      kActive,   // waited for from `from_step` on
      kPending,  // a new process holds the rank; not waited for yet
      kGone,     // left or expired; not waited for
    };
    Kind kind = Kind::kActive;
    bool seen = false;  // a view showed the rank alive
    uint64_t incarnation = 0;
    int64_t from_step = 0;
    uint64_t changed_generation = 0;  // of the view that set `kind`
  };
  // OK when a request of `rank` from `incarnation` may go on; else the
  // status that refuses it (UNAVAILABLE: this shard has not seen the
  // process join yet; ABORTED: the process is no longer part of the job).
  absl::Status CheckIncarnation(uint32_t rank, uint64_t incarnation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_);
  // CheckIncarnation, and a push of `step` by a rank that is waited for.
  absl::Status CheckMember(uint32_t rank, uint64_t incarnation,
                           int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_);
  // The ranks a sync step `step` waits for, ascending.
  std::vector<uint32_t> ActiveRanks(int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_);
  // Whether sync step `step` waits for `rank`.
  bool WaitsFor(uint32_t rank, int64_t step) const
      ABSL_LOCKS_EXCLUDED(members_mu_);
  // Sync: the chunk's current step has every contribution it waits for.
  bool StepComplete(const Chunk& chunk) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) ABSL_LOCKS_EXCLUDED(members_mu_);
  // Applies a complete sync step of `chunk` inline or on the pool.
  void ScheduleApply(const State& state, Chunk* chunk);
  // Sync: completes the steps that no longer wait for anyone missing;
  // ssp: releases replies the slowest remaining rank no longer holds back.
  void ReleaseAfterMembershipChange(const State& state)
      ABSL_LOCKS_EXCLUDED(mu_, members_mu_);
  // Declare with `join`: makes `rank` waited for from `join_step`.
  absl::Status Join(const State& state, const v1::DeclareRequest& req)
      ABSL_LOCKS_EXCLUDED(members_mu_);

  const StoreOptions options_;
  // Destroyed first (in ~ParameterStore): queued updates still use chunks.
  std::unique_ptr<ThreadPool> pool_;
  // Serialises building a declaration's state (which may be large).
  absl::Mutex declare_mu_;

  mutable absl::Mutex mu_;
  // Written once by the first successful Declare, then read-only.
  std::unique_ptr<State> state_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> pushes_{0};
  std::atomic<uint64_t> updates_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> bytes_in_{0};
  std::atomic<uint64_t> bytes_out_{0};
  std::atomic<uint64_t> weight_copies_{0};
  std::atomic<uint64_t> rollback_id_{0};
  // Bumped by every ResetTo (with every chunk locked).
  std::atomic<uint64_t> reset_epoch_{0};

  // Acquired after a chunk's mu, never before.
  mutable absl::Mutex members_mu_;
  bool coordinated_ ABSL_GUARDED_BY(members_mu_) = false;
  uint64_t view_generation_ ABSL_GUARDED_BY(members_mu_) = 0;
  uint64_t coordinator_incarnation_ ABSL_GUARDED_BY(members_mu_) = 0;
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(members_mu_);

  // Serialises RequestCheckpoint: one request's marks are never taken back
  // by another's.
  absl::Mutex request_mu_;
  absl::Mutex snapshot_mu_;  // acquired after a chunk's mu, never before
  std::map<int64_t, size_t> snapshot_counts_ ABSL_GUARDED_BY(snapshot_mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PARAMETER_STORE_H_
