// Constants of the coordinator protocol (proto/shardps/v1/coordinator.proto)
// that servers, workers and the coordinator must agree on.
#ifndef SHARDPS_COORDINATOR_COORDINATOR_PROTOCOL_H_
#define SHARDPS_COORDINATOR_COORDINATOR_PROTOCOL_H_

#include <cstdint>

namespace shardps::coordinator {

// Sent in every JoinRequest.protocol_version; the coordinator refuses other
// values with FAILED_PRECONDITION. Bump it on incompatible changes of the
// Coordinator service's semantics.
inline constexpr uint32_t kCoordinatorProtocolVersion = 1;

// JoinRequest.requested_index for "any free index".
inline constexpr int32_t kAnyIndex = -1;

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_COORDINATOR_PROTOCOL_H_
