#include "server/parameter_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/tensor_init.h"
#include "server/server_metrics.h"

namespace shardps::server {
namespace {

// Sync updates of chunks up to this size run on the thread that completed
// the step; larger ones go to the update pool, in parallel across chunks.
constexpr int64_t kInlineApplyBytes = 256 << 10;

}  // namespace

v1::Consistency ConsistencyOf(Mode mode) {
  switch (mode) {
    case Mode::kSync:
      return v1::CONSISTENCY_SYNC;
    case Mode::kAsync:
      return v1::CONSISTENCY_ASYNC;
    case Mode::kSsp:
      return v1::CONSISTENCY_SSP;
  }
  return v1::CONSISTENCY_UNSPECIFIED;
}

ParameterStore::ParameterStore(StoreOptions options)
    : options_(options),
      pool_(std::make_unique<ThreadPool>(std::max(1, options.update_threads))) {
  absl::MutexLock lock(&members_mu_);
  ranks_.resize(options_.num_workers);
}

ParameterStore::~ParameterStore() {
  pool_.reset();  // runs what is queued while the chunks still exist
}

const ParameterStore::State* ParameterStore::state() const {
  absl::MutexLock lock(&mu_);
  return state_.get();
}

absl::StatusOr<std::unique_ptr<ParameterStore::State>>
ParameterStore::BuildState(const v1::DeclareRequest& req) const {
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(req.layout()));
  auto state = std::make_unique<State>();
  SHARDPS_ASSIGN_OR_RETURN(state->optimizer,
                           Optimizer::Create(req.optimizer()));
  state->declaration = req;
  state->fingerprint = Fingerprint(req.layout(), req.optimizer());
  state->all_chunks = MakeChunks(req.layout());
  state->shard_of = PartitionChunks(state->all_chunks, options_.num_shards);
  state->owned.resize(state->all_chunks.size());
  const uint32_t n_workers = options_.num_workers;
  for (size_t i = 0; i < state->all_chunks.size(); ++i) {
    if (state->shard_of[i] != options_.shard_index) continue;
    const ChunkSpec& spec = state->all_chunks[i];
    auto chunk = std::make_unique<Chunk>();
    chunk->spec = spec;
    absl::MutexLock lock(&chunk->mu);
    chunk->weights = std::make_shared<std::vector<float>>(spec.num_elements);
    FillInit(req.layout().tensors(spec.tensor).init(), spec.tensor, spec.offset,
             chunk->weights->data(), spec.num_elements);
    chunk->slots.assign(state->optimizer->num_slots(),
                        std::vector<float>(spec.num_elements));
    std::vector<float*> slot_ptrs;
    for (auto& s : chunk->slots) slot_ptrs.push_back(s.data());
    state->optimizer->InitSlots(slot_ptrs, spec.num_elements);
    chunk->contributions.assign(n_workers,
                                std::vector<float>(spec.num_elements));
    chunk->contributed.assign(n_workers, false);
    chunk->last_step.assign(n_workers, -1);
    state->owned_bytes += spec.bytes();
    ++state->num_owned;
    state->owned[i] = std::move(chunk);
  }
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
  // One declaration is built at a time: concurrent first Declares from every
  // worker must not each allocate a whole shard.
  if (req.rank() >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", req.rank(), " is out of range: the job has ",
                     options_.num_workers, " workers"));
  }
  if (req.join() && req.join_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("join step ", req.join_step(), " is negative"));
  }
  {
    absl::MutexLock lock(&members_mu_);
    SHARDPS_RETURN_IF_ERROR(CheckIncarnation(req.rank(), req.incarnation()));
  }
  absl::MutexLock declare_lock(&declare_mu_);
  const State* existing = state();
  bool created = false;
  if (existing == nullptr) {
    // Built outside the lock: initialising a large shard takes a while.
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<State> built, BuildState(req));
    absl::MutexLock lock(&mu_);
    if (state_ == nullptr) {
      state_ = std::move(built);
      created = true;
    }
    existing = state_.get();
  }
  if (!created) {
    SHARDPS_RETURN_IF_ERROR(ValidateLayout(req.layout()));
    const uint64_t fp = Fingerprint(req.layout(), req.optimizer());
    if (fp != existing->fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this shard was declared with a different layout or optimizer "
          "(fingerprint ",
          absl::Hex(existing->fingerprint), ", request ", absl::Hex(fp), ")"));
    }
  }
  if (req.join()) SHARDPS_RETURN_IF_ERROR(Join(*existing, req));
  v1::DeclareResponse resp;
  resp.set_fingerprint(existing->fingerprint);
  resp.set_created(created);
  int64_t min_version = -1;
  int64_t max_version = 0;
  for (const auto& chunk : existing->owned) {
    if (chunk == nullptr) continue;
    resp.add_chunk_ids(chunk->spec.id);
    absl::MutexLock lock(&chunk->mu);
    if (min_version < 0 || chunk->version < min_version) {
      min_version = chunk->version;
    }
    max_version = std::max(max_version, chunk->version);
  }
  resp.set_version(std::max<int64_t>(min_version, 0));
  resp.set_max_version(max_version);
  resp.set_next_step(NextStep(*existing, req.rank()));
  resp.set_consistency(ConsistencyOf(options_.mode));
  resp.set_staleness(options_.staleness);
  resp.set_rollback_id(rollback_id_.load());
  absl::MutexLock lock(&members_mu_);
  for (uint32_t r : ActiveRanks(resp.version())) resp.add_active_ranks(r);
  const RankState& rank = ranks_[req.rank()];
  resp.set_must_join(rank.kind == RankState::Kind::kPending);
  if (rank.kind == RankState::Kind::kActive) {
    resp.set_join_step(rank.from_step);
  }
  return resp;
}

