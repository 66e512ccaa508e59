// A ParameterStore is one shard's state behind the ParameterServer service:
// it validates requests and routes them to the shard's model (shard_model.h),
// its consistency policy (aggregator.h), the ranks it waits for
// (rank_tracker.h) and its checkpoint copies (snapshot_scheduler.h).
// Thread-safe: every RPC handler of the shard shares it.
#ifndef SHARDPS_SERVER_PARAMETER_STORE_H_
#define SHARDPS_SERVER_PARAMETER_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/thread_pool.h"
#include "server/aggregator.h"
#include "server/checkpoint.h"
#include "server/chunk.h"
#include "server/gradient_decode.h"
#include "server/rank_tracker.h"
#include "server/receive_budget.h"
#include "server/shard_model.h"
#include "server/snapshot_scheduler.h"
#include "shardps/v1/coordinator.pb.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

class ServerMetrics;

struct StoreOptions {
  uint32_t shard_index = 0;
  uint32_t num_shards = 1;
  uint32_t num_workers = 1;
  v1::Consistency mode = v1::CONSISTENCY_SYNC;
  int64_t staleness = 0;  // ssp only
  // Accept gradients holding NaN or infinity (rejected by default).
  bool allow_nonfinite = false;
  // Gradient encodings accepted (shardps-server --encodings); a push in
  // another is INVALID_ARGUMENT.
  EncodingSet accepted_encodings = kAllGradientEncodings;
  // Threads that run optimizer updates, in parallel across chunks; 0: each
  // update runs on the thread that completed its chunk's step (one thread
  // is still kept for checkpoints).
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
  // The receive budget (server/receive_budget.h), in bytes; 0: none.
  int64_t max_inflight_bytes = 0;
};

class ParameterStore {
 public:
  explicit ParameterStore(StoreOptions options);
  ~ParameterStore();

  const StoreOptions& options() const { return options_; }

  // The shard's receive budget, whose reads its PushPull streams ask for.
  ReceiveBudget& budget() { return budget_; }
  const ReceiveBudget& budget() const { return budget_; }
  // What one read of a push may bring: the largest chunk as fp32 (before a
  // declaration, the largest automatic chunk).
  int64_t ReadBytes() const { return read_bytes_.load(); }

