// Client's declarations: the model on every shard (Declare, Redeclare), the
// chunk map and lane plan it implies, and a join step (JoinAt). See
// client.cc for the Client's threads.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/partitioner.h"
#include "common/run_parallel.h"
#include "common/status.h"
#include "worker/client.h"

namespace shardps {

// Declare on one shard, retrying while the shard answers UNAVAILABLE (not
// up yet, or not yet aware of this process) until `deadline`.
absl::Status Client::DeclareOn(size_t shard, const v1::DeclareRequest& req,
                               absl::Time deadline, v1::DeclareResponse* resp) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  Backoff backoff = options_.WaitBackoff();
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);  // servers may still be starting
    const absl::Status s = FromGrpcStatus(lane.stub->Declare(&ctx, req, resp));
    // UNAVAILABLE from the shard itself: it has not yet seen the
    // coordinator's view that admitted this process. Ask again.
    if (!absl::IsUnavailable(s) || absl::Now() + backoff.Peek() > deadline) {
      return WithPrefix(
          absl::StrCat("Declare on shard ", shard, " at ", lane.address), s);
    }
    absl::SleepFor(backoff.Next());
  }
}

absl::Status Client::Declare(const v1::Layout& layout,
                             const v1::OptimizerSpec& optimizer) {
  if (open_ != nullptr) {
    return absl::FailedPreconditionError("Declare while a step is open");
  }
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(layout));
  const uint32_t num_shards = static_cast<uint32_t>(options_.servers.size());
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  std::vector<uint32_t> shard_of = PartitionChunks(chunks, num_shards);
  SHARDPS_RETURN_IF_ERROR(SetLayout(layout));
  optimizer_ = optimizer;
  if (options_.shared_memory) shm_.MakeProbe();
  std::vector<v1::DeclareResponse> declared(num_shards);
  SHARDPS_RETURN_IF_ERROR(DeclareOnEvery(shard_of, &declared));
  SHARDPS_RETURN_IF_ERROR(TakeSteps(declared));
  // Rings carry headers only: every payload must go through the region.
  const bool ringable = options_.shared_memory_rings &&
                        options_.compression.gradients == v1::ENCODING_FP32 &&
                        options_.compression.weights != v1::ENCODING_TOPK;
  shm_.SetShards(declared, ringable);
  declared_states_ = std::move(declared);
  Plan(std::move(chunks), std::move(shard_of));
  declared_ = true;
  return absl::OkStatus();
}

// The layout as this client declares it (with sparse weights, its ratio).
absl::Status Client::SetLayout(const v1::Layout& layout) {
  layout_ = layout;
  if (options_.compression.weights != v1::ENCODING_TOPK) {
    return absl::OkStatus();
  }
  // Sparse weights are the model's: every worker declares the same.
  const float ratio =
      static_cast<float>(options_.compression.weights_topk_ratio);
  if (layout.sparse_weights_ratio() != 0 &&
      layout.sparse_weights_ratio() != ratio) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the layout's sparse_weights_ratio ", layout.sparse_weights_ratio(),
        " is not this client's weight encoding topk:", ratio));
  }
  layout_.set_sparse_weights_ratio(ratio);
  layout_.set_sparse_weights_min_elements(options_.compression.min_elements);
  return absl::OkStatus();
}

// Declare on every shard at once, each checked to own the chunks this
// worker computed for it.
absl::Status Client::DeclareOnEvery(
    absl::Span<const uint32_t> shard_of,
    std::vector<v1::DeclareResponse>* declared) {
  const size_t num_shards = declared->size();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  return RunParallel(num_shards, [&](size_t shard) {
    v1::DeclareResponse& resp = (*declared)[shard];
    SHARDPS_RETURN_IF_ERROR(
        DeclareOn(shard, DeclareRequestFor(shard), deadline, &resp));
    std::vector<uint32_t> want;
    for (size_t i = 0; i < shard_of.size(); ++i) {
      if (shard_of[i] == shard) want.push_back(static_cast<uint32_t>(i));
    }
    if (std::vector<uint32_t>(resp.chunk_ids().begin(),
                              resp.chunk_ids().end()) != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", shard, " at ",
          lanes_[shard * options_.streams_per_shard]->address,
          " owns other chunks than this worker computed: is it started with "
          "--shard_index=",
          shard, " --num_shards=", num_shards, "?"));
    }
    return absl::OkStatus();
  });
}

