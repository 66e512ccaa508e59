#include "server/parameter_service.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/shared_memory.h"
#include "common/wire.h"
#include "server/pull_reactor.h"
#include "server/reply_encoding.h"

namespace shardps::server {
namespace {

// The rank a PushPull call's metadata names (kRankMetadataKey); none when
// it names none or not a number (then learnt from its first push).
std::optional<uint32_t> RankOf(const grpc::CallbackServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kRankMetadataKey);
  uint32_t rank = 0;
  if (it == md.end() ||
      !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()),
                        &rank)) {
    return std::nullopt;
  }
  return rank;
}

// Finishes a PushPull stream at once with an error.
class FailedPushPull final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit FailedPushPull(const absl::Status& status) {
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// Finishes a streaming RPC at once with an error.
class FailedPull final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FailedPull(const absl::Status& status, ServerMetrics* metrics) {
    if (metrics != nullptr) metrics->Rejected(status);
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

}  // namespace

absl::Status ParameterService::NotReady() const {
  absl::MutexLock lock(&mu_);
  return absl::UnavailableError(
      absl::StrCat("this shard is not serving yet: ", waiting_, "; retry"));
}

grpc::ServerUnaryReactor* ParameterService::Declare(
    grpc::CallbackServerContext* ctx, const v1::DeclareRequest* req,
    v1::DeclareResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  absl::StatusOr<v1::DeclareResponse> result = store->Declare(*req);
  if (result.ok()) {
    *resp = *std::move(result);
    if (!req->shared_memory_probe().empty()) {
      absl::StatusOr<std::unique_ptr<SharedRegion>> probe =
          options_.shared_memory
              ? SharedRegion::Open(req->shared_memory_probe(), 16)
              : absl::FailedPreconditionError(
                    "this shard was started with --shared_memory=false");
      if (probe.ok()) {
        resp->set_shared_memory_token((*probe)->data(), 16);
        resp->set_shared_memory_rings(options_.shared_memory_rings);
      } else {
        resp->set_shared_memory_error(std::string(probe.status().message()));
      }
    }
  }
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterService::PushPull(grpc::CallbackServerContext* ctx) {
  ParameterStore* store = this->store();
  if (store == nullptr) return new FailedPushPull(NotReady());
  push_streams_.fetch_add(1, std::memory_order_relaxed);
  absl::StatusOr<StreamRegions> regions =
      PushPullRegions(*ctx, *store, shm_policy());
  if (!regions.ok()) return new FailedPushPull(regions.status());
  if (regions->stream != nullptr) {
    shm_streams_.fetch_add(1, std::memory_order_relaxed);
  }
  if (regions->rings.has_value()) {
    shm_ring_streams_.fetch_add(1, std::memory_order_relaxed);
  }
  return PushPullReactor::Start(Env(store), *std::move(regions), RankOf(*ctx));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ParameterService::Pull(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  ParameterStore* store = this->store();
  if (store == nullptr) return new FailedPull(NotReady(), options_.metrics);
  v1::PullRequest parsed;
  grpc::ByteBuffer copy(*request);  // Deserialize consumes its argument
  if (!grpc::SerializationTraits<v1::PullRequest>::Deserialize(&copy, &parsed)
           .ok()) {
    return new FailedPull(absl::InvalidArgumentError("malformed PullRequest"),
                          options_.metrics);
  }
  const v1::PullRequest* req = &parsed;
  absl::Status encoding = CheckReplyEncoding(req->encoding(), /*sparse=*/false);
  if (!encoding.ok()) return new FailedPull(encoding, options_.metrics);
  std::vector<uint32_t> ids(req->chunk_ids().begin(), req->chunk_ids().end());
  if (ids.empty()) {
    ids = store->OwnedChunks();
    if (ids.empty()) {
      return new FailedPull(
          absl::FailedPreconditionError(
              "no model is declared on this shard yet: call Declare first"),
          options_.metrics);
    }
  }
  // Reject unknown chunks, and chunks still awaiting their initial values,
  // before streaming anything.
  for (uint32_t id : ids) {
    absl::Status readable = store->CheckReadable(id);
    if (!readable.ok()) return new FailedPull(readable, options_.metrics);
  }
  absl::StatusOr<std::shared_ptr<SharedRegion>> region =
      PullRegion(*ctx, *store, shm_policy(), &pull_regions_);
  if (!region.ok()) return new FailedPull(region.status(), options_.metrics);
  std::vector<std::optional<uint64_t>> reply_at;
  if (!req->reply_shm_offsets().empty()) {
    absl::Status offsets = ReplyOffsets(*req, ids, region->get(), &reply_at);
    if (!offsets.ok()) return new FailedPull(offsets, options_.metrics);
  }
  if (*region != nullptr) shm_streams_.fetch_add(1, std::memory_order_relaxed);
  return new PullReactor(store, std::move(ids),
                         EffectiveEncoding(req->encoding()), options_.metrics,
                         *std::move(region), std::move(reply_at));
}

grpc::ServerUnaryReactor* ParameterService::GetStatus(
    grpc::CallbackServerContext* ctx, const v1::GetStatusRequest* req,
    v1::GetStatusResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  *resp = store->Report();
  resp->set_push_streams_total(push_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_streams_total(
      shm_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_ring_streams_total(
      shm_ring_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_gradient_pushes_total(
      shm_counters_.gradient_pushes.load(std::memory_order_relaxed));
  resp->set_shared_memory_weight_replies_total(
      shm_counters_.weight_replies.load(std::memory_order_relaxed));
  resp->set_shared_memory_pull_mappings_total(pull_regions_.mapped());
  resp->set_shared_memory_pull_mappings_reused_total(pull_regions_.reused());
  const ShardCheckpointer* checkpoints = checkpoints_.load();
  if (checkpoints != nullptr) {
    const CheckpointProgress progress = checkpoints->Progress();
    resp->set_checkpoint_dir(checkpoints->dir());
    resp->set_last_checkpoint_step(progress.written_step);
    resp->set_last_committed_checkpoint_step(progress.committed_step);
    resp->set_failed_checkpoint_step(progress.failed_step);
    resp->set_checkpoint_error(progress.error);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ParameterService::Checkpoint(
    grpc::CallbackServerContext* ctx, const v1::CheckpointRequest* req,
    v1::CheckpointResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  const absl::Status status = store->RequestCheckpoint(req->step());
  if (status.ok()) resp->set_step(req->step());
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterService::ReadOptimizerState(
    grpc::CallbackServerContext* ctx, const v1::ReadOptimizerStateRequest* req,
    v1::ChunkOptimizerState* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  absl::StatusOr<v1::ChunkOptimizerState> state =
      store == nullptr ? NotReady()
                       : store->ReadOptimizerState(req->chunk_id());
  if (state.ok()) *resp = *std::move(state);
  reactor->Finish(ToGrpcStatus(state.status()));
  return reactor;
}

grpc::ServerUnaryReactor* ParameterService::WriteOptimizerState(
    grpc::CallbackServerContext* ctx, const v1::ChunkOptimizerState* req,
    v1::WriteOptimizerStateResponse*) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  const absl::Status status =
      store == nullptr ? NotReady() : store->WriteOptimizerState(*req);
  if (!status.ok() && options_.metrics != nullptr) {
    options_.metrics->Rejected(status);
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace shardps::server
