// gRPC settings for the tensor data path, shared by servers and clients:
// message size limits derived from the chunk size, and HTTP/2 windows and
// frames sized for multi-MiB messages.
#ifndef SHARDPS_COMMON_TRANSPORT_H_
#define SHARDPS_COMMON_TRANSPORT_H_

#include <cstdint>

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace shardps {

// Largest message either side accepts: the largest chunk plus room for the
// request's other fields.
inline constexpr int kMessageOverheadBytes = 64 << 10;

// Applies the data-path settings to a server. `max_message_bytes` bounds
// every received message; larger ones fail with RESOURCE_EXHAUSTED.
void ConfigureServer(grpc::ServerBuilder* builder, int max_message_bytes);

// Tunes the C allocator for multi-MiB message buffers. Call first thing in
// main of every process that moves tensors (daemons, benchmarks).
void ConfigureProcessMemory();

// Channel arguments for a client of the data path. `channel_index` makes
// channels to the same target distinct connections.
grpc::ChannelArguments ClientChannelArguments(int max_message_bytes,
                                              int channel_index);

}  // namespace shardps

#endif  // SHARDPS_COMMON_TRANSPORT_H_