  // Creates the chunks this shard owns, with their initial values and
  // optimizer slots (each tensor's optimizer: TensorOptimizers); the chunks
  // of KIND_PROVIDED tensors await their values (awaiting_values in the
  // response while any does). Idempotent: an identical declaration returns
  // the existing state (created = false). InvalidArgument for a bad layout or
  // optimizer, FailedPrecondition for a view of the cluster that differs from
  // this shard's or a declaration that differs from the existing one; with
  // `join`, OutOfRange for a join step the shard has passed.
  absl::StatusOr<v1::DeclareResponse> Declare(const v1::DeclareRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Validates and records one contribution. On success `sink` receives the
  // chunk's updated weights once the update that includes it is applied (sync:
  // when every worker has pushed; async: at once). A push of the step before
  // the chunk's current version is a retry: it is not applied again and gets
  // the current weights. PushArgs says what hyperparameters and no_gradient
  // do; a gradient push to a chunk awaiting its initial values is
  // UNAVAILABLE. A push with initial_values (fp32 of the chunk's length, all
  // finite; any step) sets the weights of a chunk that awaits them and is
  // ignored otherwise; either way `sink` gets the chunk's weights at once.
  // On error nothing changed; the codes are those of the ParameterServer
  // service (see the proto).
  absl::Status Push(const PushArgs& args, std::shared_ptr<ReplySink> sink)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Creates the shard's state from a checkpoint instead of initial values
  // (no chunk awaits its values): `chunks` must hold exactly the chunks this
  // shard owns under `declaration`. FailedPrecondition if the shard is already
  // declared or the chunks do not match; InvalidArgument for a bad declaration.
  absl::Status Restore(const v1::DeclareRequest& declaration,
                       std::vector<ChunkState> chunks) ABSL_LOCKS_EXCLUDED(mu_);

  // A job-wide rollback: resets every owned chunk (weights, optimizer
  // slots, version; none awaits its values after) to `chunks`, the checkpoint
  // this shard's chunks were saved in, drops the contributions of the step in
  // flight and fails every push waiting for a reply with `why`. `rollback_id`
  // is reported by Report() and DeclareResponse. FailedPrecondition before
  // Declare or for chunks that do not match the declaration (nothing changed
  // then).
  absl::Status ResetTo(std::vector<ChunkState> chunks, const absl::Status& why,
                       uint64_t rollback_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Records a rollback that needed no reset (see ResetTo).
  void NoteRollback(uint64_t rollback_id) { rollback_id_.store(rollback_id); }

  // Copies out the weights of `chunk_id` with their version. NotFound if the
  // chunk is not declared on this shard; FailedPrecondition before Declare;
  // Unavailable while the chunk awaits its initial values.
  absl::StatusOr<ChunkReply> Read(uint32_t chunk_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The optimizer state of `chunk_id` at its version (optimizer_state.h),
  // and its replacement (the ParameterServer's ReadOptimizerState and
  // WriteOptimizerState: see the proto for the codes). Read's codes; a
  // refused write changed nothing.
  absl::StatusOr<v1::ChunkOptimizerState> ReadOptimizerState(
      uint32_t chunk_id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WriteOptimizerState(const v1::ChunkOptimizerState& state)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Counts weights handed to the transport: `fp32_bytes` of values sent as
  // `wire_bytes` of payload (Report's bytes_out_fp32_total, bytes_out_total).
  void CountSent(uint64_t fp32_bytes, uint64_t wire_bytes) {
    counters_.bytes_out_fp32.fetch_add(fp32_bytes, std::memory_order_relaxed);
    counters_.bytes_out.fetch_add(wire_bytes, std::memory_order_relaxed);
  }

  // OK when Read(chunk_id) would succeed now; else its status.
  absl::Status CheckReadable(uint32_t chunk_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // The declaration this shard holds; FailedPrecondition before Declare.
  absl::StatusOr<v1::DeclareRequest> declaration() const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Chunk ids this shard owns, ascending; empty before Declare.
  std::vector<uint32_t> OwnedChunks() const ABSL_LOCKS_EXCLUDED(mu_);
  // Their weight bytes and count (0, 0 before Declare).
  std::pair<uint64_t, uint64_t> OwnedSize() const ABSL_LOCKS_EXCLUDED(mu_);
  // The same of the whole model, every shard's chunks (0, 0 before
  // Declare).
  std::pair<uint64_t, uint64_t> ModelSize() const ABSL_LOCKS_EXCLUDED(mu_);

  // The shard's report for GetStatus: shape, counters, versions, and the
  // ranks its current step waits for.
  v1::GetStatusResponse Report() const ABSL_LOCKS_EXCLUDED(mu_);

  // A checkpoint at `step` besides the periodic ones: each owned chunk's
  // state is copied when its version reaches `step`, and on_checkpoint(step,
  // ...) runs once every chunk has its copy. Training is unaffected.
  // InvalidArgument for a negative step; FailedPrecondition without
  // on_checkpoint or before Declare; OutOfRange when a chunk has already
  // passed `step` (then nothing is requested).
  absl::Status RequestCheckpoint(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // Follows the coordinator's membership (see RankTracker::ApplyView): sync
  // steps that waited only for ranks no longer in the job complete with the
  // contributions that arrived. Returns one line per change, for the log.
  std::vector<std::string> ApplyView(const v1::ClusterView& view)
      ABSL_LOCKS_EXCLUDED(mu_);

  using StalledChunk = server::StalledChunk;
  // Sync chunks whose current step has waited longer than `timeout` since
  // its first contribution.
  std::vector<StalledChunk> Stalled(absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What a declaration creates; constant once published.
  struct State {
    std::unique_ptr<ShardModel> model;
    std::unique_ptr<ChunkUpdater> updater;
    std::unique_ptr<Aggregator> aggregator;
  };
  absl::StatusOr<std::unique_ptr<State>> BuildState(
      const v1::DeclareRequest& req);
  const State* state() const ABSL_LOCKS_EXCLUDED(mu_);
  // Chunk `chunk_id` of the declared model: FailedPrecondition before
  // Declare, NotFound for a chunk this shard does not own.
  absl::StatusOr<Chunk*> DeclaredChunk(uint32_t chunk_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Publishes `built` unless a state exists; true when it did.
  bool Publish(std::unique_ptr<State> built) ABSL_LOCKS_EXCLUDED(mu_);
  // Rank, step, hyperparameters and payload length of a push to `chunk`.
  absl::Status CheckPush(const PushArgs& args, const Chunk& chunk) const;
  // Push without the counters.
  // Sets *fp32_bytes to the gradient's size as fp32 (0 for no_gradient).
  absl::Status Route(const PushArgs& args, std::shared_ptr<ReplySink> sink,
                     uint64_t* fp32_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // A push with initial_values, checked by CheckPush and the rank tracker.
  absl::Status SetInitialValues(const State& state, const PushArgs& args,
                                Chunk* chunk, std::shared_ptr<ReplySink> sink)
      ABSL_LOCKS_EXCLUDED(chunk->mu);
  // Declare with `join`: makes `rank` waited for from `join_step`.
  absl::Status Join(const State& state, const v1::DeclareRequest& req);

  const StoreOptions options_;
  ShardCounters counters_;
  std::atomic<uint64_t> rollback_id_{0};
  RankTracker ranks_;
  ReceiveBudget budget_;
  std::atomic<int64_t> read_bytes_;
  // Runs large sync updates and checkpoint hand-overs. Destroyed first (in
  // ~ParameterStore): queued work still uses the chunks and the scheduler.
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<SnapshotScheduler> snapshots_;
  // Serialises building a declaration's state (which may be large).
  absl::Mutex declare_mu_;

  mutable absl::Mutex mu_;
  // Written once by the first successful Declare or Restore, then read-only.
  std::unique_ptr<State> state_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PARAMETER_STORE_H_
