#include "common/port_reservation.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

// Binds a plain socket (no SO_REUSEPORT) to 127.0.0.1:port; returns errno.
int PlainBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int error = rc == 0 ? 0 : errno;
  close(fd);
  return error;
}

TEST(PortReservationTest, KeepsOthersOffButLetsGrpcBind) {
  absl::StatusOr<std::unique_ptr<PortReservation>> reserved =
      PortReservation::Reserve("127.0.0.1", 0);
  SHARDPS_ASSERT_OK(reserved);
  const int port = (*reserved)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ(PlainBind(port), EADDRINUSE);

  grpc::CallbackGenericService generic;  // a server needs a service
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&generic);
  int bound = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port),
                           grpc::InsecureServerCredentials(), &bound);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(bound, port);
  // Connections reach the server, not the reservation (which never listens).
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  EXPECT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(10)));
  reserved->reset();
  server->Shutdown();
}

TEST(PortReservationTest, RefusesBadHostsAndPorts) {
  EXPECT_EQ(PortReservation::Reserve("127.0.0.1", 70000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PortReservation::Reserve("no-such-host.invalid", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardps
