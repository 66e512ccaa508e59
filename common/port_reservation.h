// Holds a TCP port for a gRPC server that must name its address before the
// server can be built: a parameter shard tells the coordinator its host:port
// and only then learns its shard index. The socket is bound with SO_REUSEPORT
// and never listens, so it takes no connections, keeps other programs off the
// port, and lets a gRPC server of this process bind the port with
// SO_REUSEPORT (GRPC_ARG_ALLOW_REUSEPORT) afterwards. Thread-compatible.
#ifndef SHARDPS_COMMON_PORT_RESERVATION_H_
#define SHARDPS_COMMON_PORT_RESERVATION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace shardps {

class PortReservation {
 public:
  // Binds `host` (an address or a name; "[::]" style brackets allowed) at
  // `port`, or at a free port the kernel picks when `port` is 0.
  // InvalidArgument for a host that does not resolve or a port outside
  // [0, 65535]; Unavailable when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<PortReservation>> Reserve(
      const std::string& host, int port);
  // Releases the port (a server bound to it keeps it).
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }

 private:
  PortReservation(int fd, int port) : fd_(fd), port_(port) {}
  const int fd_;
  const int port_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_PORT_RESERVATION_H_
