#include "common/transport.h"

#include <dirent.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "grpc/grpc.h"
#include "grpc/support/sync.h"

// gRPC 1.51 lets a channel set options on its sockets before they connect
// (ChannelArguments::SetSocketMutator) but declares the mutator's layout
// only in its own src/core/lib/iomgr/socket_mutator.h; these mirror it (the
// same since gRPC 1.30). grpc_server_test.cc checks the effect on a real
// connection.
struct grpc_socket_mutator_vtable {
  bool (*mutate_fd)(int fd, grpc_socket_mutator* mutator);
  int (*compare)(grpc_socket_mutator* a, grpc_socket_mutator* b);
  void (*destroy)(grpc_socket_mutator* mutator);
  bool (*mutate_fd_2)(const void* info, grpc_socket_mutator* mutator);
};
struct grpc_socket_mutator {
  const grpc_socket_mutator_vtable* vtable;
  gpr_refcount refcount;
};

namespace shardps {
namespace {

// Gives every socket of a channel a receive buffer.
struct ReceiveBufferMutator {
  grpc_socket_mutator base;  // first: gRPC holds a pointer to it
  int bytes = 0;
};

bool MutateReceiveBuffer(int fd, grpc_socket_mutator* mutator) {
  return SetReceiveBuffer(
             fd, reinterpret_cast<ReceiveBufferMutator*>(mutator)->bytes)
      .ok();
}
int CompareReceiveBuffers(grpc_socket_mutator* a, grpc_socket_mutator* b) {
  const int x = reinterpret_cast<ReceiveBufferMutator*>(a)->bytes;
  const int y = reinterpret_cast<ReceiveBufferMutator*>(b)->bytes;
  return (x > y) - (x < y);
}
void DestroyReceiveBufferMutator(grpc_socket_mutator* mutator) {
  delete reinterpret_cast<ReceiveBufferMutator*>(mutator);
}
constexpr grpc_socket_mutator_vtable kReceiveBufferVtable = {
    MutateReceiveBuffer, CompareReceiveBuffers, DestroyReceiveBufferMutator,
    nullptr};

grpc_socket_mutator* NewReceiveBufferMutator(int bytes) {
  auto* mutator = new ReceiveBufferMutator;
  mutator->base.vtable = &kReceiveBufferVtable;
  gpr_ref_init(&mutator->base.refcount, 1);
  mutator->bytes = bytes;
  return &mutator->base;
}

// HTTP/2 tuning for large messages on fast links: a 16 MiB frame limit and
// large flow-control windows let one stream carry a 4 MiB chunk without
// stalling for window updates every 64 KiB.
constexpr int kMaxFrameBytes = (16 << 20) - 1;  // the HTTP/2 maximum
constexpr int kLookaheadBytes = 64 << 20;
// What a server lets each push stream send ahead of what it has read:
// gRPC opens a stream's window to the rest of a message as soon as a read
// waits for it, so a stream being read gets its whole chunk at once and
// this bounds only what a stream between reads, or parked by the receive
// budget, leaves in gRPC's buffers. Fixed (no BDP probing, which grows
// windows without bound on fast links). Measured with shardps-bench scale
// (1 shard, 32 MiB model in 2 MiB chunks, 64 workers, 64 MiB budget):
// peak RSS 1137 MiB with an 8 MiB lookahead, 211 MiB with this one; step
// times and the fraction of a 1 Gbit/s link PushPull reaches unchanged.
constexpr int kServerLookaheadBytes = 64 << 10;
// The most a server's socket read takes at once, which is also the most a
// connection keeps allocated for its next read.
constexpr int kServerReadChunkBytes = 64 << 10;
constexpr int kKeepaliveMs = 10000;
constexpr int kMinReceiveBufferBytes = 4 << 10;

// The TCP port a socket is bound to, or -1 if it is not an IP socket.
int BoundPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return -1;
  }
  if (address.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
  }
  if (address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
  }
  return -1;
}

// This process's TCP sockets listening on `port`.
std::vector<int> ListeningSockets(int port) {
  std::vector<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (const dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir)) continue;
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int accepting = 0;
    socklen_t length = sizeof(accepting);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &length) != 0 ||
        accepting == 0) {
      continue;
    }
    if (BoundPort(fd) == port) fds.push_back(fd);
  }
  closedir(dir);
  return fds;
}

int64_t RmemMax() {
  std::ifstream in("/proc/sys/net/core/rmem_max");
  int64_t value = 0;
  in >> value;
  return in ? value : 0;
}

int ReceiveBuffer(int fd) {
  int bytes = 0;
  socklen_t length = sizeof(bytes);
  return getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, &length) == 0 ? bytes
                                                                     : -1;
}

}  // namespace

int ReceiveBufferBytesForLink(int64_t bits_per_second) {
  const double bytes =
      std::ceil(bits_per_second / 8.0 * kReceiveBufferLinkTimeSeconds);
  return static_cast<int>(
      std::clamp<double>(bytes, kMinReceiveBufferBytes, 1 << 30));
}