// must_join(), max_version() and start_step() from the shards' answers.
absl::Status Client::TakeSteps(
    const std::vector<v1::DeclareResponse>& declared) {
  must_join_ = false;
  max_version_ = 0;
  int64_t lo = declared[0].next_step();
  int64_t hi = lo;
  for (const v1::DeclareResponse& resp : declared) {
    must_join_ = must_join_ || resp.must_join();
    max_version_ = std::max(max_version_, resp.max_version());
    lo = std::min(lo, resp.next_step());
    hi = std::max(hi, resp.next_step());
  }
  // Resume where the servers are (a restored checkpoint's step). A worker
  // that died mid-step may have left one shard a step ahead: start from the
  // lowest, which that shard answers as a retry.
  // A process new to a running job takes its step from JoinAt instead:
  // the job moves on while the shards answer one by one, so they may be
  // steps apart.
  if (!must_join_ && hi - lo > 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shards are at steps ", lo, " to ", hi,
                     ": restore every shard from the same checkpoint"));
  }
  start_step_ = lo;
  return absl::OkStatus();
}

// The new chunk map's lanes, regions and per-chunk state.
void Client::Plan(std::vector<ChunkSpec> chunks,
                  std::vector<uint32_t> shard_of) {
  plan_ = PlanLanes(layout_, chunks, shard_of,
                    static_cast<uint32_t>(options_.servers.size()),
                    options_.streams_per_shard);
  for (size_t l = 0; l < lanes_.size(); ++l) {
    lanes_[l]->chunk_ids = plan_.lane_chunks[l];
    lanes_[l]->shm_bytes = plan_.stream[l].payload_bytes;
    lanes_[l]->ring_bytes = plan_.stream[l].rings.bytes;
  }
  shm_.DeclarePulls(plan_.pull_region_bytes);
  std::vector<int64_t> tensor_elements;
  for (const v1::TensorSpec& t : layout_.tensors()) {
    tensor_elements.push_back(NumElements(t));
  }
  shm_.DeclareBuffers(plan_.tensor_at, std::move(tensor_elements),
                      plan_.buffer_bytes);
  // A model declared again keeps its residuals only if it is the same.
  if (options_.compression.gradients != v1::ENCODING_FP32 &&
      (compressor_ == nullptr || !compressor_->SameChunks(chunks))) {
    compressor_ =
        std::make_unique<GradientCompressor>(options_.compression, chunks);
  }
  reader_.Declare(chunks);
  chunks_ = std::move(chunks);
  shard_of_ = std::move(shard_of);
}

std::string Client::DescribeChunks() const {
  const size_t num_shards = options_.servers.size();
  std::vector<int64_t> shard_bytes(num_shards, 0);
  int64_t total = 0;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    shard_bytes[shard_of_[i]] += chunks_[i].bytes();
    total += chunks_[i].bytes();
  }
  const uint64_t chunk = ChunkBytes(layout_);
  std::string text = absl::StrCat(
      chunks_.size(), " chunks of up to ",
      chunk % 1024 == 0 ? absl::StrCat(chunk >> 10, " KiB")
                        : absl::StrCat(chunk, " B"),
      " over ", num_shards, num_shards == 1 ? " shard" : " shards");
  if (num_shards < 2 || total == 0) return text;
  const int64_t busiest =
      *std::max_element(shard_bytes.begin(), shard_bytes.end());
  const double mean = static_cast<double>(total) / num_shards;
  const double over = 100.0 * (busiest - mean) / mean;
  absl::StrAppend(&text, ", the busiest shard ",
                  absl::StrFormat("%.1f %%", over), " over the mean");
  if (over > 5.0) {
    absl::StrAppend(&text,
                    " (its link bounds a step across a network; a smaller "
                    "--chunk_kib balances finer, at a CPU cost per chunk)");
  }
  return text;
}

absl::Status Client::JoinAt(int64_t step) {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before JoinAt");
  }
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  SHARDPS_RETURN_IF_ERROR(
      RunParallel(options_.servers.size(), [&](size_t shard) {
        v1::DeclareRequest req = DeclareRequestFor(shard);
        req.set_join(true);
        req.set_join_step(step);
        v1::DeclareResponse resp;
        return DeclareOn(shard, req, deadline, &resp);
      }));
  must_join_ = false;
  start_step_ = step;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::DeclareResponse>> Client::Redeclare() {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before Redeclare");
  }
  std::vector<v1::DeclareResponse> out(options_.servers.size());
  const absl::Time deadline = absl::Now() + options_.probe_timeout;
  SHARDPS_RETURN_IF_ERROR(RunParallel(out.size(), [&](size_t shard) {
    return DeclareOn(shard, DeclareRequestFor(shard), deadline, &out[shard]);
  }));
  return out;
}

}  // namespace shardps
