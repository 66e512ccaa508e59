// The operations behind shardps-ctl: a job's status from the coordinator, a
// daemon's gRPC health, parameter shards' GetStatus, each rendered as a plain
// text table. Every RPC has a deadline and goes over a channel with the given
// SecurityOptions (TLS, client certificate, bearer token). Functions are
// thread-compatible.
#ifndef SHARDPS_SERVER_CTL_H_
#define SHARDPS_SERVER_CTL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "shardps/v1/coordinator.pb.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::ctl {

// Coordinator.GetJobStatus at `coordinator` (host:port). The gRPC error
// (UNAVAILABLE, DEADLINE_EXCEEDED, ...) with the address in its message.
absl::StatusOr<v1::JobStatus> FetchJobStatus(const std::string& coordinator,
                                             const SecurityOptions& security,
                                             absl::Duration timeout);
// Header lines (job, generation, completeness, progress) and a table with
// one row per server slot and worker slot.
std::string FormatJobStatus(const v1::JobStatus& status);

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class HealthState { kUnknown = 0, kServing = 1, kNotServing = 2 };
// "SERVING", "NOT_SERVING", "UNKNOWN".
std::string HealthStateName(HealthState state);

// grpc.health.v1.Health/Check for `service` ("" = the whole server). Errors:
// UNAVAILABLE or DEADLINE_EXCEEDED when unreachable, NOT_FOUND when the
// server does not know `service`, UNIMPLEMENTED without a health service.
absl::StatusOr<HealthState> CheckHealth(const std::string& address,
                                        const std::string& service,
                                        const SecurityOptions& security,
                                        absl::Duration timeout);
// The wire form of HealthCheckRequest{service} (Debian ships no health
// .pb.h), and the reverse for HealthCheckResponse; InvalidArgument when
// `bytes` is not a valid message.
std::string EncodeHealthCheckRequest(absl::string_view service);
absl::StatusOr<HealthState> DecodeHealthCheckResponse(absl::string_view bytes);

// One parameter shard's ParameterServer.GetStatus, or why it failed.
struct ShardReport {
  std::string address;
  absl::StatusOr<v1::GetStatusResponse> status;
};
// Asks every address, in order, each with its own deadline.
std::vector<ShardReport> FetchShardReports(
    const std::vector<std::string>& addresses, const SecurityOptions& security,
    absl::Duration timeout);
// One row per shard; failures are rows that show the error.
std::string FormatShardReports(const std::vector<ShardReport>& reports);

// Left-aligned columns two spaces apart, sized by the rows as long as the
// first (the header); a shorter row's last cell may run past its column.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows);

}  // namespace shardps::ctl

#endif  // SHARDPS_SERVER_CTL_H_
