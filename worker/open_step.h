// OpenStep: one step of a Client between BeginStep and FinishStep: the
// gradients and learning rates pushed so far, and, for its lanes' calls,
// each chunk's message (built from them and the regions its call named) and
// each reply taken into the caller's weight buffers. Threads: the caller
// records a tensor (Push) before it queues the tensor's chunks; a lane's
// reactions then read that tensor's entries and write only their own
// chunks' weights, payloads, residuals and sparse copies.
#ifndef SHARDPS_WORKER_OPEN_STEP_H_
#define SHARDPS_WORKER_OPEN_STEP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "worker/client.h"
#include "worker/compression.h"
#include "worker/lane_call.h"
#include "worker/lane_plan.h"
#include "worker/reply_reader.h"

namespace shardps {

// What a step is pushed against, as the Client declared it; borrowed, and
// unchanged while a step is open.
struct StepModel {
  const ClientOptions* options = nullptr;
  const uint64_t* rollback_id = nullptr;  // read as each message is built
  const v1::Layout* layout = nullptr;
  const std::vector<ChunkSpec>* chunks = nullptr;
  const LanePlan* plan = nullptr;
  GradientCompressor* compressor = nullptr;  // null: fp32 gradients
  ReplyReader* reader = nullptr;
};

class OpenStep {
 public:
  // `weights`: where replies go (null: a push-only step; else copied, the
  // spans must outlive the step). `speculate`: a two-phase step asks for
  // speculative weights (ClientOptions::speculative_weights). Starts now.
  OpenStep(const StepModel& model, int64_t step, const Tensors* weights,
           bool initial_values, const StepOptions& options = {},
           bool speculate = false);

  const StepOptions& options() const { return options_; }
  void set_max_grad_norm(float max_norm) { options_.max_grad_norm = max_norm; }
  // Two-phase steps: 1 while the gradients go out (replies: each chunk's
  // sum of squares), 2 once the decision does (replies: the weights).
  int phase() const { return phase_; }
  // Starts phase 2 with `decision`: the chunks still to be sent it are
  // those whose weights did not come yet (Pending).
  void Decide(const StepDecision& decision);
  // The chunks of `lane_chunks` whose reply the current phase still needs.
  std::vector<uint32_t> Pending(absl::Span<const uint32_t> lane_chunks) const;
  // After phase 1: the step's norm from every chunk's sum of squares,
  // added in chunk id order (InternalError naming a chunk without one),
  // and the decision a shard already applied, if a reply brought one.
  absl::StatusOr<double> Norm() const;
  const std::optional<StepDecision>& applied() const { return applied_; }
  // The norm, once phase 1 ended (Client::GradNorm).
  const std::optional<double>& norm() const { return norm_; }
  void set_norm(double norm) { norm_ = norm; }

  int64_t step() const { return step_; }
  absl::Time start() const { return start_; }
  int tensors_left() const {
    return model_.layout->tensors_size() - num_pushed_;
  }
  // Whether `tensor` was pushed whole.
  bool pushed(int tensor) const { return pushed_[tensor]; }
  // One phase, with weights: each chunk's reply brings its final weights.
  bool AwaitsWeights() const { return !push_only_ && !options_.second_phase; }
  // The names of the tensors not pushed yet.
  std::vector<std::string> Missing() const;

  // Chunk ids [begin, end) to queue.
  struct ChunkRange {
    uint32_t begin = 0;
    uint32_t end = 0;
  };
  // Records that the first `ready` elements of `tensor`'s gradient are
  // final (its size: the whole tensor; `no_gradient`: none, whole) and
  // returns the chunks that became sendable, which the caller then queues.
  // The first push of a tensor checks and records its gradient and
  // hyperparameters (Client::PushTensor's INVALID_ARGUMENT); a later one
  // must name the same gradient buffer and hyperparameters. Nothing is
  // recorded on error. Compressed tensors go whole (a value the encoding
  // cannot carry sends nothing of them): parts before that return none.
  absl::StatusOr<ChunkRange> Push(int tensor, absl::Span<const float> gradient,
                                  const StepHyperparameters& hyperparameters,
                                  bool no_gradient, int64_t ready);
  // Compression: checks that the chunks of `tensor` can be encoded (each is
  // encoded when its lane sends it). InvalidArgument naming the tensor and
  // element when a value cannot be.
  absl::Status EncodeTensor(int tensor, absl::Span<const float> gradient);

  // LaneOwner's calls for this step (see lane_call.h).
  absl::StatusOr<grpc::ByteBuffer> MessageFor(Lane* lane, uint32_t id,
                                              bool last,
                                              v1::PushPullRequest* header,
                                              const CallRegions& regions);
  bool HeaderFor(uint32_t id, bool last, v1::PushPullRequest* header,
                 const CallRegions& regions);
  absl::Status TakeReply(Lane* lane, std::vector<bool>* expected,
                         const CallRegions& regions);

 private:
  // The chunk's gradient goes out compressed (not no_gradient, not
  // initial values).
  bool Compressed(uint32_t id) const;
  // Where in regions.weights the reply to chunk `c` is asked (the caller's
  // weights lie there, fp32 replies, a stream region); none: elsewhere.
  std::optional<uint64_t> ReplyInWeightRegion(const ChunkSpec& c,
                                              const CallRegions& regions) const;
  // Asks the reply of chunk `c` (`id`) into the weight region or else the
  // stream's region, where it fits.
  void PlaceReply(const ChunkSpec& c, const CallRegions& regions,
                  v1::PushPullRequest* header) const;

  const StepModel model_;
  const int64_t step_;
  StepOptions options_;
  int phase_ = 1;
  // Two-phase steps, by chunk id: its sum of squares, once a reply brought
  // it; its weights came (a shard had applied the decision already).
  std::vector<std::optional<double>> sum_of_squares_;
  std::vector<bool> updated_;
  // Asked for speculative weights; by chunk id, they came (into the
  // caller's buffers, with the sum of squares).
  const bool speculate_;
  std::vector<bool> speculated_;
  std::optional<StepDecision> decision_;  // phase 2's
  std::optional<StepDecision> applied_;   // a reply's
  std::optional<double> norm_;
  const bool initial_values_;
  const bool push_only_;
  const Tensors weights_;                             // empty for push-only
  ConstTensors gradients_;                            // by tensor, as pushed
  std::vector<StepHyperparameters> hyperparameters_;  // by tensor
  std::vector<bool> pushed_;                          // by tensor, whole
  // By tensor: the first chunk not queued yet (a part pushed queues some).
  std::vector<uint32_t> queued_end_;
  // By tensor; bytes, not bits: lane threads read it while the caller
  // writes other tensors' entries.
  std::vector<char> no_gradient_;
  // Compressed gradients: by chunk id, the payload sent (owned by the
  // GradientCompressor, valid for the step), and by tensor, checked.
  std::vector<absl::string_view> payloads_;
  std::vector<bool> encoded_;
  int num_pushed_ = 0;
  const absl::Time start_;
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_OPEN_STEP_H_
