#include "server/parameter_store.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/chunking.h"
#include "common/encoding.h"
#include "common/status.h"
#include "server/async_aggregator.h"
#include "server/gradient_decode.h"
#include "server/optimizer_state.h"
#include "server/server_metrics.h"
#include "server/sync_aggregator.h"

namespace shardps::server {

ParameterStore::ParameterStore(StoreOptions options)
    : options_(std::move(options)),
      ranks_(options_.shard_index, options_.num_workers),
      budget_(options_.max_inflight_bytes),
      read_bytes_(static_cast<int64_t>(kMaxAutoChunkBytes)),
      pool_(std::make_unique<ThreadPool>(std::max(1, options_.update_threads))),
      snapshots_(std::make_unique<SnapshotScheduler>(
          SnapshotOptions{options_.shard_index, options_.checkpoint_every,
                          options_.on_checkpoint},
          pool_.get())) {}

ParameterStore::~ParameterStore() {
  pool_.reset();  // runs what is queued while the chunks still exist
}

const ParameterStore::State* ParameterStore::state() const {
  absl::MutexLock lock(&mu_);
  return state_.get();
}

bool ParameterStore::Publish(std::unique_ptr<State> built) {
  absl::MutexLock lock(&mu_);
  if (state_ != nullptr) return false;
  snapshots_->SetNumChunks(built->model->owned.size());
  int64_t largest = 0;
  for (const ChunkSpec& c : built->model->all_chunks) {
    largest = std::max(largest, c.bytes());
  }
  read_bytes_.store(largest);
  state_ = std::move(built);
  return true;
}

namespace {

// The policy of `options.mode` for `chunks` (indexed by chunk id; null where
// another shard owns the chunk). The chunks, `updater`, `ranks` and `pool`
// (which runs large updates) must outlive the aggregator.
std::unique_ptr<Aggregator> NewAggregator(const AggregatorOptions& options,
                                          std::vector<Chunk*> chunks,
                                          const ChunkUpdater* updater,
                                          const RankTracker* ranks,
                                          ThreadPool* pool) {
  if (options.mode == v1::CONSISTENCY_ASYNC ||
      options.mode == v1::CONSISTENCY_SSP) {
    return std::make_unique<AsyncAggregator>(options, std::move(chunks),
                                             updater, ranks);
  }
  return std::make_unique<SyncAggregator>(options, std::move(chunks), updater,
                                          ranks, pool);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterStore::State>>
ParameterStore::BuildState(const v1::DeclareRequest& req) {
  if (req.layout().sparse_weights_ratio() > 0 &&
      options_.mode != v1::CONSISTENCY_SYNC) {
    // Every worker must hold the same copy, which only sync steps give.
    return absl::InvalidArgumentError(
        absl::StrCat("sparse weights (sparse_weights_ratio ",
                     req.layout().sparse_weights_ratio(),
                     ") need sync mode; this shard "
                     "runs ",
                     ConsistencyName(options_.mode, options_.staleness)));
  }
  auto state = std::make_unique<State>();
  SHARDPS_ASSIGN_OR_RETURN(
      state->model,
      BuildShardModel(req, options_.shard_index, options_.num_shards));
  state->updater = std::make_unique<ChunkUpdater>(&counters_, options_.metrics,
                                                  snapshots_.get());
  AggregatorOptions ao;
  ao.mode = options_.mode;
  ao.staleness = options_.staleness;
  ao.allow_nonfinite = options_.allow_nonfinite;
  ao.inline_updates = options_.update_threads == 0;
  ao.metrics = options_.metrics;
  ao.budget = options_.max_inflight_bytes > 0 ? &budget_ : nullptr;
  state->aggregator = NewAggregator(ao, state->model->ChunksById(),
                                    state->updater.get(), &ranks_, pool_.get());
  return state;
}

absl::StatusOr<v1::DeclareResponse> ParameterStore::Declare(
    const v1::DeclareRequest& req) {
  if (req.num_shards() != options_.num_shards ||
      req.shard_index() != options_.shard_index) {
    return absl::FailedPreconditionError(
        absl::StrCat("declaration is for shard ", req.shard_index(), " of ",
                     req.num_shards(), ", but this server is shard ",
                     options_.shard_index, " of ", options_.num_shards));
  }
  if (req.rank() >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", req.rank(), " is out of range: the job has ",
                     options_.num_workers, " workers"));
  }
  if (req.join() && req.join_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("join step ", req.join_step(), " is negative"));
  }
  SHARDPS_RETURN_IF_ERROR(
      ranks_.CheckIncarnation(req.rank(), req.incarnation()));
  // One declaration is built at a time: concurrent first Declares from every
  // worker must not each allocate a whole shard.
  absl::MutexLock declare_lock(&declare_mu_);
  const State* existing = state();
  bool created = false;
  if (existing == nullptr) {
    // Built outside mu_: initialising a large shard takes a while.
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<State> built, BuildState(req));
    created = Publish(std::move(built));
    existing = state();
  }
  const ShardModel& model = *existing->model;
  if (!created) {
    SHARDPS_RETURN_IF_ERROR(ValidateLayout(req.layout()));
    const uint64_t fp = Fingerprint(req.layout(), req.optimizer());
    if (fp != model.fingerprint) {
      // The likeliest cause named: workers that chose chunks differently.
      const uint64_t held = ChunkBytes(model.declaration.layout());
      const uint64_t asked = ChunkBytes(req.layout());
      const std::string chunks =
          held == asked
              ? ""
              : absl::StrCat(
                    "; its chunks are of at most ", held,
                    " bytes, this declaration's of ", asked,
                    " (automatic chunks depend on the workers' --link_rate "
                    "and on whether their --compression and "
                    "--weight_encoding take 2 bytes an element: every worker "
                    "of a job must give the same, or the same --chunk_kib)");
      return absl::FailedPreconditionError(absl::StrCat(
          "this shard was declared with a different layout or optimizer "
          "(fingerprint ",
          absl::Hex(model.fingerprint), ", request ", absl::Hex(fp), ")",
          chunks));
    }
  }
  if (req.join()) SHARDPS_RETURN_IF_ERROR(Join(*existing, req));
  v1::DeclareResponse resp;
  resp.set_fingerprint(model.fingerprint);
  resp.set_created(created);
  int64_t min_version = -1;
  int64_t max_version = 0;
  for (Chunk* chunk : model.owned) {
    resp.add_chunk_ids(chunk->spec.id);
    absl::MutexLock lock(&chunk->mu);
    if (min_version < 0 || chunk->version < min_version) {
      min_version = chunk->version;
    }
    max_version = std::max(max_version, chunk->version);
  }
  resp.set_version(std::max<int64_t>(min_version, 0));
  resp.set_max_version(max_version);
  resp.set_next_step(existing->aggregator->NextStep(req.rank()));
  resp.set_consistency(options_.mode);
  resp.set_staleness(options_.staleness);
  resp.set_rollback_id(rollback_id_.load());
  resp.set_awaiting_values(model.num_awaiting.load() > 0);
  for (uint32_t r : ranks_.ActiveRanks(resp.version()))
    resp.add_active_ranks(r);
  const RankTracker::Standing standing = ranks_.standing(req.rank());
  resp.set_must_join(standing.must_join);
  if (standing.active) resp.set_join_step(standing.from_step);
  return resp;
}

