// Client's optimizer state: read from every shard's chunks and assembled by
// tensor, or split into chunks and written (torch's optimizer state_dict;
// rpc ReadOptimizerState and WriteOptimizerState). One unary call per
// chunk, the shards in parallel. See client.cc for the Client's threads.
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/run_parallel.h"
#include "common/status.h"
#include "worker/client.h"

namespace shardps {

absl::Status Client::CallShard(
    uint32_t shard, absl::string_view what,
    const std::function<grpc::Status(v1::ParameterServer::Stub*,
                                     grpc::ClientContext*)>& call) {
  Lane& lane = *lanes_[shard * options_.streams_per_shard];
  Backoff backoff = options_.RetryBackoff();
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    status = FromGrpcStatus(call(lane.stub.get(), &ctx));
    if (status.ok() || !IsRetryable(status) ||
        attempt >= options_.max_attempts) {
      break;
    }
    retries_.fetch_add(1);
    absl::SleepFor(backoff.Next());
  }
  return WithPrefix(
      absl::StrCat(what, " on shard ", shard, " at ", lane.address), status);
}

absl::StatusOr<std::vector<TensorOptimizerState>> Client::ReadOptimizerState(
    int64_t step) {
  if (open_ != nullptr || !declared_) {
    return absl::FailedPreconditionError(
        "the optimizer state is read after Declare, between steps");
  }
  std::vector<TensorOptimizerState> states(layout_.tensors_size());
  std::vector<bool> seen(states.size(), false);
  // Every chunk's state first, then assembled on this thread.
  std::vector<v1::ChunkOptimizerState> read(chunks_.size());
  SHARDPS_RETURN_IF_ERROR(
      RunParallel(options_.servers.size(), [&](size_t shard) -> absl::Status {
        for (uint32_t id = 0; id < chunks_.size(); ++id) {
          if (shard_of_[id] != shard) continue;
          v1::ReadOptimizerStateRequest req;
          req.set_chunk_id(id);
          SHARDPS_RETURN_IF_ERROR(CallShard(
              static_cast<uint32_t>(shard), "ReadOptimizerState",
              [&](v1::ParameterServer::Stub* stub, grpc::ClientContext* ctx) {
                return stub->ReadOptimizerState(ctx, req, &read[id]);
              }));
        }
        return absl::OkStatus();
      }));
  for (uint32_t id = 0; id < chunks_.size(); ++id) {
    const ChunkSpec& c = chunks_[id];
    const v1::ChunkOptimizerState& r = read[id];
    const std::string name = layout_.tensors(c.tensor).name();
    if (r.step() != step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "chunk ", id, " (", name, ") is at step ", r.step(), ", not ", step,
          ": read the optimizer state between steps, on every rank"));
    }
    TensorOptimizerState& t = states[c.tensor];
    if (!seen[c.tensor]) {
      seen[c.tensor] = true;
      t.optimizer_steps = r.optimizer_steps();
      t.slots.assign(
          r.slots_size(),
          std::vector<float>(NumElements(layout_.tensors(c.tensor))));
    }
    if (r.optimizer_steps() != t.optimizer_steps ||
        static_cast<size_t>(r.slots_size()) != t.slots.size()) {
      return absl::InternalError(
          absl::StrCat("the chunks of ", name,
                       " disagree on their optimizer's steps or slots"));
    }
    for (int k = 0; k < r.slots_size(); ++k) {
      const std::string& bytes = r.slots(k);
      if (bytes.size() != static_cast<size_t>(c.num_elements) * 4) {
        return absl::InternalError(absl::StrCat(
            "chunk ", id, " (", name, ") sent a slot of ", bytes.size(),
            " bytes for ", c.num_elements, " values"));
      }
      std::memcpy(t.slots[k].data() + c.offset, bytes.data(), bytes.size());
    }
  }
  return states;
}

absl::Status Client::WriteOptimizerState(
    int64_t step,
    const std::vector<std::optional<TensorOptimizerState>>& states) {
  if (open_ != nullptr || !declared_) {
    return absl::FailedPreconditionError(
        "the optimizer state is written after Declare, between steps");
  }
  if (states.size() != static_cast<size_t>(layout_.tensors_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state for ", states.size(),
                     " tensors; the model has ", layout_.tensors_size()));
  }
  for (size_t i = 0; i < states.size(); ++i) {
    if (!states[i].has_value()) continue;
    for (const std::vector<float>& slot : states[i]->slots) {
      if (slot.size() != static_cast<size_t>(NumElements(layout_.tensors(i)))) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer state of ", layout_.tensors(i).name(),
                         ": a slot of ", slot.size(), " values for ",
                         NumElements(layout_.tensors(i)), " elements"));
      }
    }
  }
  return RunParallel(options_.servers.size(), [&](size_t shard) {
    for (uint32_t id = 0; id < chunks_.size(); ++id) {
      const ChunkSpec& c = chunks_[id];
      if (shard_of_[id] != shard || !states[c.tensor].has_value()) continue;
      const TensorOptimizerState& t = *states[c.tensor];
      v1::ChunkOptimizerState req;
      req.set_chunk_id(id);
      req.set_step(step);
      req.set_optimizer_steps(t.optimizer_steps);
      for (const std::vector<float>& slot : t.slots) {
        req.add_slots(reinterpret_cast<const char*>(slot.data() + c.offset),
                      c.num_elements * sizeof(float));
      }
      v1::WriteOptimizerStateResponse resp;
      SHARDPS_RETURN_IF_ERROR(CallShard(
          static_cast<uint32_t>(shard), "WriteOptimizerState",
          [&](v1::ParameterServer::Stub* stub, grpc::ClientContext* ctx) {
            return stub->WriteOptimizerState(ctx, req, &resp);
          }));
    }
    return absl::OkStatus();
  });
}

}  // namespace shardps
