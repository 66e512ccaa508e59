// Client's Pulls: each shard's weights read on a thread of its own, through
// the shard's Pull region when it shares this machine (the region is kept
// from Pull to Pull; a new one after a failed call, which the shard may
// still be writing into). See client.cc for the Client's threads.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/run_parallel.h"
#include "common/shm_protocol.h"
#include "common/status.h"
#include "worker/client.h"
#include "worker/open_step.h"

namespace shardps {

absl::Status Client::PullShard(uint32_t shard, const Tensors& weights,
                               bool fp32) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  const size_t owned = std::count(shard_of_.begin(), shard_of_.end(), shard);
  // Pull sends sparse weights whole; `fp32` asks them exact.
  const bool sparse = fp32 || options_.compression.weights == v1::ENCODING_TOPK;
  ReplyReader exact(v1::ENCODING_FP32);
  ReplyReader& reader = fp32 ? exact : reader_;
  Backoff backoff = options_.RetryBackoff();
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    v1::PullRequest req;
    req.set_encoding(sparse ? v1::ENCODING_FP32 : options_.compression.weights);
    SharedRegion* region = sparse ? nullptr : shm_.PullRegion(shard);
    if (region != nullptr) {
      auto& offsets = *req.mutable_reply_shm_offsets();
      for (uint32_t id = 0; id < chunks_.size(); ++id) {
        if (shard_of_[id] == shard) offsets[id] = plan_.pull_at[id];
      }
    }
    size_t received = 0;
    status = lane.Pull(req, region, options_.rpc_timeout, [&](Reply* r) {
      const uint32_t id = r->response.chunk_id();
      if (id >= chunks_.size() || shard_of_[id] != shard) {
        return absl::InternalError(
            absl::StrCat("server sent chunk ", id, " which it does not own"));
      }
      const ChunkSpec& c = chunks_[id];
      SHARDPS_RETURN_IF_ERROR(reader.Read(r, c,
                                          weights[c.tensor].data() + c.offset,
                                          region, plan_.pull_at[id]));
      ++received;
      return absl::OkStatus();
    });
    if (status.ok() && received != owned) {
      status = absl::InternalError(absl::StrCat(
          "Pull returned ", received, " chunks; the shard owns ", owned));
    }
    if (status.ok()) break;
    // The shard may still be writing into this call's region.
    if (region != nullptr) shm_.DropPullRegion(shard);
    // The shard cannot map it: over gRPC.
    if (shm::IsFallback(status)) shm_.Fallback(shard);
    if (!IsRetryable(status) || attempt >= options_.max_attempts) break;
    retries_.fetch_add(1);
    absl::SleepFor(backoff.Next());
  }
  return WithPrefix(
      absl::StrCat("Pull from shard ", shard, " at ", lane.address), status);
}

absl::Status Client::Pull(const Tensors& weights, bool fp32) {
  if (open_ != nullptr) {
    // Its lanes' readers use the same reply buffers (and sparse copies).
    return absl::FailedPreconditionError(absl::StrCat(
        "Pull while step ", open_->step(), " is open: FinishStep first"));
  }
  ConstTensors shapes(weights.begin(), weights.end());
  SHARDPS_RETURN_IF_ERROR(CheckTensors(shapes, nullptr));
  return RunParallel(options_.servers.size(), [&](size_t shard) {
    return PullShard(static_cast<uint32_t>(shard), weights, fp32);
  });
}

absl::Status Client::PullWhenReady(const Tensors& weights,
                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff = options_.WaitBackoff();
  while (true) {
    absl::Status s = Pull(weights);
    if (!absl::IsUnavailable(s)) return s;
    if (absl::Now() + backoff.Peek() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the model's weights were not ready within ",
                       absl::FormatDuration(timeout), ": ", s.message()));
    }
    absl::SleepFor(backoff.Next());
  }
}

}  // namespace shardps
