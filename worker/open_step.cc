#include "worker/open_step.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/encoding.h"
#include "common/status.h"
#include "common/step_hyperparameters.h"
#include "worker/shm_regions.h"

namespace shardps {

OpenStep::OpenStep(const StepModel& model, int64_t step, const Tensors* weights,
                   bool initial_values, const StepOptions& options,
                   bool speculate)
    : model_(model),
      step_(step),
      options_(options),
      speculate_(speculate),
      initial_values_(initial_values),
      push_only_(weights == nullptr),
      weights_(weights != nullptr ? *weights : Tensors()),
      start_(absl::Now()) {
  const size_t n = model.layout->tensors_size();
  gradients_.resize(n);
  hyperparameters_.assign(n, {});
  pushed_.assign(n, false);
  queued_end_.assign(model.plan->first_chunk.begin(),
                     model.plan->first_chunk.begin() + n);
  no_gradient_.assign(n, false);
  if (model.compressor != nullptr) {
    payloads_.assign(model.chunks->size(), {});
    encoded_.assign(n, false);
  }
  if (options.second_phase) {
    sum_of_squares_.assign(model.chunks->size(), std::nullopt);
    updated_.assign(model.chunks->size(), false);
    speculated_.assign(model.chunks->size(), false);
  }
}

void OpenStep::Decide(const StepDecision& decision) {
  decision_ = decision;
  phase_ = 2;
}

std::vector<uint32_t> OpenStep::Pending(
    absl::Span<const uint32_t> lane_chunks) const {
  if (phase_ == 1) return {lane_chunks.begin(), lane_chunks.end()};
  std::vector<uint32_t> pending;
  for (uint32_t id : lane_chunks) {
    if (!updated_[id]) pending.push_back(id);
  }
  return pending;
}

absl::StatusOr<double> OpenStep::Norm() const {
  // In chunk id order, whatever shard each chunk is on.
  double total = 0;
  for (size_t id = 0; id < sum_of_squares_.size(); ++id) {
    if (!sum_of_squares_[id].has_value()) {
      return absl::InternalError(
          absl::StrCat("bad reply: no sum of squares came for chunk ", id,
                       " of step ", step_));
    }
    total += *sum_of_squares_[id];
  }
  return std::sqrt(total);
}

std::vector<std::string> OpenStep::Missing() const {
  std::vector<std::string> missing;
  for (int t = 0; t < model_.layout->tensors_size(); ++t) {
    if (!pushed_[t]) missing.push_back(model_.layout->tensors(t).name());
  }
  return missing;
}

absl::StatusOr<OpenStep::ChunkRange> OpenStep::Push(
    int tensor, absl::Span<const float> gradient,
    const StepHyperparameters& hyperparameters, bool no_gradient,
    int64_t ready) {
  const v1::Layout& layout = *model_.layout;
  if (tensor < 0 || tensor >= layout.tensors_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor index ", tensor, " is out of range: the model has ",
        layout.tensors_size(), " tensors"));
  }
  const v1::TensorSpec& spec = layout.tensors(tensor);
  if (pushed_[tensor]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", spec.name(), " was already pushed at step ", step_));
  }
  const int64_t want = NumElements(spec);
  if (!no_gradient && static_cast<int64_t>(gradient.size()) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.name(), " has ", want,
                     " elements; its gradient has ", gradient.size()));
  }
  if (!no_gradient && (ready < 0 || ready > want)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.name(), " has ", want, " elements; ",
                     ready, " of them cannot be final"));
  }
  const uint32_t first = model_.plan->first_chunk[tensor];
  const uint32_t end = model_.plan->first_chunk[tensor + 1];
  const bool part_went = queued_end_[tensor] > first;
  if (part_went) {
    if (no_gradient || gradient.data() != gradients_[tensor].data()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", spec.name(), ": part of its gradient went from another ",
          "buffer at step ", step_, "; push the rest from the same one"));
    }
    if (const auto d =
            FirstDifference(hyperparameters_[tensor], hyperparameters)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", spec.name(), ": ", d->field, " ", d->b,
          " differs from the ", d->a, " its first part went with"));
    }
  } else {
    const absl::Status checked = CheckStepHyperparameters(hyperparameters);
    if (!checked.ok()) return WithPrefix("tensor " + spec.name(), checked);
  }
  const bool whole = no_gradient || ready == want;
  const bool compressed =
      model_.compressor != nullptr && !no_gradient && !initial_values_;
  if (compressed && !whole) return ChunkRange{first, first};
  if (compressed && !encoded_[tensor]) {
    // Encoded before anything of the tensor is queued: a value the
    // encoding cannot carry sends nothing of it.
    SHARDPS_RETURN_IF_ERROR(EncodeTensor(tensor, gradient));
  }
  if (!part_went) {
    // Set once, before any of the tensor's chunks is queued: lane threads
    // read them from then on.
    no_gradient_[tensor] = no_gradient;
    gradients_[tensor] = gradient;
    hyperparameters_[tensor] = hyperparameters;
  }
  const ChunkRange range{queued_end_[tensor], end};
  if (whole) {
    pushed_[tensor] = true;
    ++num_pushed_;
    queued_end_[tensor] = end;
    return range;
  }
  // The chunks that lie wholly within the final elements.
  const std::vector<ChunkSpec>& chunks = *model_.chunks;
  uint32_t id = range.begin;
  while (id < end && chunks[id].offset + chunks[id].num_elements <= ready) ++id;
  queued_end_[tensor] = id;
  return ChunkRange{range.begin, id};
}

