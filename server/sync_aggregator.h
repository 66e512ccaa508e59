// The sync policy: a chunk's step completes when every rank the step waits
// for has pushed; the contributions are summed in rank order (so the result
// is bitwise independent of arrival order), the optimizer runs once (or is
// skipped when no rank had a gradient) and every pusher gets the new
// weights. The sum is built as the pushes arrive: a rank's gradient is added
// as soon as every rank below it has been added (or is not waited for), and
// one that comes early is kept until then while its stream reads nothing
// more (ReplySink::Hold). So a chunk's aggregation memory is one sum, plus
// at most one early gradient per stream, whatever the number of workers.
// Thread-safe.
#ifndef SHARDPS_SERVER_SYNC_AGGREGATOR_H_
#define SHARDPS_SERVER_SYNC_AGGREGATOR_H_

#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
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
  // A gradient that arrived before the ranks below it: kept until they are
  // summed, holding its stream's reads.
  struct Early {
    // FP32, BF16 or FP16 in gRPC's slices: the payload, checked on arrival
    // and decoded into the sum at its turn, from where it lies.
    std::unique_ptr<ByteSource> payload;
    v1::Encoding encoding = v1::ENCODING_FP32;
    // Otherwise (shared memory, INT8, TOPK): decoded on arrival,
    // uninitialised until then (a vector would zero it first). Both null
    // for a no_gradient push.
    std::unique_ptr<float[]> gradient;
    std::shared_ptr<ReplySink> reader;
  };
  // The step a chunk is collecting contributions for (its version).
  struct Step {
    Step(Chunk* c, uint32_t num_workers);
    Chunk* const chunk;
    // The sum of the contributions of ranks [0, fold) in rank order (valid
    // once num_summed > 0); no_gradient pushes count as zeros.
    std::vector<float> sum ABSL_GUARDED_BY(chunk->mu);
    // Every rank below `fold` is summed, or was not waited for when the sum
    // passed it (it can then only join at a later step).
    uint32_t fold ABSL_GUARDED_BY(chunk->mu) = 0;
    uint32_t num_summed ABSL_GUARDED_BY(chunk->mu) = 0;
    // By rank: gradients of ranks at or above `fold` (null: none).
    std::vector<std::unique_ptr<Early>> early ABSL_GUARDED_BY(chunk->mu);
    // Ranks that pushed this step, with a gradient or without.
    std::vector<bool> contributed ABSL_GUARDED_BY(chunk->mu);
    uint32_t num_contributed ABSL_GUARDED_BY(chunk->mu) = 0;
    // Of those, the ones with a gradient; 0 at Apply: the update is skipped.
    uint32_t num_with_gradient ABSL_GUARDED_BY(chunk->mu) = 0;
    // PushArgs::hyperparameters of the step's first push; every later
    // push of the step must carry the same (bitwise).
    StepHyperparameters hyperparameters ABSL_GUARDED_BY(chunk->mu);
    absl::Time first_contribution ABSL_GUARDED_BY(chunk->mu);
    std::vector<Waiter> waiters ABSL_GUARDED_BY(chunk->mu);
    // The complete step's update is queued (Apply will run), or the step
    // is sealed.
    bool apply_scheduled ABSL_GUARDED_BY(chunk->mu) = false;
    // Two-phase steps (PushArgs::second_phase, loss_scale) as the step's
    // first push set them; every later push must agree.
    bool second_phase ABSL_GUARDED_BY(chunk->mu) = false;
    std::optional<float> loss_scale ABSL_GUARDED_BY(chunk->mu);
    // Complete and answered with its sum of squares: the update waits for
    // the step's decision.
    bool sealed ABSL_GUARDED_BY(chunk->mu) = false;
    double sum_of_squares ABSL_GUARDED_BY(chunk->mu) = 0;
    // Speculative weights (PushArgs::speculative_weights): a push of the
    // step asked for them; the seal computed the update at clip
    // coefficient 1 into the buffers below (kept from step to step while
    // asked, freed at a seal that was not), which the decision commits or
    // drops.
    bool speculate ABSL_GUARDED_BY(chunk->mu) = false;
    bool speculated ABSL_GUARDED_BY(chunk->mu) = false;
    std::shared_ptr<std::vector<float>> speculative_weights
        ABSL_GUARDED_BY(chunk->mu);
    std::vector<std::vector<float>> speculative_slots
        ABSL_GUARDED_BY(chunk->mu);
    // The sealed step's decision, once one came (its update is then
    // scheduled).
    std::optional<StepDecision> decided ABSL_GUARDED_BY(chunk->mu);
    // The decision of the update to the chunk's current version (none: that
    // update was not a two-phase step's), for the retries of that step.
    std::optional<StepDecision> applied ABSL_GUARDED_BY(chunk->mu);
    double applied_sum_of_squares ABSL_GUARDED_BY(chunk->mu) = 0;
    // That update kept the step's speculative weights: a later decider
    // that holds them needs none.
    bool applied_speculation ABSL_GUARDED_BY(chunk->mu) = false;
    // Where the receive budget counts the step (FoldMoved).
    std::optional<ReceiveBudget::Fold> counted_at ABSL_GUARDED_BY(chunk->mu);
  };

  // INVALID_ARGUMENT naming the first field that differs unless `args`
  // carries the hyperparameters of the step's first push (any, when it is
  // the first).
  absl::Status CheckHyperparameters(const Step& step,
                                    const PushArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // INVALID_ARGUMENT unless `args` is a two-phase push (or not) with the
  // loss scale of the step's first push.
  absl::Status CheckPhases(const Step& step, const PushArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // A decision (args.decision) for the chunk's step: applied once the
  // step is sealed; a retry of the last one answered with the weights.
  // INVALID_ARGUMENT for one that is not a skip when the step's sum of
  // squares is not finite.
  absl::Status Decide(const PushArgs& args, Step* step,
                      std::shared_ptr<ReplySink> sink);
  // The reply to a push of the step before the chunk's (a retry whose reply
  // was lost, or a decision): the current weights, with the decision they
  // applied. None for a push-only one, nor for a decider that `holds` the
  // speculative weights the update kept (the reply then says speculative).
  ChunkReply RetryReply(const Step& step, bool push_only,
                        bool holds = false) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // What the step's averaged gradient is multiplied by to unscale it (1
  // without a loss scale).
  static float InverseLossScale(const Step& step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // The reply to a push of a sealed step: its sum of squares, and its
  // speculative weights if `speculative` and the seal computed them.
  static ChunkReply SealedReply(const Step& step, bool speculative)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // How the step's averaged gradient is scaled before the optimizer, with
  // `decision`'s clip coefficient.
  static GradientScaling Scaling(const Step& step, const StepDecision& decision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // Seals a complete two-phase step: computes its sum of squares (and,
  // when asked, its speculative update) and answers every waiter with it.
  void Seal(Step* step, PendingReplies* replies) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // Clears the step's contributions (after Apply or a reset).
  void Clear(Step* step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // Tells the receive budget where the step's sum stands now: its version
  // and fold; once complete, the next version's, at rank 0
  // (ReceiveBudget::MoveFold).
  void FoldMoved(Step* step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // Wakes the reads the budget admitted meanwhile (no lock held).
  void WakeAdmitted() const {
    if (options_.budget != nullptr) options_.budget->RunAdmitted();
  }
  // Records a first push of `args.rank` for the step: added to the sum when
  // every rank below is, else kept as early (holding `sink`'s reads).
  // ABORTED when the sum already went past the rank; the decoding's errors.
  // On error nothing changed.
  absl::Status Contribute(const PushArgs& args, Step* step,
                          const std::shared_ptr<ReplySink>& sink)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // Adds `gradient` (null: zeros) to the step's sum as the next rank's.
  // Adds an early push's gradient to the sum (AddToSum).
  static void AddEarly(Step* step, const Early& early)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  static void AddToSum(Step* step, const float* gradient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // Moves the fold past every rank that is summed now or not waited for;
  // the streams of the early gradients it sums go to *released.
  void Fold(Step* step, std::vector<std::shared_ptr<ReplySink>>* released) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);
  // The step has every contribution it waits for, summed.
  bool Complete(const Step& step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step.chunk->mu);
  // Applies a complete step inline (small chunks) or on the pool.
  void ScheduleApply(Step* step);
  // Seals a complete two-phase step without a decision, else updates it.
  void Apply(Step* step) ABSL_LOCKS_EXCLUDED(step->chunk->mu);
  // Applies the complete step's update (or skip) and answers its waiters.
  void Update(Step* step, PendingReplies* replies) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step->chunk->mu);

  const AggregatorOptions options_;
  const ChunkUpdater* const updater_;
  const RankTracker* const ranks_;
  ThreadPool* const pool_;
  std::vector<std::unique_ptr<Step>> steps_;  // by chunk id; null: not owned
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SYNC_AGGREGATOR_H_