absl::Status ParameterStore::Join(const State& state,
                                  const v1::DeclareRequest& req) {
  SHARDPS_ASSIGN_OR_RETURN(
      const RankTracker::JoinToken token,
      ranks_.BeginJoin(req.rank(), req.incarnation(), req.join_step()));
  // Waited for from now on: a step already decided without the rank at or
  // after the join step makes the join too late.
  const int64_t past =
      state.aggregator->PrepareJoin(req.rank(), req.join_step());
  if (past >= 0) ranks_.UndoJoin(token);
  // A step that waited for the rank at an earlier join step may be complete
  // without it now.
  state.aggregator->MembershipChanged();
  if (past < 0) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat(
      "shard ", options_.shard_index, " is at step ", past, ", past join step ",
      req.join_step(), ": join at a later step"));
}

absl::Status ParameterStore::Restore(const v1::DeclareRequest& declaration,
                                     std::vector<ChunkState> chunks) {
  v1::DeclareRequest req = declaration;
  req.set_num_shards(options_.num_shards);
  req.set_shard_index(options_.shard_index);
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<State> built, BuildState(req));
  SHARDPS_RETURN_IF_ERROR(CheckSavedChunks(*built->model, chunks));
  std::vector<std::shared_ptr<ReplySink>> none;  // nobody waits yet
  for (ChunkState& saved : chunks) {
    Chunk* chunk = built->model->chunks[saved.chunk_id].get();
    absl::MutexLock lock(&chunk->mu);
    *chunk->weights = std::move(saved.weights);
    chunk->slots = std::move(saved.slots);
    chunk->version = saved.version;
    chunk->skipped_updates = saved.skipped_updates;
    ResetWorkerCopy(chunk);
    // The checkpoint holds the values a worker provided.
    built->model->StopAwaiting(chunk);
    // Async and ssp clocks restart from the checkpoint's step.
    built->aggregator->Reset(chunk, &none);
  }
  if (!Publish(std::move(built))) {
    return absl::FailedPreconditionError(
        "this shard is already declared; restore before any Declare");
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::ResetTo(std::vector<ChunkState> chunks,
                                     const absl::Status& why,
                                     uint64_t rollback_id) {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard: nothing to reset");
  }
  SHARDPS_RETURN_IF_ERROR(CheckSavedChunks(*st->model, chunks));
  std::vector<std::shared_ptr<ReplySink>> failed;
  // Every chunk at once (ascending ids; nobody else holds two chunk locks),
  // so no push, update or snapshot sees some chunks reset and others not.
  std::vector<std::unique_ptr<absl::MutexLock>> locks;
  for (Chunk* chunk : st->model->owned) {
    locks.push_back(std::make_unique<absl::MutexLock>(&chunk->mu));
  }
  snapshots_->Reset(chunks.empty() ? 0 : chunks.front().version);
  for (ChunkState& saved : chunks) {
    Chunk* chunk = st->model->chunks[saved.chunk_id].get();
    chunk->mu.AssertHeld();
    // A new buffer: replies being sent may still hold the old one.
    chunk->weights =
        std::make_shared<std::vector<float>>(std::move(saved.weights));
    chunk->slots = std::move(saved.slots);
    chunk->version = saved.version;
    chunk->skipped_updates = saved.skipped_updates;
    ResetWorkerCopy(chunk);
    st->model->StopAwaiting(chunk);
    st->aggregator->Reset(chunk, &failed);
  }
  rollback_id_.store(rollback_id);
  locks.clear();
  for (const auto& sink : failed) sink->Fail(why);
  budget_.RunAdmitted();
  return absl::OkStatus();
}

