// The ParameterServer gRPC service of one shard: thin callback handlers that
// validate requests and hand them to a ParameterStore. PushPull and Pull use
// raw byte buffers (common/wire.h) so weights are sent without copies. Replies
// of a PushPull stream are written in completion order, one write at a time.
#ifndef SHARDPS_SERVER_PARAMETER_SERVICE_H_
#define SHARDPS_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"
#include "server/parameter_store.h"
#include "server/shard_checkpointer.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {

struct ServiceOptions {
  // Fault injection for tests: when > 0, every Nth PushPull reply is dropped
  // and its stream ends with UNAVAILABLE, as if the network lost it.
  int64_t drop_reply_every = 0;
  // Request and byte counters; null: none. Must outlive the service.
  ServerMetrics* metrics = nullptr;
  // Workers on this machine may move payloads through shared memory
  // (common/shared_memory.h).
  bool shared_memory = true;
  // And may pass PushPull headers through message rings there
  // (common/message_ring.h).
  bool shared_memory_rings = true;
};

// Serves the store given to Install, which must outlive the service and
// every RPC it started; before Install every method answers UNAVAILABLE.
class ParameterService final
    : public v1::ParameterServer::WithCallbackMethod_Declare<
          v1::ParameterServer::WithRawCallbackMethod_PushPull<
              v1::ParameterServer::WithRawCallbackMethod_Pull<
                  v1::ParameterServer::WithCallbackMethod_GetStatus<
                      v1::ParameterServer::WithCallbackMethod_Checkpoint<
                          v1::ParameterServer::Service>>>>> {
 public:
  explicit ParameterService(ServiceOptions options) : options_(options) {}

  // Starts serving `store`; GetStatus reports `checkpoints` (null: the
  // shard writes none). Both must outlive the service.
  void Install(ParameterStore* store,
               const ShardCheckpointer* checkpoints = nullptr) {
    checkpoints_.store(checkpoints, std::memory_order_release);
    store_.store(store, std::memory_order_release);
  }
  // Stops serving the store for a while (new calls get UNAVAILABLE naming
  // `why`; calls in flight go on); Install serves it again.
  void Pause(std::string why) ABSL_LOCKS_EXCLUDED(mu_) {
    SetWaiting(std::move(why));
    store_.store(nullptr, std::memory_order_release);
  }
  // Why the shard is not serving yet, for the UNAVAILABLE answers.
  void SetWaiting(std::string why) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    waiting_ = std::move(why);
  }

  grpc::ServerUnaryReactor* Declare(grpc::CallbackServerContext* ctx,
                                    const v1::DeclareRequest* req,
                                    v1::DeclareResponse* resp) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PushPull(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Pull(
      grpc::CallbackServerContext* ctx,
      const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::GetStatusRequest* req,
                                      v1::GetStatusResponse* resp) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx,
                                       const v1::CheckpointRequest* req,
                                       v1::CheckpointResponse* resp) override;

  // The installed store, or null with the UNAVAILABLE status to answer.
  ParameterStore* store() const {
    return store_.load(std::memory_order_acquire);
  }
  absl::Status NotReady() const ABSL_LOCKS_EXCLUDED(mu_);

  // Maps the region a PushPull or Pull call to `store` names in its
  // metadata ("<path> <bytes>"); null when it names none. An error is
  // UNAVAILABLE with kSharedMemoryErrorPrefix (the client retries without
  // shared memory): a malformed name, a region larger than this shard's
  // chunks can need, one that cannot be mapped, a shard started without
  // shared memory.
  absl::StatusOr<std::unique_ptr<SharedRegion>> CallRegion(
      const grpc::CallbackServerContext* ctx,
      const ParameterStore* store) const;
  // Maps, read-only, the worker's gradient region a PushPull call names
  // (kSharedMemoryGradientsMetadata); null when it names none. Errors as
  // CallRegion's, the limit being the whole model's gradients.
  absl::StatusOr<std::unique_ptr<SharedRegion>> GradientRegion(
      const grpc::CallbackServerContext* ctx,
      const ParameterStore* store) const;
  // Maps, read-write, the worker's weight region a PushPull call names
  // (kSharedMemoryWeightsMetadata); null when it names none. Errors as
  // CallRegion's, the limit being the whole model's weights.
  absl::StatusOr<std::unique_ptr<SharedRegion>> WeightRegion(
      const grpc::CallbackServerContext* ctx,
      const ParameterStore* store) const;

  // True when this reply should be dropped (fault injection).
  bool DropNextReply();
  ServerMetrics* metrics() const { return options_.metrics; }
  bool shared_memory() const { return options_.shared_memory; }
  void CountGradientRegionPush() {
    shm_gradient_pushes_.fetch_add(1, std::memory_order_relaxed);
  }
  void CountWeightRegionReply() {
    shm_weight_replies_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::atomic<ParameterStore*> store_{nullptr};
  std::atomic<const ShardCheckpointer*> checkpoints_{nullptr};
  std::atomic<uint64_t> push_streams_{0};  // PushPull calls opened
  // PushPull and Pull calls with a shared-memory region.
  std::atomic<uint64_t> shm_streams_{0};
  std::atomic<uint64_t> shm_ring_streams_{0};  // of them, with rings
  // Pushes read from a worker's gradient region.
  std::atomic<uint64_t> shm_gradient_pushes_{0};
  // Replies asked in a worker's weight region.
  std::atomic<uint64_t> shm_weight_replies_{0};
  // The region the call's metadata `key` names, of at most `limit` bytes
  // (`needs` says whose); errors as CallRegion's.
  absl::StatusOr<std::unique_ptr<SharedRegion>> NamedRegion(
      const grpc::CallbackServerContext* ctx, absl::string_view key,
      uint64_t limit, absl::string_view needs,
      SharedRegion::Mapping mapping) const;
  const ServiceOptions options_;
  mutable absl::Mutex mu_;
  std::string waiting_ ABSL_GUARDED_BY(mu_) = "starting";
  std::atomic<int64_t> replies_{0};
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PARAMETER_SERVICE_H_
