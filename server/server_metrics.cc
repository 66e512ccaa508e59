#include "server/server_metrics.h"

#include <string>

#include "server/shard_checkpointer.h"

namespace shardps::server {

ServerMetrics::ServerMetrics(prometheus::Registry& r)
    : rejected_(prometheus::BuildCounter()
                    .Name("shardps_server_rejected_requests_total")
                    .Help("Pushes and pulls refused, by gRPC status code.")
                    .Register(r)),
      pushes_(AddCounter(r, "shardps_server_pushes_total",
                         "Gradient chunks accepted (PushPull and Push).")),
      pulls_(AddCounter(r, "shardps_server_pulls_total",
                        "Weight chunks read by Pull.")),
      received_bytes_(AddCounter(r, "shardps_server_received_bytes_total",
                                 "Gradient payload bytes accepted (on the "
                                 "wire, after compression).")),
      received_fp32_bytes_(AddCounter(
          r, "shardps_server_received_fp32_bytes_total",
          "The accepted gradients' bytes as fp32 (before compression).")),
      sent_bytes_(AddCounter(r, "shardps_server_sent_bytes_total",
                             "Weight payload bytes sent (PushPull replies and "
                             "Pull, as encoded).")),
      sent_fp32_bytes_(AddCounter(r, "shardps_server_sent_fp32_bytes_total",
                                  "The sent weights' bytes as fp32.")),
      speculative_(prometheus::BuildCounter()
                       .Name("shardps_server_speculative_updates_total")
                       .Help("Two-phase steps' speculative chunk updates "
                             "(speculative weights): kept (the step did not "
                             "clip or skip) or recomputed.")
                       .Register(r)),
      speculation_kept_(speculative_.Add({{"outcome", "kept"}})),
      speculation_recomputed_(speculative_.Add({{"outcome", "recomputed"}})),
      step_seconds_(AddHistogram(r, "shardps_server_step_seconds",
                                 "Sync mode: from the first push of a chunk's "
                                 "step to its update being applied.",
                                 LatencyBuckets())),
      aggregation_seconds_(AddHistogram(
          r, "shardps_server_aggregation_seconds",
          "Reduce plus optimizer update of one chunk.", LatencyBuckets())),
      staleness_steps_(
          AddHistogram(r, "shardps_server_staleness_steps",
                       "Async and ssp modes: steps a push is behind "
                       "the most advanced worker's last push.",
                       CountBuckets())),
      step_(AddGauge(r, "shardps_server_step",
                     "Step every owned chunk has completed (lowest version).")),
      generation_(AddGauge(r, "shardps_server_generation",
                           "Cluster generation: the coordinator's view (0 in a "
                           "static job).")),
      live_workers_(AddGauge(r, "shardps_server_live_workers",
                             "Live workers: the coordinator's view, or "
                             "--num_workers in static mode.")),
      receive_budget_(AddGauge(r, "shardps_server_receive_budget_bytes",
                               "The receive budget (--max_inflight_mib; 0: "
                               "none): bytes of pushes being read and early "
                               "gradients the shard may hold.")),
      receive_budget_peak_(
          AddGauge(r, "shardps_server_receive_budget_peak_bytes",
                   "The most the receive budget held at once since the "
                   "shard started (past it only by reads of the rank a sum "
                   "needs next).")),
      receive_budget_waited_(
          AddGauge(r, "shardps_server_receive_budget_waited_reads",
                   "Reads the receive budget made wait since the shard "
                   "started (their senders waited meanwhile).")),
      checkpoint_seconds_(
          AddHistogram(r, "shardps_checkpoint_duration_seconds",
                       "Writing this shard's checkpoint file, fsync included.",
                       LatencyBuckets())),
      checkpoint_bytes_(AddCounter(r, "shardps_checkpoint_bytes_total",
                                   "Bytes of checkpoint files written.")),
      checkpoint_failures_(prometheus::BuildCounter()
                               .Name("shardps_checkpoint_failures_total")
                               .Help("Checkpoints not written, by reason: "
                                     "skipped (the previous one was still "
                                     "being written) or error.")
                               .Register(r)),
      last_written_step_(AddGauge(r, "shardps_checkpoint_last_written_step",
                                  "Step of this shard's newest checkpoint file "
                                  "(0: none).")),
      last_committed_step_(AddGauge(
          r, "shardps_checkpoint_last_committed_step",
          "Newest checkpoint step this shard committed or restored (the last "
          "shard to write a step commits it; the job's is the max over "
          "shards; 0: none).")) {}

void ServerMetrics::Rejected(const absl::Status& status) {
  rejected_.Add({{"code", absl::StatusCodeToString(status.code())}})
      .Increment();
}

void ServerMetrics::CheckpointDone(
    const absl::StatusOr<CheckpointWrite>& write) {
  if (!write.ok()) {
    const bool skipped =
        write.status().code() == absl::StatusCode::kResourceExhausted;
    checkpoint_failures_.Add({{"reason", skipped ? "skipped" : "error"}})
        .Increment();
    return;
  }
  checkpoint_seconds_.Observe(write->seconds);
  checkpoint_bytes_.Increment(static_cast<double>(write->bytes));
  last_written_step_.Set(static_cast<double>(write->step));
  if (write->committed) {
    last_committed_step_.Set(static_cast<double>(write->step));
  }
}

}  // namespace shardps::server