absl::Status ParameterStore::CheckPush(const PushArgs& args,
                                       const Chunk& chunk) const {
  if (args.rank >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", args.rank, " is out of range: the job has ",
                     options_.num_workers, " workers"));
  }
  // Built only for a refusal: this runs for every push.
  const auto what = [&] {
    return absl::StrCat("rank ", args.rank, "'s push of chunk ", chunk.spec.id,
                        " (", chunk.tensor_name, ")");
  };
  if (args.initial_values) {
    if (args.no_gradient || args.second_phase || args.loss_scale.has_value() ||
        args.decision.has_value() || args.speculative_weights) {
      return absl::InvalidArgumentError(
          what() + " sets initial_values with " +
          (args.no_gradient ? "no_gradient" : "a two-phase step's fields"));
    }
    // Any step: the values do not belong to one. Exact weights only.
    return WithPrefix(what() + " (initial values)",
                      CheckGradientPayload(args.encoding, args.payload->size(),
                                           chunk.spec.num_elements,
                                           EncodingBit(v1::ENCODING_FP32)));
  }
  if (args.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", args.step, " is negative"));
  }
  const absl::Status hyperparameters =
      chunk.optimizer->CheckStepHyperparameters(args.hyperparameters);
  if (!hyperparameters.ok()) return WithPrefix(what(), hyperparameters);
  if (args.loss_scale.has_value() &&
      (!args.second_phase || !std::isfinite(*args.loss_scale) ||
       *args.loss_scale <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what(), " has loss scale ", *args.loss_scale,
        args.second_phase ? ": it must be finite and > 0"
                          : " without second_phase (a loss-scaled step is a "
                            "two-phase step)"));
  }
  if (args.speculative_weights) {
    if (chunk.sparse_ratio > 0) {
      return absl::InvalidArgumentError(
          what() +
          " asks for speculative weights, but the chunk's weights are sparse "
          "(Layout.sparse_weights_ratio): its replies depend on what the "
          "worker holds");
    }
    if (!args.decision.has_value() && (!args.second_phase || args.push_only)) {
      return absl::InvalidArgumentError(
          what() + " asks for speculative weights " +
          (args.push_only ? "with push_only (it takes no weights)"
                          : "without second_phase (only a two-phase step's "
                            "update waits for a decision)"));
    }
  }
  if (args.decision.has_value()) {
    const float c = args.decision->clip_coefficient;
    if (!std::isfinite(c) || c <= 0 || c > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " decides clip coefficient ", c,
                       ": it must be finite and in (0, 1]"));
    }
    if (args.payload->size() != 0 || args.no_gradient) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " carries a step decision and a ",
                       args.no_gradient ? "no_gradient flag" : "payload",
                       ": a decision carries nothing else"));
    }
    return absl::OkStatus();
  }
  if (args.no_gradient) {
    if (args.payload->size() == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " has no_gradient but a payload of ",
                     args.payload->size(), " bytes (it must be empty)"));
  }
  return WithPrefix(what(),
                    CheckGradientPayload(args.encoding, args.payload->size(),
                                         chunk.spec.num_elements,
                                         options_.accepted_encodings));
}