absl::Status OpenStep::EncodeTensor(int tensor,
                                    absl::Span<const float> gradient) {
  const LanePlan& plan = *model_.plan;
  for (uint32_t id = plan.first_chunk[tensor];
       id < plan.first_chunk[tensor + 1]; ++id) {
    const ChunkSpec& c = (*model_.chunks)[id];
    if (!model_.compressor->compresses(id)) continue;
    const absl::Status s =
        model_.compressor->CheckValues(id, gradient.data() + c.offset, step_);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of tensor ", model_.layout->tensors(tensor).name(),
          " (chunk ", id, ", tensor elements from ", c.offset,
          "): ", s.message()));
    }
  }
  encoded_[tensor] = true;
  return absl::OkStatus();
}

bool OpenStep::Compressed(uint32_t id) const {
  return model_.compressor != nullptr && !initial_values_ &&
         !no_gradient_[(*model_.chunks)[id].tensor] &&
         model_.compressor->compresses(id);
}

std::optional<uint64_t> OpenStep::ReplyInWeightRegion(
    const ChunkSpec& c, const CallRegions& regions) const {
  if (regions.stream == nullptr || push_only_ ||
      EffectiveEncoding(model_.options->compression.weights) !=
          v1::ENCODING_FP32) {
    return std::nullopt;
  }
  return PlaceIn(regions.weights, weights_[c.tensor].data() + c.offset,
                 c.bytes());
}

void OpenStep::PlaceReply(const ChunkSpec& c, const CallRegions& regions,
                          v1::PushPullRequest* header) const {
  // Kept in the weight region: the shard writes the weights there.
  // Otherwise into the stream's region; one from before the model was
  // declared again may not fit.
  const uint64_t in_stream = model_.plan->weights_at[c.id];
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    header->set_reply_in_weight_region(true);
    header->set_reply_shm_offset(*at);
  } else if (regions.stream != nullptr && !push_only_ &&
             model_.options->compression.weights != v1::ENCODING_TOPK &&
             regions.stream->Contains(in_stream, c.bytes())) {
    header->set_reply_shm_offset(in_stream);
  }
}

// The request of chunk `id` and, with a stream region, its gradient named
// where it lies in the gradient region or else copied into the stream's
// region, and its reply asked into a region (PlaceReply). True when the
// message needs no payload.
bool OpenStep::HeaderFor(uint32_t id, bool last, v1::PushPullRequest* header,
                         const CallRegions& regions) {
  const ChunkSpec& c = (*model_.chunks)[id];
  const ClientOptions& options = *model_.options;
  header->Clear();
  header->set_rank(options.rank);
  header->set_incarnation(options.incarnation);
  header->set_rollback_id(*model_.rollback_id);
  header->set_step(step_);
  header->set_chunk_id(id);
  // A first phase's last push is not the lane's last of the step: its
  // decision follows.
  header->set_last_of_step(last && (phase_ == 2 || !options_.second_phase));
  if (phase_ == 2) {
    // The decision alone: the gradient is in, its settings stand.
    header->set_push_only(push_only_);
    header->set_reply_encoding(options.compression.weights);
    header->mutable_decision()->set_clip_coefficient(
        decision_->clip_coefficient);
    header->mutable_decision()->set_skip(decision_->skip);
    // The shard then answers a decision it keeps them for without weights.
    header->set_speculative_weights(speculated_[id]);
    PlaceReply(c, regions, header);
    return true;
  }
  header->set_second_phase(options_.second_phase);
  // Over the network only: through shared memory the weights cost no link
  // time, and the shard's copy only CPU.
  header->set_speculative_weights(speculate_ && regions.stream == nullptr);
  if (options_.loss_scale.has_value()) {
    header->set_loss_scale(*options_.loss_scale);
  }
  header->set_encoding(Compressed(id) ? model_.compressor->encoding()
                                      : v1::ENCODING_FP32);
  header->set_push_only(push_only_);
  // Set on push-only steps too: a stream's pushes all ask for the same.
  header->set_reply_encoding(options.compression.weights);
  SetStepHyperparameters(hyperparameters_[c.tensor], header);
  header->set_no_gradient(no_gradient_[c.tensor]);
  header->set_initial_values(initial_values_);
  PlaceReply(c, regions, header);
  if (no_gradient_[c.tensor]) return true;
  if (regions.stream == nullptr || Compressed(id)) return false;
  return PlaceGradient(regions, gradients_[c.tensor].data() + c.offset,
                       c.bytes(), model_.plan->gradient_at[id], header);
}