std::vector<uint32_t> ParameterStore::ActiveRanks(int64_t step) const {
  std::vector<uint32_t> ranks;
  for (uint32_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].kind == RankState::Kind::kActive &&
        ranks_[r].from_step <= step) {
      ranks.push_back(r);
    }
  }
  return ranks;
}

int64_t ParameterStore::NextStep(const State& state, uint32_t rank) const {
  // Sync: the step every chunk is at. Async and ssp count steps per rank.
  int64_t next = -1;
  for (const auto& chunk : state.owned) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    const int64_t n =
        options_.mode == Mode::kSync
            ? chunk->version
            : (rank < chunk->last_step.size() ? chunk->last_step[rank] + 1 : 0);
    if (next < 0 || n < next) next = n;
  }
  return std::max<int64_t>(next, 0);
}

absl::Status ParameterStore::CheckSavedChunks(
    const State& state, const std::vector<ChunkState>& chunks) const {
  if (chunks.size() != state.num_owned) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint holds ", chunks.size(), " chunks for shard ",
                     options_.shard_index, ", which owns ", state.num_owned));
  }
  std::vector<bool> seen(state.owned.size(), false);
  for (const ChunkState& saved : chunks) {
    const Chunk* chunk = saved.chunk_id < state.owned.size()
                             ? state.owned[saved.chunk_id].get()
                             : nullptr;
    if (chunk != nullptr && seen[saved.chunk_id]) chunk = nullptr;
    if (chunk != nullptr) seen[saved.chunk_id] = true;
    if (saved.version < 0 || saved.version != chunks.front().version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint chunk ", saved.chunk_id, " is at step ", saved.version,
          ", not at the checkpoint's step ", chunks.front().version));
    }
    if (chunk == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint chunk ", saved.chunk_id,
                       " is not owned by shard ", options_.shard_index));
    }
    bool sizes_ok =
        saved.weights.size() == static_cast<size_t>(chunk->spec.num_elements) &&
        saved.slots.size() == static_cast<size_t>(state.optimizer->num_slots());
    for (const std::vector<float>& slot : saved.slots) {
      sizes_ok = sizes_ok && slot.size() == saved.weights.size();
    }
    if (!sizes_ok) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint chunk ", saved.chunk_id,
                       " has another size or "
                       "optimizer state than the declaration"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::Restore(const v1::DeclareRequest& declaration,
                                     std::vector<ChunkState> chunks) {
  v1::DeclareRequest req = declaration;
  req.set_num_shards(options_.num_shards);
  req.set_shard_index(options_.shard_index);
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<State> built, BuildState(req));
  SHARDPS_RETURN_IF_ERROR(CheckSavedChunks(*built, chunks));
  for (ChunkState& saved : chunks) {
    Chunk* chunk = built->owned[saved.chunk_id].get();
    absl::MutexLock lock(&chunk->mu);
    *chunk->weights = std::move(saved.weights);
    chunk->slots = std::move(saved.slots);
    chunk->version = saved.version;
    // Async and ssp clocks restart from the checkpoint's step.
    chunk->last_step.assign(options_.num_workers, saved.version - 1);
  }
  absl::MutexLock lock(&mu_);
  if (state_ != nullptr) {
    return absl::FailedPreconditionError(
        "this shard is already declared; restore before any Declare");
  }
  state_ = std::move(built);
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
  SHARDPS_RETURN_IF_ERROR(CheckSavedChunks(*st, chunks));
  std::vector<std::shared_ptr<ReplySink>> failed;
  // Every chunk at once (ascending ids; nobody else holds two chunk locks),
  // so no push, update or snapshot sees some chunks reset and others not.
  std::vector<std::unique_ptr<absl::MutexLock>> locks;
  std::vector<int64_t> requested;  // checkpoints asked for beyond the reset
  for (const auto& chunk : st->owned) {
    if (chunk == nullptr) continue;
    locks.push_back(std::make_unique<absl::MutexLock>(&chunk->mu));
    chunk->mu.AssertHeld();
    for (int64_t step : chunk->requested_steps) requested.push_back(step);
    for (const ChunkState& copy : chunk->snapshots) {
      requested.push_back(copy.version);  // passed, not yet handed over
    }
  }
  reset_epoch_.fetch_add(1);
  {
    absl::MutexLock lock(&snapshot_mu_);
    for (const auto& [version, count] : snapshot_counts_) {
      requested.push_back(version);
    }
    snapshot_counts_.clear();
  }
  const int64_t reset_step = chunks.empty() ? 0 : chunks.front().version;
  std::sort(requested.begin(), requested.end());
  requested.erase(std::unique(requested.begin(), requested.end()),
                  requested.end());
  requested.erase(std::remove_if(requested.begin(), requested.end(),
                                 [&](int64_t v) { return v <= reset_step; }),
                  requested.end());
  for (ChunkState& saved : chunks) {
    Chunk* chunk = st->owned[saved.chunk_id].get();
    chunk->mu.AssertHeld();
    chunk->requested_steps = requested;
    // A new buffer: replies being sent may still hold the old one.
    chunk->weights =
        std::make_shared<std::vector<float>>(std::move(saved.weights));
    chunk->slots = std::move(saved.slots);
    chunk->version = saved.version;
    chunk->last_step.assign(options_.num_workers, saved.version - 1);
    chunk->contributed.assign(options_.num_workers, false);
    chunk->num_contributed = 0;
    chunk->apply_scheduled = false;
    chunk->snapshots.clear();
    for (Waiter& w : chunk->waiters) failed.push_back(std::move(w.sink));
    for (Waiter& w : chunk->held) failed.push_back(std::move(w.sink));
    chunk->waiters.clear();
    chunk->held.clear();
  }
  rollback_id_.store(rollback_id);
  locks.clear();
  for (const auto& sink : failed) sink->Fail(why);
  return absl::OkStatus();
}