absl::Status ParameterStore::Push(const PushArgs& args,
                                  std::shared_ptr<ReplySink> sink) {
  const uint64_t bytes = args.payload->size();
  uint64_t fp32_bytes = 0;
  const absl::Status status = Route(args, std::move(sink), &fp32_bytes);
  // A two-phase step's decision is not a push: it carries no gradient.
  if (status.ok() && args.decision.has_value()) return status;
  if (status.ok()) {
    counters_.pushes.fetch_add(1, std::memory_order_relaxed);
    counters_.bytes_in.fetch_add(bytes, std::memory_order_relaxed);
    counters_.bytes_in_fp32.fetch_add(fp32_bytes, std::memory_order_relaxed);
    if (options_.metrics != nullptr) {
      options_.metrics->Pushed(bytes, fp32_bytes);
    }
  } else {
    counters_.rejected.fetch_add(1, std::memory_order_relaxed);
  }
  return status;
}

absl::Status ParameterStore::Route(const PushArgs& args,
                                   std::shared_ptr<ReplySink> sink,
                                   uint64_t* fp32_bytes) {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: call Declare first");
  }
  SHARDPS_ASSIGN_OR_RETURN(Chunk * chunk, st->model->Find(args.chunk_id));
  SHARDPS_RETURN_IF_ERROR(CheckPush(args, *chunk));
  if (!args.no_gradient && !args.decision.has_value()) {
    *fp32_bytes = chunk->spec.bytes();
  }
  if (args.initial_values) {
    // No rollback or step check: the values are the same whenever they
    // come, and only the first ones count.
    SHARDPS_RETURN_IF_ERROR(
        ranks_.CheckIncarnation(args.rank, args.incarnation));
    return SetInitialValues(*st, args, chunk, std::move(sink));
  }
  if (args.rollback_id < rollback_id_.load()) {
    return absl::AbortedError(absl::StrCat(
        "push of step ", args.step, " from rank ", args.rank,
        " predates rollback ", rollback_id_.load(),
        " (the job went back to a checkpoint): redo the steps from there"));
  }
  SHARDPS_RETURN_IF_ERROR(
      ranks_.CheckPush(args.rank, args.incarnation, args.step));
  // A chunk stops awaiting but never starts again, so a chunk seen ready
  // here stays ready; with none awaiting, no lock is taken.
  if (st->model->num_awaiting.load(std::memory_order_acquire) > 0) {
    absl::MutexLock lock(&chunk->mu);
    SHARDPS_RETURN_IF_ERROR(CheckNotAwaiting(*chunk));
  }
  return st->aggregator->Push(args, chunk, std::move(sink));
}

