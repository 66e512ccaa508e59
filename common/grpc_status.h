// Conversion between absl::Status (inside shardps) and grpc::Status (on the
// wire). Statuses cross the wire only through these two functions.
#ifndef SHARDPS_COMMON_GRPC_STATUS_H_
#define SHARDPS_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace shardps {

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

// True for codes a caller may retry with backoff (UNAVAILABLE,
// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED from flow control is not retried).
bool IsRetryable(const absl::Status& s);

}  // namespace shardps

#endif  // SHARDPS_COMMON_GRPC_STATUS_H_
