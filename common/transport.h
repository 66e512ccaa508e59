// gRPC settings for the tensor data path, shared by servers and clients:
// message size limits derived from the chunk size, and HTTP/2 windows and
// frames sized for multi-MiB messages.
#ifndef SHARDPS_COMMON_TRANSPORT_H_
#define SHARDPS_COMMON_TRANSPORT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace shardps {

// Largest message either side accepts: the largest chunk plus room for the
// request's other fields.
inline constexpr int kMessageOverheadBytes = 64 << 10;

// Applies the data-path settings to a server. `max_message_bytes` bounds
// every received message; larger ones fail with RESOURCE_EXHAUSTED.
void ConfigureServer(grpc::ServerBuilder* builder, int max_message_bytes);

// The TCP receive buffer (as the kernel counts it, overhead included) a
// data-path server gives each connection when its link carries
// `bits_per_second`: what the link carries in kReceiveBufferLinkTime.
// Connections advertise about half of it as their window, so a worker alone
// keeps over a millisecond of the link in flight (a LAN's round trip is
// 0.1-0.5 ms) while four pushing at once keep about 5 ms, what a switch
// port's queue holds, instead of growing their windows until it overflows
// (incast; measured in docs/emulated_hosts.md).
inline constexpr double kReceiveBufferLinkTimeSeconds = 0.0025;
int ReceiveBufferBytesForLink(int64_t bits_per_second);

// Gives socket `fd` a receive buffer of `bytes` (as the kernel counts it;
// at least 4 KiB), which turns the kernel's receive-buffer autotuning off
// for it: SO_RCVBUFFORCE where the process may (CAP_NET_ADMIN), else
// SO_RCVBUF within net.core.rmem_max. InvalidArgument for bytes < 4 KiB;
// FailedPrecondition, changing nothing, when net.core.rmem_max allows less
// and the process may not exceed it; Internal when setsockopt fails.
absl::Status SetReceiveBuffer(int fd, int bytes);

// Whether this process can give sockets `bytes` of receive buffer
// (SetReceiveBuffer on a socket of its own, then closed): its errors.
absl::Status CheckReceiveBuffer(int bytes);

// SetReceiveBuffer on the socket(s) of this process listening on TCP
// `port`: the connections they accept from then on inherit the buffer.
// NotFound when nothing listens on the port; else SetReceiveBuffer's
// errors (the first socket's: nothing changed).
absl::Status SetListenerReceiveBuffer(int port, int bytes);

// Tunes the C allocator for multi-MiB message buffers. Call first thing in
// main of every process that moves tensors (daemons, benchmarks).
void ConfigureProcessMemory();

// Channel arguments for a client of the data path. `channel_index` makes
// channels to the same target distinct connections.
// `receive_buffer_bytes` > 0: every connection the channel makes gets
// that TCP receive buffer before it connects (SetReceiveBuffer; a
// connection is not made when it cannot be set: check first with
// CheckReceiveBuffer); 0: the kernel's.
grpc::ChannelArguments ClientChannelArguments(int max_message_bytes,
                                              int channel_index,
                                              int receive_buffer_bytes = 0);

}  // namespace shardps

#endif  // SHARDPS_COMMON_TRANSPORT_H_