absl::Status ParameterStore::SetInitialValues(const State& state,
                                              const PushArgs& args,
                                              Chunk* chunk,
                                              std::shared_ptr<ReplySink> sink) {
  // Decoded and checked outside the chunk's lock, into a buffer of its own:
  // on success it becomes the chunk's weights as it is.
  auto values = std::make_shared<std::vector<float>>(chunk->spec.num_elements);
  SHARDPS_RETURN_IF_ERROR(
      DecodeGradient(args.encoding, *args.payload,
                     {args.rank, &chunk->spec, chunk->tensor_name},
                     /*allow_nonfinite=*/true, values->data()));
  // Non-finite weights are refused even with --allow_nonfinite, which is
  // about gradients.
  const int64_t bad = FirstNonFinite(values->data(), chunk->spec.num_elements);
  if (bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "initial values of chunk ", chunk->spec.id, " (", chunk->tensor_name,
        ") from rank ", args.rank, " have a non-finite value at element ",
        chunk->spec.offset + bad));
  }
  ChunkReply reply;
  {
    absl::MutexLock lock(&chunk->mu);
    if (chunk->awaiting_values) {
      chunk->weights = std::move(values);
      ResetWorkerCopy(chunk);
      state.model->StopAwaiting(chunk);
    }
    // Set now or before (then these values are ignored): either way the
    // pusher gets the weights every worker starts from, whole.
    reply = CurrentReply(*chunk, args.push_only);
    reply.changes.reset();
  }
  state.updater->Deliver(sink.get(), std::move(reply));
  return absl::OkStatus();
}

absl::StatusOr<Chunk*> ParameterStore::DeclaredChunk(uint32_t chunk_id) const {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: call Declare first");
  }
  return st->model->Find(chunk_id);
}

absl::StatusOr<ChunkReply> ParameterStore::Read(uint32_t chunk_id) const {
  SHARDPS_ASSIGN_OR_RETURN(Chunk * chunk, DeclaredChunk(chunk_id));
  absl::MutexLock lock(&chunk->mu);
  SHARDPS_RETURN_IF_ERROR(CheckNotAwaiting(*chunk));
  return CurrentReply(*chunk, /*push_only=*/false);
}

absl::StatusOr<v1::ChunkOptimizerState> ParameterStore::ReadOptimizerState(
    uint32_t chunk_id) const {
  SHARDPS_ASSIGN_OR_RETURN(const Chunk* chunk, DeclaredChunk(chunk_id));
  absl::MutexLock lock(&chunk->mu);
  SHARDPS_RETURN_IF_ERROR(CheckNotAwaiting(*chunk));
  return server::ReadOptimizerState(*chunk);
}

absl::Status ParameterStore::WriteOptimizerState(
    const v1::ChunkOptimizerState& written) {
  SHARDPS_ASSIGN_OR_RETURN(Chunk * chunk, DeclaredChunk(written.chunk_id()));
  absl::MutexLock lock(&chunk->mu);
  SHARDPS_RETURN_IF_ERROR(CheckNotAwaiting(*chunk));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<std::vector<float>> slots,
                           SlotsToWrite(written, *chunk));
  // A checkpoint copy of this step must hold the new state, or the write
  // is refused before anything changed.
  SHARDPS_RETURN_IF_ERROR(snapshots_->Rewrite(
      *chunk, slots, chunk->version - written.optimizer_steps()));
  server::WriteOptimizerState(std::move(slots), written.optimizer_steps(),
                              chunk);
  return absl::OkStatus();
}

absl::Status ParameterStore::CheckReadable(uint32_t chunk_id) const {
  SHARDPS_ASSIGN_OR_RETURN(const Chunk* chunk, DeclaredChunk(chunk_id));
  absl::MutexLock lock(&chunk->mu);
  return CheckNotAwaiting(*chunk);
}

