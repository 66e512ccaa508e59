// Bringing up a daemon's gRPC server: the listening address, TLS and tokens,
// the standard health service and reflection, in one place for the shard and
// the coordinator. Thread-compatible: call from the daemon's main thread.
#ifndef SHARDPS_COMMON_GRPC_SERVER_H_
#define SHARDPS_COMMON_GRPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "grpcpp/server.h"

namespace shardps {

struct GrpcServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: the kernel picks a free port
  // TLS, client certificates and the bearer token (default: plaintext).
  SecurityOptions security;
  // > 0: the data path's settings (common/transport.h) with this message
  // limit; 0: gRPC's defaults (control-plane servers).
  int max_message_bytes = 0;
  // > 0: every connection accepted gets this TCP receive buffer
  // (SetListenerReceiveBuffer in common/transport.h); 0: the kernel's
  // autotuning.
  int receive_buffer_bytes = 0;
};

// "host:port", with an IPv6 literal host in brackets ("[::1]:7000").
std::string ListenAddress(const std::string& host, int port);

// Starts a server on options.host:options.port serving `services` (borrowed:
// they must outlive the server), the gRPC health service (every service
// SERVING until the caller says otherwise) and reflection, and stores the
// bound port in *bound_port. Unavailable "cannot listen on <address>" when
// the address cannot be bound; SetListenerReceiveBuffer's errors (no server
// left running) when the receive buffer cannot be set. REQUIRES:
// CheckServerSecurity(options.security) is OK.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const GrpcServerOptions& options,
    const std::vector<grpc::Service*>& services, int* bound_port);

}  // namespace shardps

#endif  // SHARDPS_COMMON_GRPC_SERVER_H_