absl::StatusOr<ParameterStore::Chunk*> ParameterStore::FindChunk(
    const State& state, uint32_t chunk_id) const {
  if (chunk_id >= state.all_chunks.size()) {
    return absl::NotFoundError(
        absl::StrCat("chunk ", chunk_id, " is not declared (the layout has ",
                     state.all_chunks.size(), " chunks)"));
  }
  Chunk* chunk = state.owned[chunk_id].get();
  if (chunk == nullptr) {
    const ChunkSpec& spec = state.all_chunks[chunk_id];
    return absl::NotFoundError(
        absl::StrCat("chunk ", chunk_id, " (",
                     state.declaration.layout().tensors(spec.tensor).name(),
                     ") belongs to shard ", state.shard_of[chunk_id], ", not ",
                     options_.shard_index));
  }
  return chunk;
}

absl::Status ParameterStore::CheckPush(const PushArgs& args,
                                       const Chunk& chunk) const {
  if (args.rank >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", args.rank, " is out of range: the job has ",
                     options_.num_workers, " workers"));
  }
  if (args.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", args.step, " is negative"));
  }
  return CheckPayload(args.encoding, args.payload->size(),
                      chunk.spec.num_elements);
}

absl::Status ParameterStore::TakeGradient(const State& state,
                                          const PushArgs& args, Chunk* chunk) {
  std::vector<float>& buf = chunk->contributions[args.rank];
  if (options_.allow_nonfinite) {
    args.payload->CopyTo(reinterpret_cast<char*>(buf.data()));
    return absl::OkStatus();
  }
  // Checked piece by piece as it is copied, while the piece is in cache.
  int64_t checked = 0;
  int64_t bad = -1;
  args.payload->CopyTo(
      reinterpret_cast<char*>(buf.data()), [&](uint64_t bytes) {
        const int64_t complete = bytes / 4;
        if (bad < 0 && complete > checked) {
          const int64_t at =
              FirstNonFinite(buf.data() + checked, complete - checked);
          if (at >= 0) bad = checked + at;
          checked = complete;
        }
      });
  if (bad < 0) return absl::OkStatus();
  // The buffer is scratch until the rank is marked as contributed, so a
  // rejected push leaves no trace.
  const ChunkSpec& spec = chunk->spec;
  return absl::InvalidArgumentError(absl::StrCat(
      "gradient of chunk ", spec.id, " (",
      state.declaration.layout().tensors(spec.tensor).name(), ") from rank ",
      args.rank, " has a non-finite value at element ", spec.offset + bad,
      " (start servers with --allow_nonfinite to accept)"));
}

