// The async and ssp policies: each push is applied to its chunk on arrival
// with its own hyperparameters, one rank's step at a time (a push without a
// gradient only moves the rank's clock). Async answers at once; ssp (stale
// synchronous parallel) holds the reply to a push of step t until every rank in
// the job has pushed step t - staleness. Thread-safe.
#ifndef SHARDPS_SERVER_ASYNC_AGGREGATOR_H_
#define SHARDPS_SERVER_ASYNC_AGGREGATOR_H_

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "server/aggregator.h"

namespace shardps::server {

class AsyncAggregator final : public Aggregator {
 public:
  // options.mode is kAsync or kSsp.
  AsyncAggregator(const AggregatorOptions& options, std::vector<Chunk*> chunks,
                  const ChunkUpdater* updater, const RankTracker* ranks);

  absl::Status Push(const PushArgs& args, Chunk* chunk,
                    std::shared_ptr<ReplySink> sink) override;
  int64_t NextStep(uint32_t rank) const override;
  int64_t PrepareJoin(uint32_t rank, int64_t join_step) override;
  void MembershipChanged() override;
  void Reset(Chunk* chunk,
             std::vector<std::shared_ptr<ReplySink>>* failed) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);

 private:
  // Each rank's clock on one chunk.
  struct Clocks {
    Clocks(Chunk* c, uint32_t num_workers);
    Chunk* const chunk;
    // The gradient being applied (decoded under the chunk's lock).
    std::vector<float> gradient ABSL_GUARDED_BY(chunk->mu);
    // The last step applied for each rank (-1: none).
    std::vector<int64_t> last_step ABSL_GUARDED_BY(chunk->mu);
    // Ssp: replies held back until the slowest rank catches up.
    std::vector<Waiter> held ABSL_GUARDED_BY(chunk->mu);
  };

  // Ssp: true when the reply to `step` may go out (always in async mode).
  bool StalenessAllows(const Clocks& clocks, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(clocks.chunk->mu);
  // Moves the held replies that may now go out into `replies`.
  void ReleaseHeld(Clocks* clocks, PendingReplies* replies) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(clocks->chunk->mu);

  const AggregatorOptions options_;
  const ChunkUpdater* const updater_;
  const RankTracker* const ranks_;
  std::vector<std::unique_ptr<Clocks>> clocks_;  // by chunk id; null: not own
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_ASYNC_AGGREGATOR_H_
