// The ParameterServer gRPC service of one shard: thin callback handlers that
// validate a call, map the shared memory it names (server/shm_stream.h) and
// hand it to the ParameterStore, each PushPull stream to a PushPullReactor
// (server/push_pull_reactor.h), each Pull to a PullReactor. Thread-safe: gRPC
// calls the handlers from any thread; Install and Pause may come any time.
#ifndef SHARDPS_SERVER_PARAMETER_SERVICE_H_
#define SHARDPS_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/parameter_store.h"
#include "server/push_pull_reactor.h"
#include "server/region_cache.h"
#include "server/server_metrics.h"
#include "server/shard_checkpointer.h"
#include "server/shm_stream.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {

struct ServiceOptions {
  // Fault injection for tests: when > 0, every Nth PushPull reply is dropped
  // and its stream ends with UNAVAILABLE, as if the network lost it.
  int64_t drop_reply_every = 0;
  // Request and byte counters; null: none. Must outlive the service.
  ServerMetrics* metrics = nullptr;
  // Workers on this machine may move payloads through shared memory
  // (common/shm_protocol.h).
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
                          v1::ParameterServer::
                              WithCallbackMethod_ReadOptimizerState<
                                  v1::ParameterServer::
                                      WithCallbackMethod_WriteOptimizerState<
                                          v1::ParameterServer::Service>>>>>>> {
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

  grpc::ServerUnaryReactor* ReadOptimizerState(
      grpc::CallbackServerContext* ctx,
      const v1::ReadOptimizerStateRequest* req,
      v1::ChunkOptimizerState* resp) override;
  grpc::ServerUnaryReactor* WriteOptimizerState(
      grpc::CallbackServerContext* ctx, const v1::ChunkOptimizerState* req,
      v1::WriteOptimizerStateResponse* resp) override;

  // The installed store, or null with the UNAVAILABLE status to answer.
  ParameterStore* store() const {
    return store_.load(std::memory_order_acquire);
  }
  absl::Status NotReady() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What a PushPull stream on `store` uses of this service.
  StreamEnv Env(ParameterStore* store) {
    return StreamEnv{store, options_.metrics, &shm_counters_, &faults_};
  }
  ShmPolicy shm_policy() const {
    return ShmPolicy{options_.shared_memory, options_.shared_memory_rings};
  }

  const ServiceOptions options_;
  std::atomic<ParameterStore*> store_{nullptr};
  std::atomic<const ShardCheckpointer*> checkpoints_{nullptr};
  std::atomic<uint64_t> push_streams_{0};  // PushPull calls opened
  // PushPull and Pull calls with a shared-memory region.
  std::atomic<uint64_t> shm_streams_{0};
  std::atomic<uint64_t> shm_ring_streams_{0};  // of them, with rings
  // Shared by the streams, which the service outlives.
  ShmCounters shm_counters_;
  ReplyFaults faults_{options_.drop_reply_every};
  // Pull regions, mapped once per worker region rather than per Pull.
  RegionCache pull_regions_;
  mutable absl::Mutex mu_;
  std::string waiting_ ABSL_GUARDED_BY(mu_) = "starting";
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PARAMETER_SERVICE_H_
