// The ParameterServer gRPC service of one shard: thin callback handlers that
// validate requests and hand them to a ParameterStore. PushPull and Pull use
// raw byte buffers (common/wire.h) so weights are sent without copies. Replies
// of a PushPull stream are written in completion order, one write at a time.
#ifndef SHARDPS_SERVER_PARAMETER_SERVICE_H_
#define SHARDPS_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <cstdint>

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
  // The shard's checkpoints, reported by GetStatus; null: the shard writes
  // none. Must outlive the service.
  const ShardCheckpointer* checkpoints = nullptr;
};

// `store` must outlive the service and every RPC it started.
class ParameterService final
    : public v1::ParameterServer::WithCallbackMethod_Declare<
          v1::ParameterServer::WithRawCallbackMethod_PushPull<
              v1::ParameterServer::WithRawCallbackMethod_Pull<
                  v1::ParameterServer::WithCallbackMethod_GetStatus<
                      v1::ParameterServer::WithCallbackMethod_Checkpoint<
                          v1::ParameterServer::Service>>>>> {
 public:
  ParameterService(ParameterStore* store, ServiceOptions options)
      : store_(store), options_(options) {}

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

  // True when this reply should be dropped (fault injection).
  bool DropNextReply();
  ServerMetrics* metrics() const { return options_.metrics; }

 private:
  ParameterStore* const store_;
  const ServiceOptions options_;
  std::atomic<int64_t> replies_{0};
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PARAMETER_SERVICE_H_
