#include "common/grpc_server.h"

#include <dirent.h>
#include <linux/capability.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/transport.h"
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

// A TCP socket bound to a free port of 127.0.0.1, listening or not: its
// descriptor and port, or {-1, 0} on an error.
struct LoopbackSocket {
  int fd = -1;
  int port = 0;
};
LoopbackSocket BindLoopback(bool listen) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      (listen && ::listen(fd, 1) != 0) ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return {};
  }
  return {fd, ntohs(addr.sin_port)};
}

TEST(GrpcServerTest, APortInUseIsUnavailableNamingTheAddress) {
  // A listening socket without SO_REUSEPORT: gRPC cannot share its port.
  const LoopbackSocket taken = BindLoopback(/*listen=*/true);
  ASSERT_GE(taken.fd, 0);
  GrpcServerOptions options;
  options.port = taken.port;
  int port = -1;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ::close(taken.fd);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(
      server.status().message(),
      absl::StrCat("cannot listen on 127.0.0.1:", options.port)))
      << server.status();
}

// Which of this process's TCP sockets on a port ReceiveBuffersOnPort reads.
enum class Side {
  kListening,  // listening on it
  kAccepted,   // accepted on it
  kClient,     // connected to it
};

// SO_RCVBUF of this process's TCP sockets on `port` (IPv4, or IPv6 as gRPC
// binds 127.0.0.1: v4-mapped), on the given side.
std::vector<int> ReceiveBuffersOnPort(int port, Side side) {
  std::vector<int> buffers;
  DIR* dir = opendir("/proc/self/fd");
  while (const dirent* entry = readdir(dir)) {
    int fd = -1;
    struct stat st {};
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir) ||
        fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
      continue;
    }
    sockaddr_in6 address{};  // sin6_port sits where sin_port does
    socklen_t length = sizeof(address);
    int accepting = 0;
    socklen_t accepting_length = sizeof(accepting);
    const int got =
        side == Side::kClient
            ? getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)
            : getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    if (got != 0 ||
        (address.sin6_family != AF_INET && address.sin6_family != AF_INET6) ||
        ntohs(address.sin6_port) != port ||
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting,
                   &accepting_length) != 0 ||
        (accepting != 0) != (side == Side::kListening)) {
      continue;
    }
    int bytes = 0;
    length = sizeof(bytes);
    if (getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, &length) == 0) {
      buffers.push_back(bytes);
    }
  }
  closedir(dir);
  return buffers;
}

TEST(GrpcServerTest, ConnectionsGetTheReceiveBufferAsked) {
  // 100 Mbit/s: 2.5 ms of it, as the kernel counts it (it doubles what
  // SO_RCVBUF is given).
  const int bytes = ReceiveBufferBytesForLink(100'000'000);
  EXPECT_EQ(bytes, 31250);
  GrpcServerOptions options;
  options.receive_buffer_bytes = bytes;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(ReceiveBuffersOnPort(port, Side::kListening),
            std::vector<int>{bytes / 2 * 2});
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(10)));
  // The connection the server accepted inherits it (autotuning off).
  EXPECT_EQ(ReceiveBuffersOnPort(port, Side::kAccepted),
            std::vector<int>{bytes / 2 * 2});
  (*server)->Shutdown();
}

TEST(GrpcServerTest, ClientChannelsGiveTheirConnectionsTheReceiveBufferAsked) {
  GrpcServerOptions options;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  const int bytes = ReceiveBufferBytesForLink(100'000'000);
  ASSERT_TRUE(CheckReceiveBuffer(bytes).ok());
  // Set by the channel's socket mutator before it connects.
  auto channel = grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(),
      ClientChannelArguments(1 << 20, 0, bytes));
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(10)));
  EXPECT_EQ(ReceiveBuffersOnPort(port, Side::kClient),
            std::vector<int>{bytes / 2 * 2});
  // Without one, another connection keeps the kernel's.
  auto plain = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                         grpc::InsecureChannelCredentials(),
                                         ClientChannelArguments(1 << 20, 1));
  ASSERT_TRUE(plain->WaitForConnected(std::chrono::system_clock::now() +
                                      std::chrono::seconds(10)));
  std::vector<int> buffers = ReceiveBuffersOnPort(port, Side::kClient);
  std::sort(buffers.begin(), buffers.end());
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_EQ(buffers[0], bytes / 2 * 2);
  EXPECT_GT(buffers[1], bytes);
  (*server)->Shutdown();
}

TEST(GrpcServerTest, WithoutAReceiveBufferTheKernelsIsKept) {
  GrpcServerOptions options;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(options, {}, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::vector<int> buffers = ReceiveBuffersOnPort(port, Side::kListening);
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_NE(buffers[0], ReceiveBufferBytesForLink(100'000'000) / 2 * 2);
  (*server)->Shutdown();
}

TEST(GrpcServerTest, ReceiveBuffersRefuseWhatTheyCannotDo) {
  EXPECT_EQ(CheckReceiveBuffer(4095).code(),
            absl::StatusCode::kInvalidArgument);
  // A bound socket that does not listen is not a listener.
  const LoopbackSocket bound = BindLoopback(/*listen=*/false);
  ASSERT_GE(bound.fd, 0);
  const absl::Status status = SetListenerReceiveBuffer(bound.port, 1 << 16);
  ::close(bound.fd);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "listens on TCP port"))
      << status;
}

TEST(GrpcServerTest,
     AReceiveBufferOverRmemMaxWithoutCapNetAdminChangesNothing) {
  int64_t rmem_max = 0;
  std::ifstream("/proc/sys/net/core/rmem_max") >> rmem_max;
  if (rmem_max <= 0 || rmem_max > (1 << 28)) {
    GTEST_SKIP() << "net.core.rmem_max is " << rmem_max;
  }
  // In a child that drops its effective capabilities (a root run has
  // CAP_NET_ADMIN, which may exceed rmem_max), so that this process keeps
  // them. Exit codes name the check that failed.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2] = {};
    if (syscall(SYS_capget, &header, caps) != 0) _exit(10);
    caps[0].effective = caps[1].effective = 0;
    if (syscall(SYS_capset, &header, caps) != 0) _exit(11);
    const LoopbackSocket listener = BindLoopback(/*listen=*/true);
    if (listener.fd < 0) _exit(12);
    const std::vector<int> before =
        ReceiveBuffersOnPort(listener.port, Side::kListening);
    const absl::Status status = SetListenerReceiveBuffer(
        listener.port, static_cast<int>(2 * (rmem_max + 4096)));
    if (status.code() != absl::StatusCode::kFailedPrecondition) _exit(13);
    if (!absl::StrContains(status.message(), "net.core.rmem_max")) _exit(14);
    if (ReceiveBuffersOnPort(listener.port, Side::kListening) != before)
      _exit(15);
    // What a client checks before its channels connect.
    if (CheckReceiveBuffer(static_cast<int>(2 * (rmem_max + 4096))).code() !=
        absl::StatusCode::kFailedPrecondition) {
      _exit(16);
    }
    _exit(0);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(pid, &wait_status, 0), pid);
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 0)
      << "10-11: capabilities not dropped, 12: no listener, 13: not "
         "FailedPrecondition, 14: rmem_max not named, 15: buffer changed, 16: "
         "the client's check passed";
}

}  // namespace
}  // namespace shardps
