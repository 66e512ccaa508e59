// The sync policy: a chunk's step completes when every rank the step waits
// for has pushed; the contributions are reduced in rank order (so the result
// is bitwise independent of arrival order), the optimizer runs once (or is
// skipped when no rank had a gradient) and every pusher gets the new
// weights. Thread-safe.
#ifndef SHARDPS_SERVER_SYNC_AGGREGATOR_H_
#define SHARDPS_SERVER_SYNC_AGGREGATOR_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "server/aggregator.h"

namespace shardps::server {

class SyncAggregator final : public Aggregator {
 public:
  SyncAggregator(const AggregatorOptions& options, std::vector<Chunk*> chunks,
                 const ChunkUpdater* updater, const RankTracker* ranks,
                 ThreadPool* pool);

  absl::Status Push(const PushArgs& args, Chunk* chunk,
                    std::shared_ptr<ReplySink> sink) override;
  int64_t NextStep(uint32_t rank) const override;
  int64_t PrepareJoin(uint32_t rank, int64_t join_step) override;
  void MembershipChanged() override;
  void Reset(Chunk* chunk,
             std::vector<std::shared_ptr<ReplySink>>* failed) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
  std::vector<StalledChunk> Stalled(absl::Duration timeout) const override;

 private:
  // The step a chunk is collecting contributions for (its version).
  struct Step {
    Step(Chunk* c, uint32_t num_workers);
    Chunk* const chunk;
    // Per-rank gradients, kept until every rank the step waits for pushed.
    std::vector<std::vector<float>> contributions ABSL_GUARDED_BY(chunk->mu);
    // Ranks that pushed this step, with a gradient or without (no_gradient:
    // their buffer holds zeros).
    std::vector<bool> contributed ABSL_GUARDED_BY(chunk->mu);
    uint32_t num_contributed ABSL_GUARDED_BY(chunk->mu) = 0;
    // Of those, the ones with a gradient; 0 at Apply: the update is skipped.
    uint32_t num_with_gradient ABSL_GUARDED_BY(chunk->mu) = 0;
    // PushArgs::learning_rate of the step's first push; every later push
    // of the step must carry the same (bitwise).
    std::optional<float> learning_rate ABSL_GUARDED_BY(chunk->mu);
    absl::Time first_contribution ABSL_GUARDED_BY(chunk->mu);
    std::vector<Waiter> waiters ABSL_GUARDED_BY(chunk->mu);
    // The complete step's update is queued (Apply will run).
    bool apply_scheduled ABSL_GUARDED_BY(chunk->mu) = false;
  };

  // INVALID_ARGUMENT unless `args` carries the learning rate of the step's
  // first push (any, when it is the first).
  absl::Status CheckLearningRate(const Step& step, const PushArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // Clears the step's contributions (after Apply or a reset).
  static void Clear(Step* step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // The step has every contribution it waits for.
  bool Complete(const Step& step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // Applies a complete step inline (small chunks) or on the pool.
  void ScheduleApply(Step* step);
  void Apply(Step* step) ABSL_LOCKS_EXCLUDED(step->chunk->mu);

  const AggregatorOptions options_;
  const ChunkUpdater* const updater_;
  const RankTracker* const ranks_;
  ThreadPool* const pool_;
  std::vector<std::unique_ptr<Step>> steps_;  // by chunk id; null: not owned
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SYNC_AGGREGATOR_H_