absl::Status ParameterStore::Push(const PushArgs& args,
                                  std::shared_ptr<ReplySink> sink) {
  const State* st = state();
  absl::Status status;
  if (st == nullptr) {
    status = absl::FailedPreconditionError(
        "no model is declared on this shard yet: call Declare first");
  } else {
    absl::StatusOr<Chunk*> chunk = FindChunk(*st, args.chunk_id);
    status = chunk.status();
    if (status.ok()) status = CheckPush(args, **chunk);
    if (status.ok() && args.rollback_id < rollback_id_.load()) {
      status = absl::AbortedError(absl::StrCat(
          "push of step ", args.step, " from rank ", args.rank,
          " predates rollback ", rollback_id_.load(),
          " (the job went back to a checkpoint): redo the steps from there"));
    }
    if (status.ok()) {
      absl::MutexLock lock(&members_mu_);
      status = CheckMember(args.rank, args.incarnation, args.step);
    }
    if (status.ok()) {
      const uint64_t bytes = args.payload->size();
      status = options_.mode == Mode::kSync
                   ? PushSync(*st, args, *chunk, std::move(sink))
                   : PushAsync(*st, args, *chunk, std::move(sink));
      if (status.ok()) {
        pushes_.fetch_add(1, std::memory_order_relaxed);
        bytes_in_.fetch_add(bytes, std::memory_order_relaxed);
      }
    }
  }
  if (!status.ok()) rejected_.fetch_add(1, std::memory_order_relaxed);
  return status;
}

absl::Status ParameterStore::PushSync(const State& state, const PushArgs& args,
                                      Chunk* chunk,
                                      std::shared_ptr<ReplySink> sink) {
  bool ready = false;
  {
    absl::ReleasableMutexLock lock(&chunk->mu);
    if (args.step == chunk->version - 1) {
      // The reply to this push was lost: its gradient is already in the
      // weights. Answer with them and apply nothing.
      ChunkReply reply;
      reply.chunk_id = chunk->spec.id;
      reply.version = chunk->version;
      if (!args.push_only) reply.weights = chunk->weights;
      lock.Release();
      Deliver(sink.get(), std::move(reply));
      return absl::OkStatus();
    }
    if (args.step != chunk->version) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", args.step, " of chunk ", chunk->spec.id, " is in the ",
          args.step < chunk->version ? "past" : "future",
          ": the chunk is at step ", chunk->version));
    }
    if (!chunk->contributed[args.rank]) {
      SHARDPS_RETURN_IF_ERROR(TakeGradient(state, args, chunk));
      chunk->contributed[args.rank] = true;
      if (chunk->num_contributed == 0) chunk->first_contribution = absl::Now();
      ++chunk->num_contributed;
      ready = !chunk->apply_scheduled && StepComplete(*chunk);
      if (ready) chunk->apply_scheduled = true;
    }
    // A duplicate of a pending push (a retry while the step is still open)
    // only adds a waiter.
    chunk->waiters.push_back({args.rank, args.push_only, std::move(sink)});
  }
  if (ready) ScheduleApply(state, chunk);
  return absl::OkStatus();
}

void ParameterStore::ScheduleApply(const State& state, Chunk* chunk) {
  if (chunk->spec.bytes() <= kInlineApplyBytes) {
    // A small chunk: updating it here costs less than a thread hop.
    ApplySync(*state.optimizer, chunk);
  } else {
    const Optimizer* optimizer = state.optimizer.get();
    pool_->Schedule([this, optimizer, chunk] { ApplySync(*optimizer, chunk); });
  }
}

bool ParameterStore::WaitsFor(uint32_t rank, int64_t step) const {
  absl::MutexLock lock(&members_mu_);
  const RankState& r = ranks_[rank];
  return r.kind == RankState::Kind::kActive && step >= r.from_step;
}

bool ParameterStore::StepComplete(const Chunk& chunk) const {
  if (chunk.num_contributed == 0) return false;
  absl::MutexLock lock(&members_mu_);
  for (uint32_t r = 0; r < options_.num_workers; ++r) {
    const RankState& rank = ranks_[r];
    if (!chunk.contributed[r] && rank.kind == RankState::Kind::kActive &&
        chunk.version >= rank.from_step) {
      return false;
    }
  }
  return true;
}

