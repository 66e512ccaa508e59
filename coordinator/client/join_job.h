// Joining a job as one of its members, the way every daemon does it: create
// the coordinator client, then join with bounded retries until a deadline,
// telling the caller about each retry in one line for its log. Used by
// shardps-server (and meant for shardps-worker). Thread-compatible.
#ifndef SHARDPS_COORDINATOR_CLIENT_JOIN_JOB_H_
#define SHARDPS_COORDINATOR_CLIENT_JOIN_JOB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/client/coordinator_client.h"
#include "coordinator/coordinator_protocol.h"

namespace shardps::coordinator {

struct JoinOptions {
  // The coordinator's address, security, incarnation, restored step and
  // `cancelled` hook; its `on_retry` is replaced (see on_retry below).
  CoordinatorClientOptions client;
  v1::Role role = v1::ROLE_UNSPECIFIED;
  // What the coordinator shows for this member: host:port for a server.
  std::string address;
  int32_t requested_index = kAnyIndex;  // shard index or rank; kAnyIndex: any
  std::string job_id;
  // How long to keep trying (CoordinatorClient::Join's deadline is now plus
  // this).
  absl::Duration timeout = absl::Minutes(2);
  // Told "not joined yet (<reason>); retrying in <wait>" before each retry,
  // on the joining thread. May be empty.
  std::function<void(const std::string& line)> on_retry;
};

// A client joined to options.job_id (heartbeating and watching), or the
// error of CoordinatorClient::Create or Join: InvalidArgument for bad
// options, DeadlineExceeded once options.timeout passed, Cancelled when
// options.client.cancelled said stop, others as Join returns them.
absl::StatusOr<std::unique_ptr<CoordinatorClient>> JoinJob(JoinOptions options);

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_CLIENT_JOIN_JOB_H_
