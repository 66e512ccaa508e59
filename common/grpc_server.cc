#include "common/grpc_server.h"

#include "absl/strings/str_cat.h"
#include "common/transport.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"

namespace shardps {

std::string ListenAddress(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos && host.front() != '[';
  return absl::StrCat(ipv6 ? absl::StrCat("[", host, "]") : host, ":", port);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const GrpcServerOptions& options,
    const std::vector<grpc::Service*>& services, int* bound_port) {
  // Process-wide switches, read by the builder: set before every build.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (options.max_message_bytes > 0) {
    ConfigureServer(&builder, options.max_message_bytes);
  }
  const std::string address = ListenAddress(options.host, options.port);
  *bound_port = 0;
  builder.AddListeningPort(address, MakeServerCredentials(options.security),
                           bound_port);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (options.receive_buffer_bytes > 0) {
    // Before anyone can know the port (it is not yet written or announced),
    // so every data-path connection is accepted with it.
    if (absl::Status status =
            SetListenerReceiveBuffer(*bound_port, options.receive_buffer_bytes);
        !status.ok()) {
      server->Shutdown();
      return status;
    }
  }
  return server;
}

}  // namespace shardps