absl::Status ParameterStore::CheckIncarnation(uint32_t rank,
                                              uint64_t incarnation) const {
  const RankState& r = ranks_[rank];
  if (!coordinated_ || !r.seen) return absl::OkStatus();
  if (incarnation > r.incarnation) {
    return absl::UnavailableError(absl::StrCat(
        "shard ", options_.shard_index,
        " has not yet seen the coordinator's view in which this worker "
        "process (rank ",
        rank, ", incarnation ", incarnation, ") joined; retry"));
  }
  if (incarnation < r.incarnation) {
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " is held by a newer worker process (incarnation ",
        r.incarnation, ") since generation ", r.changed_generation,
        "; this request comes from incarnation ", incarnation,
        ", which is no longer part of the job: join it again"));
  }
  if (r.kind == RankState::Kind::kGone) {
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " left the job at generation ", r.changed_generation,
        " (it left or stopped sending heartbeats): join the job again"));
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::CheckMember(uint32_t rank, uint64_t incarnation,
                                         int64_t step) const {
  SHARDPS_RETURN_IF_ERROR(CheckIncarnation(rank, incarnation));
  const RankState& r = ranks_[rank];
  if (r.kind == RankState::Kind::kPending) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank,
        " joined a running job: declare the step it joins at first "
        "(DeclareRequest.join)"));
  }
  if (step < r.from_step) {
    return absl::OutOfRangeError(absl::StrCat("step ", step, " of rank ", rank,
                                              " is before its join step ",
                                              r.from_step));
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::Join(const State& state,
                                  const v1::DeclareRequest& req) {
  const uint32_t rank = req.rank();
  const int64_t join_step = req.join_step();
  RankState before;
  {
    absl::MutexLock lock(&members_mu_);
    if (!coordinated_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", options_.shard_index,
          " follows no coordinator (a static job): a worker cannot join it "
          "while it runs"));
    }
    SHARDPS_RETURN_IF_ERROR(CheckIncarnation(rank, req.incarnation()));
    before = ranks_[rank];
    ranks_[rank].kind = RankState::Kind::kActive;
    ranks_[rank].from_step = join_step;
  }
  // Waited for from now on: a chunk that had already completed the join
  // step without the rank makes the join too late.
  int64_t past = -1;
  for (const auto& chunk : state.owned) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (options_.mode == Mode::kSync) {
      // A step whose update is already decided cannot wait for the rank.
      const int64_t decided = chunk->version + (chunk->apply_scheduled ? 1 : 0);
      if (decided > join_step) past = std::max(past, decided);
    } else {
      chunk->last_step[rank] = std::max(chunk->last_step[rank], join_step - 1);
    }
  }
  if (past < 0) {
    // A step that waited for the rank at an earlier join step may be
    // complete without it now.
    ReleaseAfterMembershipChange(state);
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&members_mu_);
    // Unless a view changed the rank meanwhile.
    RankState& now = ranks_[rank];
    if (now.kind == RankState::Kind::kActive && now.from_step == join_step &&
        now.incarnation == before.incarnation) {
      now = before;
    }
  }
  ReleaseAfterMembershipChange(state);
  return absl::OutOfRangeError(
      absl::StrCat("shard ", options_.shard_index, " is at step ", past,
                   ", past join step ", join_step, ": join at a later step"));
}

std::vector<std::string> ParameterStore::ApplyView(
    const v1::ClusterView& view) {
  using Kind = RankState::Kind;
  std::vector<std::string> changes;
  bool released = false;
  {
    absl::MutexLock lock(&members_mu_);
    // A restarted coordinator counts generations from 1 again.
    const bool same_coordinator =
        coordinated_ &&
        view.coordinator_incarnation() == coordinator_incarnation_;
    if (same_coordinator && view.generation() <= view_generation_) {
      return changes;
    }
    coordinated_ = true;
    coordinator_incarnation_ = view.coordinator_incarnation();
    view_generation_ = view.generation();
    const uint64_t g = view.generation();
    for (const v1::WorkerSlot& w : view.workers()) {
      if (w.rank() >= ranks_.size()) continue;
      RankState& r = ranks_[w.rank()];
      if (!w.alive()) {
        // Incarnation 0: no worker held the rank since this coordinator
        // started. A rank this shard saw alive under an earlier coordinator
        // that has not come back once the coordinator settled is gone; one
        // it never saw is still to come (a job's first workers). A rank the
        // coordinator saw leave (incarnation set) is gone, also when this
        // shard never saw it (it restarted after).
        if (r.kind == Kind::kGone) continue;
        const bool left = w.incarnation() != 0 || (view.settled() && r.seen);
        if (!left) continue;  // not there yet: the first workers arriving
        released = released || r.kind == Kind::kActive;
        r.kind = Kind::kGone;
        r.changed_generation = g;
        changes.push_back(absl::StrCat(
            "rank ", w.rank(), w.finished() ? " finished" : " left the job",
            " (generation ", g, "): steps no longer wait for it"));
        continue;
      }
      if (!r.seen) {  // the first workers arriving
        r.seen = true;
        r.incarnation = w.incarnation();
        continue;
      }
      if (r.kind != Kind::kGone && w.incarnation() == r.incarnation) continue;
      released = released || r.kind == Kind::kActive;
      r.kind = Kind::kPending;
      r.incarnation = w.incarnation();
      r.changed_generation = g;
      changes.push_back(absl::StrCat(
          "rank ", w.rank(), " is held by a new worker process (incarnation ",
          w.incarnation(), ", generation ", g,
          "): steps wait for it from the join step it declares"));
    }
  }
  if (released) {
    if (const State* st = state()) ReleaseAfterMembershipChange(*st);
  }
  return changes;
}

