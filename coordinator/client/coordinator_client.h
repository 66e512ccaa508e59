// A job member's link to the shardps-coordinator (coordinator.proto): joins
// with bounded retries, then keeps the membership alive from a heartbeat
// thread (rejoining when the coordinator forgot it) and keeps the latest
// ClusterView from a WatchCluster thread. Used by shardps-server and
// shardps-worker. Thread-safe; libraries built on it do not log.
#ifndef SHARDPS_COORDINATOR_CLIENT_COORDINATOR_CLIENT_H_
#define SHARDPS_COORDINATOR_CLIENT_COORDINATOR_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "coordinator/client/cluster_view.h"
#include "shardps/v1/coordinator.grpc.pb.h"

namespace shardps::coordinator {

struct CoordinatorClientOptions {
  std::string coordinator;  // host:port
  // TLS, client certificate and bearer token (default: plaintext).
  SecurityOptions security;
  // Deadline of every unary RPC, and the longest a watch stream stays open
  // before it is reopened is kWatchStreamLifetime (see the .cc).
  absl::Duration rpc_timeout = absl::Seconds(5);
  // Backoff between join attempts and between watch reconnects.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // Called on Join's thread before each retry with the reason and the wait
  // that follows, so that a daemon can log what it waits for. May be empty.
  std::function<void(const absl::Status& reason, absl::Duration wait)> on_retry;
  // Polled on Join's thread (about every 100 ms) while it waits between
  // attempts; true stops joining, and Join returns Cancelled. Lets a daemon
  // that takes SIGTERM synchronously stop while the coordinator is away.
  // May be empty.
  std::function<bool()> cancelled;
  // JoinRequest.incarnation: identifies this process across rejoins.
  uint64_t incarnation = 0;
  // Servers: the step of the checkpoint the shard restored at start
  // (JoinRequest.restored_step); -1: none.
  int64_t restored_step = -1;
};

class CoordinatorClient {
 public:
  // InvalidArgument for an empty address or a non-positive timeout.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(
      CoordinatorClientOptions options);
  // Stops the background threads. Does not leave: without Leave or Finish
  // the membership expires after the heartbeat timeout.
  ~CoordinatorClient();
  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  // Joins job `job_id` as `role` from `address` asking for
  // `requested_index` (kAnyIndex: any), then starts heartbeating and
  // watching. Retries with backoff until `deadline` while the coordinator
  // is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED), while the index is
  // still held by an old membership (ALREADY_EXISTS: a restart before the old
  // lease expired) and while every index is taken (RESOURCE_EXHAUSTED);
  // after that, DeadlineExceeded with the last reason. Other errors
  // (InvalidArgument, FailedPrecondition: wrong job id or protocol, job
  // finished) return at once; Cancelled when options.cancelled said so.
  // REQUIRES: not joined before.
  absl::Status Join(v1::Role role, const std::string& address,
                    int32_t requested_index, const std::string& job_id,
                    absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // The index (shard index or rank) the coordinator assigned. REQUIRES:
  // Join succeeded.
  uint32_t index() const ABSL_LOCKS_EXCLUDED(mu_);
  // The newest view seen (Join's answer, the watch, a rejoin).
  v1::ClusterView view() const ABSL_LOCKS_EXCLUDED(mu_);
  // The coordinator said the job finished (in a view or a heartbeat).
  bool job_finished() const ABSL_LOCKS_EXCLUDED(mu_);
  // OK while heartbeats succeed; otherwise the last failure (for logs).
  absl::Status health() const ABSL_LOCKS_EXCLUDED(mu_);
  // Times the membership was lost and joined again.
  int64_t rejoins() const ABSL_LOCKS_EXCLUDED(mu_);

  // The step and epoch the next heartbeats report (workers).
  void SetProgress(int64_t step, int64_t epoch) ABSL_LOCKS_EXCLUDED(mu_);

  // What the next heartbeats report as stalled (servers; empty: nothing).
  void SetStalled(std::string stalled) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until `ready` holds for the held view and returns that view;
  // DeadlineExceeded (with the view described) when `deadline` passes
  // first. `ready` runs under the client's lock: it must only read the view.
  absl::StatusOr<v1::ClusterView> WaitForView(
      const std::function<bool(const v1::ClusterView&)>& ready,
      absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);

  // One call of rpc Collective, as this member (rank and incarnation are
  // filled in): waits for the coordinator's answer until the request's
  // timeout_ms and a few seconds more (so that the coordinator's
  // DEADLINE_EXCEEDED, which names the ranks missing, comes first). Not
  // retried: a second call of a sequence would be refused. The codes of
  // rpc Collective; Unavailable when the coordinator is gone. REQUIRES:
  // Join succeeded.
  absl::StatusOr<v1::CollectiveResponse> Collective(
      v1::CollectiveRequest request) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops heartbeating and ends the membership (clean shutdown). One attempt
  // per rpc_timeout until `deadline`. NotFound when the coordinator had
  // already forgotten it (nothing left to end).
  absl::Status Leave(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // As Leave, for a worker that completed its training: its rank counts as
  // finished. If the coordinator forgot the membership, rejoins with the
  // same rank and finishes that. Retries UNAVAILABLE until `deadline`.
  absl::Status Finish(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit CoordinatorClient(CoordinatorClientOptions options);

  absl::StatusOr<v1::JoinResponse> JoinOnce(const v1::JoinRequest& request);
  // Waits until `until`, or less once the channel is connected; false when
  // options.cancelled says stop.
  bool WaitBeforeRetry(absl::Time until);
  // Records a successful (re)join.
  void Adopt(const v1::JoinResponse& response) ABSL_LOCKS_EXCLUDED(mu_);
  void StartThreads();
  void StopThreads() ABSL_LOCKS_EXCLUDED(mu_);
  void HeartbeatLoop();
  void Beat() ABSL_LOCKS_EXCLUDED(mu_);
  // Joins again with the held index after the coordinator forgot us.
  void Rejoin() ABSL_LOCKS_EXCLUDED(mu_);
  void WatchLoop();
  // Reads one WatchCluster stream until it ends. Returns whether it got a
  // view (so the next attempt starts without backoff).
  bool WatchOnce() ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `view` if it is newer than the held one, or `replace`.
  void Offer(const v1::ClusterView& view, bool replace)
      ABSL_LOCKS_EXCLUDED(mu_);
  void OfferLocked(const v1::ClusterView& view, bool replace)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the step and epoch last set, so that a finished job shows where
  // it ended even when no heartbeat carried them.
  void ReportFinalProgress() ABSL_LOCKS_EXCLUDED(mu_);
  // Leave or Finish after the threads stopped: retries UNAVAILABLE until
  // `deadline`; `finished` also rejoins a forgotten membership to finish it.
  absl::Status End(bool finished, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // One Leave RPC, with a deadline of rpc_timeout or `deadline`.
  absl::Status LeaveOnce(bool finished, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  const CoordinatorClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Coordinator::Stub> stub_;
  absl::Notification stop_;

  mutable absl::Mutex mu_;
  // The last join request, its requested index set to the one assigned:
  // what a rejoin sends.
  v1::JoinRequest request_ ABSL_GUARDED_BY(mu_);
  std::string member_id_ ABSL_GUARDED_BY(mu_);
  uint32_t index_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(1);
  v1::ClusterView view_ ABSL_GUARDED_BY(mu_);
  bool job_finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  int64_t rejoins_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::string stalled_ ABSL_GUARDED_BY(mu_);
  // The contexts of the open watch stream and of the heartbeat in flight, so
  // that StopThreads can cancel them (a heartbeat waits for an unreachable
  // coordinator up to rpc_timeout).
  grpc::ClientContext* watch_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  grpc::ClientContext* beat_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool threads_started_ ABSL_GUARDED_BY(mu_) = false;

  std::thread heartbeat_thread_;
  std::thread watch_thread_;
};

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_CLIENT_COORDINATOR_CLIENT_H_
