#include "common/grpc_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(GrpcServerTest, ListenAddressBracketsIpv6Hosts) {
  EXPECT_EQ(ListenAddress("127.0.0.1", 7000), "127.0.0.1:7000");
  EXPECT_EQ(ListenAddress("::1", 7000), "[::1]:7000");
  EXPECT_EQ(ListenAddress("[::1]", 7000), "[::1]:7000");
  EXPECT_EQ(ListenAddress("localhost", 0), "localhost:0");
}

TEST(GrpcServerTest, ListensOnTheBoundPortWithHealth) {
  GrpcServerOptions options;  // 127.0.0.1, port 0, plaintext
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT(port, 0);
  EXPECT_NE((*server)->GetHealthCheckService(), nullptr);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  EXPECT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(10)));
  (*server)->Shutdown();
}

TEST(GrpcServerTest, APortInUseIsUnavailableNamingTheAddress) {
  // A listening socket without SO_REUSEPORT: gRPC cannot share its port.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  GrpcServerOptions options;
  options.port = ntohs(addr.sin_port);
  int port = -1;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ::close(fd);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(
      server.status().message(),
      absl::StrCat("cannot listen on 127.0.0.1:", options.port)))
      << server.status();
}

}  // namespace
}  // namespace shardps