void ParameterStore::ReleaseAfterMembershipChange(const State& state) {
  for (const auto& chunk : state.owned) {
    if (chunk == nullptr) continue;
    if (options_.mode == Mode::kSync) {
      bool ready = false;
      {
        absl::MutexLock lock(&chunk->mu);
        ready = !chunk->apply_scheduled && StepComplete(*chunk);
        if (ready) chunk->apply_scheduled = true;
      }
      if (ready) ScheduleApply(state, chunk.get());
      continue;
    }
    std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>> replies;
    {
      absl::MutexLock lock(&chunk->mu);
      ReleaseHeld(chunk.get(), &replies);
    }
    for (auto& [sink, reply] : replies) Deliver(sink.get(), std::move(reply));
  }
}

std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>>
ParameterStore::ApplyLocked(const Optimizer& optimizer, Chunk* chunk,
                            const std::vector<const float*>& contributions,
                            std::vector<Waiter> waiters) {
  // At most two slots (Adam): no allocation on the update path.
  float* slot_ptrs[2] = {};
  for (size_t i = 0; i < chunk->slots.size(); ++i) {
    slot_ptrs[i] = chunk->slots[i].data();
  }
  const absl::Span<float* const> slots(slot_ptrs, chunk->slots.size());
  const bool shared = chunk->weights.use_count() > 1;
  // use_count() is a relaxed load: order the senders' reads of the buffer
  // (before they dropped it) before the writes below.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (shared) {
    // A reply still being sent holds the buffer: update a copy. (use_count
    // only drops concurrently, and only the store adds holders, so reading
    // 1 means no one else holds it.)
    chunk->weights = std::make_shared<std::vector<float>>(*chunk->weights);
    weight_copies_.fetch_add(1, std::memory_order_relaxed);
  }
  const absl::Time start = absl::Now();
  optimizer.Apply(chunk->version, contributions, chunk->weights->data(), slots,
                  chunk->spec.num_elements);
  if (options_.metrics != nullptr) {
    options_.metrics->Aggregated(absl::Now() - start);
  }
  ++chunk->version;
  updates_.fetch_add(1, std::memory_order_relaxed);
  MaybeSnapshot(chunk);
  std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>> replies;
  replies.reserve(waiters.size());
  for (Waiter& w : waiters) {
    ChunkReply reply;
    reply.chunk_id = chunk->spec.id;
    reply.version = chunk->version;
    if (!w.push_only) reply.weights = chunk->weights;
    replies.emplace_back(std::move(w.sink), std::move(reply));
  }
  return replies;
}

void ParameterStore::ApplySync(const Optimizer& optimizer, Chunk* chunk) {
  std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>> replies;
  {
    absl::MutexLock lock(&chunk->mu);
    // A reset (ResetTo) or a join between scheduling and now: the step is
    // not complete any more; the push that completes it schedules again.
    if (!StepComplete(*chunk)) {
      chunk->apply_scheduled = false;
      return;
    }
    // Rank order makes the sum, and so the weights, bitwise deterministic.
    // The mean is over the contributions that arrived: a rank that left the
    // job mid-step is not waited for.
    std::vector<const float*> contributions;
    contributions.reserve(chunk->num_contributed);
    for (uint32_t r = 0; r < options_.num_workers; ++r) {
      if (chunk->contributed[r]) {
        contributions.push_back(chunk->contributions[r].data());
      }
    }
    std::vector<Waiter> waiters;
    waiters.swap(chunk->waiters);
    replies = ApplyLocked(optimizer, chunk, contributions, std::move(waiters));
    if (options_.metrics != nullptr) {
      options_.metrics->StepDone(absl::Now() - chunk->first_contribution);
    }
    chunk->contributed.assign(options_.num_workers, false);
    chunk->num_contributed = 0;
    chunk->apply_scheduled = false;
  }
  // Delivered outside the lock: sinks start gRPC writes.
  for (auto& [sink, reply] : replies) Deliver(sink.get(), std::move(reply));
}

void ParameterStore::Deliver(ReplySink* sink, ChunkReply reply) {
  if (reply.weights != nullptr) {
    bytes_out_.fetch_add(reply.weights->size() * 4, std::memory_order_relaxed);
  }
  sink->Deliver(std::move(reply));
}

void ParameterStore::MaybeSnapshot(Chunk* chunk) {
  const int64_t every = options_.checkpoint_every;
  const bool periodic = every > 0 && chunk->version % every == 0;
  std::vector<int64_t>& requested = chunk->requested_steps;
  auto it = std::find(requested.begin(), requested.end(), chunk->version);
  if (!periodic && it == requested.end()) return;
  if (it != requested.end()) requested.erase(it);
  ChunkState copy;
  copy.chunk_id = chunk->spec.id;
  copy.version = chunk->version;
  copy.weights = *chunk->weights;
  copy.slots = chunk->slots;
  chunk->snapshots.push_back(std::move(copy));
  const size_t owned = state()->num_owned;
  absl::MutexLock lock(&snapshot_mu_);
  if (++snapshot_counts_[chunk->version] == owned) {
    snapshot_counts_.erase(chunk->version);
    const int64_t version = chunk->version;
    const uint64_t epoch = reset_epoch_.load();
    pool_->Schedule(
        [this, version, epoch] { HandOverCheckpoint(version, epoch); });
  }
}