absl::Status SetReceiveBuffer(int fd, int bytes) {
  if (bytes < kMinReceiveBufferBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a receive buffer of ",
                                                   bytes, " bytes is under ",
                                                   kMinReceiveBufferBytes));
  }
  // The kernel doubles what it is given (its bookkeeping) and reads that
  // back; SO_RCVBUF stops at net.core.rmem_max, SO_RCVBUFFORCE does not.
  const int half = bytes / 2;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &half, sizeof(half)) == 0) {
    return absl::OkStatus();
  }
  if (errno != EPERM) {
    return absl::InternalError(
        absl::StrCat("setsockopt(SO_RCVBUFFORCE): ", strerror(errno)));
  }
  if (const int64_t rmem_max = RmemMax(); half > rmem_max) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot give connections a ", bytes >> 10,
        " KiB TCP receive buffer: net.core.rmem_max is ", rmem_max,
        " and this process may not exceed it (raise it with sysctl -w "
        "net.core.rmem_max=",
        half, ", or grant CAP_NET_ADMIN)"));
  }
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &half, sizeof(half)) != 0) {
    return absl::InternalError(
        absl::StrCat("setsockopt(SO_RCVBUF): ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status CheckReceiveBuffer(int bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  }
  const absl::Status status = SetReceiveBuffer(fd, bytes);
  close(fd);
  return status;
}

absl::Status SetListenerReceiveBuffer(int port, int bytes) {
  const std::vector<int> fds = ListeningSockets(port);
  if (fds.empty()) {
    return absl::NotFoundError(
        absl::StrCat("nothing in this process listens on TCP port ", port));
  }
  for (int fd : fds) {
    SHARDPS_RETURN_IF_ERROR(SetReceiveBuffer(fd, bytes));
    if (const int got = ReceiveBuffer(fd); got != bytes / 2 * 2) {
      return absl::InternalError(
          absl::StrCat("port ", port, "'s receive buffer is ", got,
                       " bytes, not ", bytes / 2 * 2, " as set"));
    }
  }
  return absl::OkStatus();
}

void ConfigureServer(grpc::ServerBuilder* builder, int max_message_bytes) {
  builder->SetMaxReceiveMessageSize(max_message_bytes);
  builder->SetMaxSendMessageSize(max_message_bytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                              kServerLookaheadBytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder->AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE,
                              kServerReadChunkBytes);
  builder->AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE,
                              kServerReadChunkBytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE,
                              kLookaheadBytes);
  // Let clients ping every few seconds to detect dead peers.
  builder->AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveMs / 2);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

void ConfigureProcessMemory() {
  // gRPC allocates a fresh multi-MiB buffer for every socket read. With
  // glibc's defaults those come from mmap (a page fault per 4 KiB, every
  // time) and freed memory scatters over per-thread arenas. One arena and a
  // 32 MiB mmap threshold reuse the same memory instead: measured with
  // shardps-bench transport (1 shard, 2 workers, 64 MiB model) this cut page
  // faults 8x, step time from 105 to 67 ms and the server's peak RSS from
  // 467 to 324 MiB.
  mallopt(M_ARENA_MAX, 1);
  // gRPC 1.51's tcp_read_chunks experiment (on by default) sizes each
  // connection's reads by a target that doubles after every large read and
  // ignores the read-size channel arguments, and keeps what a read did not
  // fill for the next: a few MiB a connection on fast links, so a shard's
  // memory grew with its workers (heaptrack, 64 workers: 222 MiB of read
  // slices). Without it reads take at most the channel's largest read chunk
  // (servers: kServerReadChunkBytes). Read by gRPC once, at its first use.
  const char* experiments = getenv("GRPC_EXPERIMENTS");
  if (experiments == nullptr || *experiments == '\0') {
    setenv("GRPC_EXPERIMENTS", "-tcp_read_chunks", 1);
  } else if (strstr(experiments, "tcp_read_chunks") == nullptr) {
    setenv("GRPC_EXPERIMENTS",
           absl::StrCat(experiments, ",-tcp_read_chunks").c_str(), 1);
  }
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

grpc::ChannelArguments ClientChannelArguments(int max_message_bytes,
                                              int channel_index,
                                              int receive_buffer_bytes) {
  grpc::ChannelArguments args;
  if (receive_buffer_bytes > 0) {
    // The arguments take a reference; this one is theirs to drop.
    args.SetSocketMutator(NewReceiveBufferMutator(receive_buffer_bytes));
  }
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookaheadBytes);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, kLookaheadBytes);
  // Without this, channels with equal arguments to one target share a
  // subchannel, i.e. one TCP connection.
  args.SetInt("shardps.channel_index", channel_index);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A peer that stops answering (a dead host, a stopped process) is noticed
  // within seconds, not at the kernel's TCP timeout.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Data-path RPCs fail fast while a peer is down; the client retries.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  return args;
}

}  // namespace shardps
