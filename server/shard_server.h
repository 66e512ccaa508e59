// A running parameter shard: the ParameterStore, its gRPC service, the health
// service and reflection, listening on one port. Used by shardps-server and by
// tests that want a shard in-process.
#ifndef SHARDPS_SERVER_SHARD_SERVER_H_
#define SHARDPS_SERVER_SHARD_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "server/parameter_service.h"
#include "server/parameter_store.h"

namespace shardps::server {

struct ShardServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: the kernel picks a free port
  StoreOptions store;
  ServiceOptions service;
  // Largest message accepted (bigger ones get RESOURCE_EXHAUSTED).
  int max_message_bytes = 0;  // 0: kMaxChunkBytes + overhead
  // Bind with SO_REUSEPORT, so that the port may be held by a
  // PortReservation of this process (common/port_reservation.h).
  bool reuse_port = false;
};

class ShardServer {
 public:
  // InvalidArgument for inconsistent options; Unavailable if the address
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(
      const ShardServerOptions& options);
  ~ShardServer();

  int port() const { return port_; }
  ParameterStore* store() { return store_.get(); }
  // Stops accepting RPCs and cancels the ones in flight after `grace`.
  void Shutdown(absl::Duration grace);

 private:
  ShardServer() = default;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<ParameterService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Checks the options a server needs: shard index below num_shards, at least
// one worker, sane thread count.
absl::Status ValidateStoreOptions(const StoreOptions& options);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_H_