absl::Status ParameterStore::RequestCheckpoint(int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint step ", step, " is negative"));
  }
  if (!options_.on_checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard_index,
        " writes no checkpoints: start it with a checkpoint directory"));
  }
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: nothing to checkpoint");
  }
  const int64_t every = options_.checkpoint_every;
  const bool periodic = every > 0 && step % every == 0;
  absl::MutexLock request_lock(&request_mu_);
  // Marked chunk by chunk: a chunk still below `step` when marked copies its
  // state on reaching it. One that has already reached it makes the request
  // too late: the marks are taken back, with any copy made meanwhile, so
  // that no partial checkpoint is left waiting.
  std::vector<Chunk*> marked;
  int64_t reached = -1;
  for (const auto& chunk : st->owned) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (chunk->version >= step) {
      reached = chunk->version;
      break;
    }
    std::vector<int64_t>& requested = chunk->requested_steps;
    if (!periodic && std::find(requested.begin(), requested.end(), step) ==
                         requested.end()) {
      requested.push_back(step);
      marked.push_back(chunk.get());
    }
  }
  if (reached < 0) return absl::OkStatus();
  for (Chunk* chunk : marked) {
    absl::MutexLock lock(&chunk->mu);
    std::vector<int64_t>& requested = chunk->requested_steps;
    requested.erase(std::remove(requested.begin(), requested.end(), step),
                    requested.end());
    std::vector<ChunkState>& copies = chunk->snapshots;
    copies.erase(std::remove_if(
                     copies.begin(), copies.end(),
                     [step](const ChunkState& s) { return s.version == step; }),
                 copies.end());
  }
  if (!marked.empty()) {
    absl::MutexLock lock(&snapshot_mu_);
    snapshot_counts_.erase(step);
  }
  return absl::OutOfRangeError(absl::StrCat(
      "shard ", options_.shard_index, " has already reached step ", reached,
      ", too late for a checkpoint of step ", step, ": ask for a later step"));
}

void ParameterStore::HandOverCheckpoint(int64_t version, uint64_t epoch) {
  std::vector<ChunkState> states;
  for (const auto& chunk : state()->owned) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    // Counted before a reset (ResetTo dropped those copies).
    if (reset_epoch_.load() != epoch) return;
    auto it =
        std::find_if(chunk->snapshots.begin(), chunk->snapshots.end(),
                     [&](const ChunkState& s) { return s.version == version; });
    if (it == chunk->snapshots.end()) return;  // cannot happen: counted
    states.push_back(std::move(*it));
    chunk->snapshots.erase(it);
  }
  if (options_.on_checkpoint)
    options_.on_checkpoint(version, std::move(states));
}

bool ParameterStore::StalenessAllows(const Chunk& chunk, int64_t step) const {
  if (options_.mode != Mode::kSsp) return true;
  // A rank's clock is the number of steps it has pushed; ranks that left
  // or have not joined yet hold nobody back.
  int64_t slowest = -1;
  bool any = false;
  absl::MutexLock lock(&members_mu_);
  for (uint32_t r = 0; r < options_.num_workers; ++r) {
    if (ranks_[r].kind != RankState::Kind::kActive) continue;
    slowest = any ? std::min(slowest, chunk.last_step[r]) : chunk.last_step[r];
    any = true;
  }
  return !any || slowest + 1 >= step + 1 - options_.staleness;
}

void ParameterStore::ReleaseHeld(
    Chunk* chunk,
    std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>>* replies) {
  std::vector<Waiter> still_held;
  for (Waiter& w : chunk->held) {
    if (!StalenessAllows(*chunk, w.step)) {
      still_held.push_back(std::move(w));
      continue;
    }
    ChunkReply reply;
    reply.chunk_id = chunk->spec.id;
    reply.version = chunk->version;
    if (!w.push_only) reply.weights = chunk->weights;
    replies->emplace_back(std::move(w.sink), std::move(reply));
  }
  chunk->held.swap(still_held);
}

