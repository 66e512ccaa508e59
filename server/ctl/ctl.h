// The operations behind shardps-ctl: a job's status from the coordinator, a
// daemon's gRPC health, parameter shards' GetStatus, each rendered as a plain
// text table, and a checkpoint taken now. Every RPC has a deadline and goes
// over a channel with the given SecurityOptions (TLS, client certificate,
// bearer token). Functions are thread-compatible.
#ifndef SHARDPS_SERVER_CTL_CTL_H_
#define SHARDPS_SERVER_CTL_CTL_H_

#include <functional>
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

// The load of each shard for `status`: its step, chunks and bytes owned,
// pushes, updates, rejections, traffic and last committed checkpoint, one
// row per shard; failures are rows that show the error.
std::string FormatShardLoad(const std::vector<ShardReport>& reports);

// The addresses of the live servers in the coordinator's view, in shard
// index order.
std::vector<std::string> LiveServers(const v1::JobStatus& status);
// Every shard's server address, in shard index order; FailedPrecondition
// naming the shard when one has no live server.
absl::StatusOr<std::vector<std::string>> AllServers(
    const v1::JobStatus& status);

// The step a checkpoint asked for now can still be taken at: `margin` past
// the most advanced shard's step (sync shards are at most one step apart,
// so a margin of 2 leaves them one step to receive the request). The first
// report's error when a shard did not answer; FailedPrecondition when a
// shard writes no checkpoints or has no model yet.
absl::StatusOr<int64_t> NextCheckpointStep(
    const std::vector<ShardReport>& reports, int64_t margin);

// Where the checkpoint of `step` stands, from the shards' reports.
struct CheckpointWait {
  // Every shard reports `step`, or a later one, committed.
  bool committed = false;
  // Not OK when the checkpoint cannot come any more: a shard reports that
  // it failed or skipped `step` (Aborted, with its reason), or did not
  // answer (its error).
  absl::Status status;
  // One line: each shard's step and the last step it wrote.
  std::string line;
};
CheckpointWait CheckCheckpoint(const std::vector<ShardReport>& reports,
                               int64_t step);

struct CheckpointOptions {
  // The step to checkpoint at; 0 picks one (NextCheckpointStep), and a
  // later one when a shard has passed it before it was asked.
  int64_t step = 0;
  // Deadline of every RPC.
  absl::Duration rpc_timeout = absl::Seconds(5);
  // How long to wait for the commit.
  absl::Duration wait = absl::Minutes(10);
  absl::Duration poll_interval = absl::Milliseconds(200);
};
struct CheckpointResult {
  int64_t step = 0;
  std::string dir;  // the job's checkpoint directory
};
// Asks every shard at `servers` (all the job's shards) for a checkpoint and
// waits until it is committed, telling `progress` (may be empty) how it
// goes, one line at a time. Errors: those of NextCheckpointStep;
// OutOfRange when a given step is already past on a shard (or no picked
// step could be reached in time); Aborted when a shard failed to write it;
// DeadlineExceeded when it was not committed within `wait`.
absl::StatusOr<CheckpointResult> Checkpoint(
    const std::vector<std::string>& servers, const SecurityOptions& security,
    const CheckpointOptions& options,
    const std::function<void(const std::string&)>& progress);

// Left-aligned columns two spaces apart, sized by the rows as long as the
// first (the header); a shorter row's last cell may run past its column.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows);

}  // namespace shardps::ctl

#endif  // SHARDPS_SERVER_CTL_CTL_H_