absl::StatusOr<grpc::ByteBuffer> OpenStep::MessageFor(
    Lane* lane, uint32_t id, bool last, v1::PushPullRequest* header,
    const CallRegions& regions) {
  const ChunkSpec& c = (*model_.chunks)[id];
  if (HeaderFor(id, last, header, regions)) {
    return lane->Message(*header, nullptr, 0);
  }
  const float* gradient = gradients_[c.tensor].data() + c.offset;
  if (!Compressed(id)) return lane->Message(*header, gradient, c.bytes());
  absl::string_view& payload = payloads_[id];
  if (payload.data() == nullptr) {
    // Encoded here, on the lane's thread, as the lane gets to it: lanes
    // encode in parallel, and while earlier chunks are on the wire.
    absl::StatusOr<absl::string_view> encoded =
        model_.compressor->Encode(id, gradient, step_);
    if (!encoded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of tensor ", model_.layout->tensors(c.tensor).name(),
          " (chunk ", id, ", tensor elements from ", c.offset,
          "): ", encoded.status().message()));
    }
    payload = *encoded;
  }
  return lane->Message(*header, payload.data(), payload.size());
}

absl::Status OpenStep::TakeReply(Lane* lane, std::vector<bool>* expected,
                                 const CallRegions& regions) {
  const uint32_t id = lane->reply.response.chunk_id();
  if (id >= model_.chunks->size() || model_.plan->lane_of[id] != lane->index ||
      !(*expected)[id]) {
    return absl::InternalError(
        absl::StrCat("bad reply: server sent chunk ", id,
                     " which was not pushed or was answered already"));
  }
  (*expected)[id] = false;
  const v1::PushPullResponse& r = lane->reply.response;
  // Acknowledged: what this payload dropped is the chunk's residual now.
  if (Compressed(id) && phase_ == 1) model_.compressor->Commit(id);
  if (options_.second_phase) {
    if (r.has_sum_of_squares()) sum_of_squares_[id] = r.sum_of_squares();
    if (r.has_decision()) {
      applied_ =
          StepDecision{r.decision().clip_coefficient(), r.decision().skip()};
      updated_[id] = true;
      if (r.speculative()) {
        // The shard kept the weights its sealed reply brought.
        if (!speculated_[id]) {
          return absl::InternalError(absl::StrCat(
              "bad reply: chunk ", id, " of two-phase step ", step_,
              " kept speculative weights this worker did not take"));
        }
        return absl::OkStatus();
      }
    } else if (phase_ == 2 || !r.has_sum_of_squares()) {
      return absl::InternalError(
          absl::StrCat("bad reply: chunk ", id, " of two-phase step ", step_,
                       phase_ == 1 ? " came without its sum of squares"
                                   : " came without the decision it applied"));
    } else if (!r.speculative()) {
      return absl::OkStatus();  // sealed: the weights come in phase 2
    } else if (!speculate_) {
      return absl::InternalError(
          absl::StrCat("bad reply: chunk ", id, " of two-phase step ", step_,
                       " came with speculative weights, which were not asked"));
    } else {
      // Sealed, with the weights of the update at clip coefficient 1: read
      // now, overwritten in phase 2 unless the shard keeps them.
      speculated_[id] = true;
    }
  }
  if (push_only_) {
    // The shard moved its copy of what workers hold without telling this
    // one.
    model_.reader->Forget(id);
    return absl::OkStatus();
  }
  const ChunkSpec& c = (*model_.chunks)[id];
  float* out = weights_[c.tensor].data() + c.offset;
  // Where this chunk's push asked for its reply (PlaceReply).
  if (const std::optional<uint64_t> at = ReplyInWeightRegion(c, regions)) {
    return model_.reader->Read(&lane->reply, c, out, regions.weights, *at);
  }
  return model_.reader->Read(&lane->reply, c, out, regions.stream,
                             model_.plan->weights_at[id]);
}

}  // namespace shardps
