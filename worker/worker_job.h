// One worker's part in a job. Static: the servers, the rank and the job's
// size are given. With a coordinator: the worker joins the job there, takes
// its rank, the job's size and the servers' addresses from the coordinator's
// view, waits until the job can take it, trains, and tells the coordinator it
// finished (or leaves, after a failure). Who leads (evaluates, writes the
// metrics and the model) and when a worker may start are pure functions of
// the coordinator's view, below.
#ifndef SHARDPS_WORKER_WORKER_JOB_H_
#define SHARDPS_WORKER_WORKER_JOB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "coordinator/client/coordinator_client.h"
#include "worker/client.h"
#include "worker/compression.h"
#include "worker/trainer.h"

namespace shardps::worker {

// Workers alive in `view`, ascending.
std::vector<uint32_t> AliveRanks(const v1::ClusterView& view);

// The lowest rank still in the job (alive, or finished its training): it
// evaluates and writes the metrics and the model. `self` counts as alive
// (its own view may not show it yet).
uint32_t LeadRank(const v1::ClusterView& view, uint32_t self);

// A job can take this worker: every member is there (the first workers
// start together), or the job is under way and every shard is up (a worker
// joining a running job does not wait for ranks that left).
bool ReadyToJoin(const v1::ClusterView& view);

// Waits until ReadyToJoin(view) and returns the servers' addresses in shard
// order, logging what it waits for every `log_every`. DeadlineExceeded
// after `timeout`.
absl::StatusOr<std::vector<std::string>> WaitForCluster(
    const coordinator::CoordinatorClient& client, absl::Duration timeout,
    absl::Duration log_every = absl::Seconds(3));

// Joins job `job_id` at `coordinator` (host:port) as a worker asking for
// `rank` (-1: any free one), retrying and logging while the coordinator is
// not up yet, until `timeout`; the client then heartbeats in the
// background. See coordinator::JoinJob for the codes.
absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> JoinAsWorker(
    const std::string& coordinator, const std::string& job_id, int32_t rank,
    uint64_t incarnation, const SecurityOptions& security,
    const std::string& label, absl::Duration timeout);

// This process, for the coordinator: its incarnation (the time now: call
// once, at the start, so that a restarted worker's is larger) and a label
// (host/pid).
uint64_t ProcessIncarnation();
std::string ProcessLabel();

struct WorkerJobOptions {
  // Static mode: the servers (shard order), this worker's rank (-1: 0) and
  // the job's size (unset: 1).
  std::vector<std::string> servers;
  int32_t rank = -1;
  std::optional<uint32_t> num_workers;
  // With a coordinator (host:port; empty: static mode): the job to join,
  // the rank asked for (-1: any free one) and, when set, the job size this
  // worker expects (FailedPrecondition when the job's differs).
  std::string coordinator;
  std::string job_id;
  uint64_t incarnation = 0;  // JoinRequest.incarnation
  std::string label;         // shown in the coordinator's view

  // The data: a LoadDatasetSpec spec, and how many samples to keep (0: all).
  std::string dataset;
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  std::string model;  // ParseModelSpec
  OptimizerFlags optimizer;
  std::string backend = "auto";  // auto | cpu | cuda
  int threads = 0;               // CPU backend threads (0: its default)
  int streams_per_shard = 2;
  int receive_buffer_bytes = 0;     // ClientOptions::receive_buffer_bytes
  bool shared_memory = true;        // ClientOptions::shared_memory
  bool speculative_weights = true;  // ClientOptions::speculative_weights
  Compression compression;          // on the wire (ClientOptions)
  // How long to wait for the servers to come up and, with a coordinator,
  // to join and for every member to join.
  absl::Duration connect_timeout = absl::Seconds(120);
  absl::Duration rpc_timeout = absl::Seconds(300);  // ClientOptions
  SecurityOptions security;
  // Training; rank, num_workers and the coordinator's functions (on_step,
  // active_ranks, lead, rollback) are filled in here.
  TrainerOptions trainer;
  // Told this worker's rank as soon as it is known (with a coordinator:
  // after joining), on the calling thread, before anything is logged under
  // it. May be empty.
  std::function<void(uint32_t rank)> on_rank;

  // A worker that failed leaves as a courtesy (its lease would expire
  // anyway): not for long.
  absl::Duration leave_timeout = absl::Seconds(3);
  // Telling the coordinator this worker finished is what ends the job:
  // worth waiting for.
  absl::Duration finish_timeout = absl::Seconds(60);
};

// The options of a job member's Client: `servers` (shard order), `rank` and
// `incarnation`, and the link settings that WorkerJobOptions and
// SessionOptions both carry under the same names (security, streams per
// shard, receive buffers, shared memory, timeouts, compression), so that
// shardps-worker and a
// Session make the same client.
template <typename MemberOptions>
ClientOptions MemberClientOptions(const MemberOptions& options,
                                  std::vector<std::string> servers,
                                  uint32_t rank, uint64_t incarnation) {
  ClientOptions co;
  co.servers = std::move(servers);
  co.rank = rank;
  co.incarnation = incarnation;
  co.security = options.security;
  co.streams_per_shard = options.streams_per_shard;
  co.receive_buffer_bytes = options.receive_buffer_bytes;
  co.shared_memory = options.shared_memory;
  co.speculative_weights = options.speculative_weights;
  co.connect_timeout = options.connect_timeout;
  co.rpc_timeout = options.rpc_timeout;
  co.compression = options.compression;
  return co;
}

// Runs this worker's part in the job to its end. InvalidArgument for bad
// options; otherwise the first error of joining, loading, training.
absl::Status RunWorker(WorkerJobOptions options);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_WORKER_JOB_H_