absl::Status ParameterStore::PushAsync(const State& state, const PushArgs& args,
                                       Chunk* chunk,
                                       std::shared_ptr<ReplySink> sink) {
  std::vector<std::pair<std::shared_ptr<ReplySink>, ChunkReply>> replies;
  {
    absl::MutexLock lock(&chunk->mu);
    const int64_t last = chunk->last_step[args.rank];
    if (args.step != last && args.step != last + 1) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", args.step, " of chunk ", chunk->spec.id, " from rank ",
          args.rank, " is in the ", args.step < last ? "past" : "future",
          ": the last step applied for this rank is ", last));
    }
    if (options_.metrics != nullptr) {
      const int64_t newest =
          *std::max_element(chunk->last_step.begin(), chunk->last_step.end());
      options_.metrics->Staleness(std::max<int64_t>(0, newest - args.step));
    }
    if (args.step == last + 1) {
      // Applied on arrival, on this thread. (A push of `last` is a retry:
      // already applied, it only gets the current weights.)
      SHARDPS_RETURN_IF_ERROR(TakeGradient(state, args, chunk));
      chunk->last_step[args.rank] = args.step;
      std::vector<const float*> contributions = {
          chunk->contributions[args.rank].data()};
      ApplyLocked(*state.optimizer, chunk, contributions, {});
    }
    chunk->held.push_back(
        {args.rank, args.push_only, std::move(sink), args.step});
    ReleaseHeld(chunk, &replies);
  }
  for (auto& [s, reply] : replies) Deliver(s.get(), std::move(reply));
  return absl::OkStatus();
}

absl::StatusOr<ChunkReply> ParameterStore::Read(uint32_t chunk_id) const {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: call Declare first");
  }
  SHARDPS_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*st, chunk_id));
  ChunkReply reply;
  reply.chunk_id = chunk_id;
  absl::MutexLock lock(&chunk->mu);
  reply.version = chunk->version;
  reply.weights = chunk->weights;
  return reply;
}

absl::Status ParameterStore::CheckOwned(uint32_t chunk_id) const {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError(
        "no model is declared on this shard yet: call Declare first");
  }
  return FindChunk(*st, chunk_id).status();
}

std::vector<ParameterStore::StalledChunk> ParameterStore::Stalled(
    absl::Duration timeout) const {
  std::vector<StalledChunk> out;
  const State* st = state();
  if (st == nullptr || options_.mode != Mode::kSync) return out;
  const absl::Time now = absl::Now();
  for (const auto& chunk : st->owned) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (chunk->num_contributed == 0 ||
        now - chunk->first_contribution < timeout) {
      continue;
    }
    StalledChunk s;
    s.chunk_id = chunk->spec.id;
    s.step = chunk->version;
    s.waiting = now - chunk->first_contribution;
    for (uint32_t r = 0; r < options_.num_workers; ++r) {
      if (!chunk->contributed[r] && WaitsFor(r, chunk->version)) {
        s.missing_ranks.push_back(r);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<v1::DeclareRequest> ParameterStore::declaration() const {
  const State* st = state();
  if (st == nullptr) {
    return absl::FailedPreconditionError("no model is declared on this shard");
  }
  return st->declaration;
}

std::vector<uint32_t> ParameterStore::OwnedChunks() const {
  std::vector<uint32_t> ids;
  const State* st = state();
  if (st == nullptr) return ids;
  for (const auto& chunk : st->owned) {
    if (chunk != nullptr) ids.push_back(chunk->spec.id);
  }
  return ids;
}

v1::GetStatusResponse ParameterStore::Report() const {
  v1::GetStatusResponse resp;
  resp.set_shard_index(options_.shard_index);
  resp.set_num_shards(options_.num_shards);
  resp.set_num_workers(options_.num_workers);
  resp.set_mode(options_.mode == Mode::kSync ? "sync"
                : options_.mode == Mode::kAsync
                    ? "async"
                    : absl::StrCat("ssp:", options_.staleness));
  {
    absl::MutexLock lock(&members_mu_);
    resp.set_generation(view_generation_);
  }
  resp.set_pushes_total(pushes_.load());
  resp.set_updates_total(updates_.load());
  resp.set_rejected_total(rejected_.load());
  resp.set_bytes_in_total(bytes_in_.load());
  resp.set_bytes_out_total(bytes_out_.load());
  resp.set_weight_copies_total(weight_copies_.load());
  resp.set_rollback_id(rollback_id_.load());
  const State* st = state();
  if (st == nullptr) return resp;
  resp.set_declared(true);
  resp.set_fingerprint(st->fingerprint);
  resp.set_owned_bytes(st->owned_bytes);
  int64_t lo = -1, hi = -1;
  uint32_t count = 0;
  for (const auto& chunk : st->owned) {
    if (chunk == nullptr) continue;
    ++count;
    absl::MutexLock lock(&chunk->mu);
    if (lo < 0 || chunk->version < lo) lo = chunk->version;
    hi = std::max(hi, chunk->version);
  }
  resp.set_num_chunks(count);
  resp.set_min_version(std::max<int64_t>(lo, 0));
  {
    absl::MutexLock lock(&members_mu_);
    for (uint32_t r : ActiveRanks(resp.min_version())) resp.add_active_ranks(r);
  }
  resp.set_max_version(std::max<int64_t>(hi, 0));
  return resp;
}

}  // namespace shardps::server
