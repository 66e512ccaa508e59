// An Aggregator is a shard's consistency policy: how the pushes of a chunk
// become optimizer updates and when each pusher gets its reply. Sync
// (sync_aggregator.h) reduces every rank's contribution in rank order;
// async and ssp (async_aggregator.h) apply pushes on arrival. Thread-safe.
#ifndef SHARDPS_SERVER_AGGREGATOR_H_
#define SHARDPS_SERVER_AGGREGATOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/encoding.h"
#include "common/step_hyperparameters.h"
#include "server/chunk.h"
#include "server/rank_tracker.h"
#include "server/receive_budget.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// A shard's consistency is v1::Consistency (DeclareResponse.consistency).
// sync: a step's update waits for every worker. async: each push is applied
// on arrival. ssp (stale synchronous parallel): applied on arrival, but the
// reply to a worker's push of step t waits until every worker has pushed
// step t - staleness, so no worker runs more than `staleness` steps ahead.
// ConsistencyName spells it as --mode does ("sync", "async", "ssp:K"), for
// logs and GetStatusResponse.mode; UNSPECIFIED counts as sync.
std::string ConsistencyName(v1::Consistency mode, int64_t staleness);

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
  // The fields set replace the declared learning rate (and its schedule),
  // momentum and betas for this update; unset ones keep them. Sync: every
  // push of a chunk's step must carry the same (the first push's).
  StepHyperparameters hyperparameters;
  // The rank has no gradient for the chunk this step; the payload is empty.
  // Sync: counts as a zero gradient, and a step where no rank has one skips
  // the update (ChunkUpdater::Skip). Async and ssp: the rank's clock
  // advances, nothing is applied.
  bool no_gradient = false;
  // The payload is the chunk's initial weights (InitSpec KIND_PROVIDED),
  // handled by the store, never by an Aggregator; `step` is not checked.
  bool initial_values = false;
  // Two-phase steps (sync only; PushPullRequest.second_phase): the chunk's
  // update waits for the step's decision, and a `loss_scale` (> 0) unscales
  // the averaged gradient and lets non-finite gradients in. A push with a
  // `decision` carries no gradient: it is that decision for the chunk's
  // sealed step.
  bool second_phase = false;
  std::optional<float> loss_scale;
  std::optional<StepDecision> decision;
  // Speculative weights (PushPullRequest.speculative_weights): on a
  // two-phase push, the sealed reply also carries the weights of the
  // update at clip coefficient 1; on a decision, the pusher holds them.
  bool speculative_weights = false;
  // The gradient bytes, decoded once into the aggregation buffer when
  // accepted.
  const ByteSource* payload = nullptr;
};

// A sync step some workers pushed and others have not, for longer than a
// timeout: what it waits for.
struct StalledChunk {
  uint32_t chunk_id = 0;
  int64_t step = 0;
  std::vector<uint32_t> missing_ranks;
  absl::Duration waiting;
};

struct AggregatorOptions {
  v1::Consistency mode = v1::CONSISTENCY_SYNC;
  int64_t staleness = 0;  // ssp only
  // Accept gradients holding NaN or infinity (rejected by default).
  bool allow_nonfinite = false;
  // Sync: every update runs on the thread that completed its chunk's step
  // (else updates of large chunks go to the pool, in parallel).
  bool inline_updates = false;
  // Step and staleness histograms; null: none.
  ServerMetrics* metrics = nullptr;
  // Sync: told where each chunk's rank-ordered sum stands (MoveFold); null:
  // no receive budget.
  ReceiveBudget* budget = nullptr;
};

// A pusher waiting for its reply.
struct Waiter {
  uint32_t rank = 0;
  bool push_only = false;
  std::shared_ptr<ReplySink> sink;
  int64_t step = 0;  // ssp: the step whose reply waits
  // Sync, two-phase: PushArgs::speculative_weights of the waiting push.
  bool speculative = false;
};

class Aggregator {
 public:
  virtual ~Aggregator() = default;

  // Records one gradient push the caller validated (chunk owned and not
  // awaiting its values, payload length or no_gradient with an empty one,
  // hyperparameters, rank, membership). On OK `sink` gets the reply once the
  // update that includes the push is applied. A push of the step before
  // the chunk's is a retry: not applied again, answered with the current
  // weights. OUT_OF_RANGE for a step in the past or the future;
  // INVALID_ARGUMENT for a non-finite gradient, or (sync) hyperparameters
  // other than the ones the step's first push carried; (sync) ABORTED for a
  // rank the step went on without because it left the job. On error
  // nothing changed.
  virtual absl::Status Push(const PushArgs& args, Chunk* chunk,
                            std::shared_ptr<ReplySink> sink) = 0;

  // The step `rank` pushes next (DeclareResponse.next_step).
  virtual int64_t NextStep(uint32_t rank) const = 0;

  // `rank` joins at `join_step` (the RankTracker already counts it from
  // there): returns the furthest step at or past `join_step` whose update is
  // already decided without it, or -1 when the join is in time.
  virtual int64_t PrepareJoin(uint32_t rank, int64_t join_step) = 0;

  // The ranks steps wait for changed: completes the steps that no longer
  // wait for anyone missing, releases replies no longer held back.
  virtual void MembershipChanged() = 0;

  // `chunk` was set to a checkpoint's state (Restore, ResetTo): drops the
  // pending contributions and moves the waiting pushers' sinks to *failed.
  virtual void Reset(Chunk* chunk,
                     std::vector<std::shared_ptr<ReplySink>>* failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu) = 0;

  // Sync: the chunks whose current step has waited longer than `timeout`
  // since its first contribution. Empty in the other modes.
  virtual std::vector<StalledChunk> Stalled(absl::Duration timeout) const {
    return {};
  }
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_AGGREGATOR_H_