absl::StatusOr<v1::DeclareRequest> ParameterStore::declaration() const {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError("no model is declared on this shard");
  }
  return st->model->declaration;
}

std::vector<uint32_t> ParameterStore::OwnedChunks() const {
  std::vector<uint32_t> ids;
  const State* st = state();
  if (st == nullptr) return ids;
  for (const Chunk* chunk : st->model->owned) ids.push_back(chunk->spec.id);
  return ids;
}

std::pair<uint64_t, uint64_t> ParameterStore::OwnedSize() const {
  const State* st = state();
  if (st == nullptr) return {0, 0};
  return {st->model->owned_bytes, st->model->owned.size()};
}

std::pair<uint64_t, uint64_t> ParameterStore::ModelSize() const {
  const State* st = state();
  if (st == nullptr) return {0, 0};
  uint64_t bytes = 0;
  for (const ChunkSpec& c : st->model->all_chunks) bytes += c.bytes();
  return {bytes, st->model->all_chunks.size()};
}

absl::Status ParameterStore::RequestCheckpoint(int64_t step) {
  SHARDPS_RETURN_IF_ERROR(snapshots_->CheckRequest(step));
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: nothing to checkpoint");
  }
  return snapshots_->Request(step, st->model->owned);
}

std::vector<std::string> ParameterStore::ApplyView(
    const v1::ClusterView& view) {
  bool released = false;
  std::vector<std::string> changes = ranks_.ApplyView(view, &released);
  if (released) {
    if (const State* st = state()) st->aggregator->MembershipChanged();
  }
  return changes;
}

std::vector<StalledChunk> ParameterStore::Stalled(
    absl::Duration timeout) const {
  const State* st = state();
  if (st == nullptr) return {};
  return st->aggregator->Stalled(timeout);
}

v1::GetStatusResponse ParameterStore::Report() const {
  v1::GetStatusResponse resp;
  resp.set_shard_index(options_.shard_index);
  resp.set_num_shards(options_.num_shards);
  resp.set_num_workers(options_.num_workers);
  resp.set_mode(ConsistencyName(options_.mode, options_.staleness));
  resp.set_generation(ranks_.view_generation());
  resp.set_pushes_total(counters_.pushes.load());
  resp.set_updates_total(counters_.updates.load());
  resp.set_rejected_total(counters_.rejected.load());
  resp.set_bytes_in_total(counters_.bytes_in.load());
  resp.set_bytes_out_total(counters_.bytes_out.load());
  resp.set_bytes_in_fp32_total(counters_.bytes_in_fp32.load());
  resp.set_bytes_out_fp32_total(counters_.bytes_out_fp32.load());
  for (std::string& name : EncodingSetNames(options_.accepted_encodings)) {
    resp.add_accepted_encodings(std::move(name));
  }
  resp.set_weight_copies_total(counters_.weight_copies.load());
  resp.set_rollback_id(rollback_id_.load());
  const ReceiveBudget::Usage budget = budget_.usage();
  resp.set_receive_budget_bytes(budget_.limit());
  resp.set_receive_budget_peak_bytes(budget.peak);
  resp.set_receive_budget_waits_total(budget.waited);
  resp.set_speculative_updates_kept_total(counters_.speculations_kept.load());
  resp.set_speculative_updates_recomputed_total(
      counters_.speculations_recomputed.load());
  const State* st = state();
  if (st == nullptr) return resp;
  resp.set_declared(true);
  resp.set_fingerprint(st->model->fingerprint);
  resp.set_owned_bytes(st->model->owned_bytes);
  int64_t lo = -1, hi = -1;
  for (const Chunk* chunk : st->model->owned) {
    absl::MutexLock lock(&chunk->mu);
    if (lo < 0 || chunk->version < lo) lo = chunk->version;
    hi = std::max(hi, chunk->version);
  }
  resp.set_num_chunks(st->model->owned.size());
  resp.set_min_version(std::max<int64_t>(lo, 0));
  resp.set_max_version(std::max<int64_t>(hi, 0));
  for (uint32_t r : ranks_.ActiveRanks(resp.min_version())) {
    resp.add_active_ranks(r);
  }
  return resp;
}

}  // namespace shardps::server
