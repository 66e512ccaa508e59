#include "coordinator/coordinator_metrics.h"

#include <algorithm>
#include <string>

namespace shardps::coordinator {
namespace {

const char* EventName(MembershipEvent::Kind kind) {
  switch (kind) {
    case MembershipEvent::Kind::kJoined:
      return "joined";
    case MembershipEvent::Kind::kReplaced:
      return "replaced";
    case MembershipEvent::Kind::kLeft:
      return "left";
    case MembershipEvent::Kind::kExpired:
      return "expired";
    case MembershipEvent::Kind::kRejected:
      return "rejected";
    case MembershipEvent::Kind::kFinished:
      return "finished";
    case MembershipEvent::Kind::kJobFinished:
      return "job_finished";
    case MembershipEvent::Kind::kRollback:
      return "rollback";
  }
  return "unknown";
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(MetricsExporter* exporter,
                                       const Membership* membership)
    : heartbeats_(prometheus::BuildCounter()
                      .Name("shardps_coordinator_heartbeats_total")
                      .Help("Heartbeat and ReportProgress calls received.")
                      .Register(exporter->registry())
                      .Add({})),
      events_(prometheus::BuildCounter()
                  .Name("shardps_coordinator_membership_events_total")
                  .Help("Membership changes by event: joined, replaced, "
                        "left, expired, rejected, finished, job_finished.")
                  .Register(exporter->registry())),
      members_(prometheus::BuildGauge()
                   .Name("shardps_coordinator_members")
                   .Help("Live members by role.")
                   .Register(exporter->registry())),
      servers_(members_.Add({{"role", "server"}})),
      workers_(members_.Add({{"role", "worker"}})),
      finished_workers_(AddGauge(exporter->registry(),
                                 "shardps_coordinator_finished_workers",
                                 "Worker ranks that finished their training.")),
      generation_(AddGauge(exporter->registry(),
                           "shardps_coordinator_generation",
                           "Cluster generation (bumps at every membership "
                           "change).")),
      global_step_(AddGauge(exporter->registry(),
                            "shardps_coordinator_global_step",
                            "Largest step any member reported.")),
      epoch_(AddGauge(exporter->registry(), "shardps_coordinator_epoch",
                      "Largest epoch any member reported.")),
      job_finished_(AddGauge(exporter->registry(),
                             "shardps_coordinator_job_finished",
                             "1 once every worker finished, else 0.")),
      hook_(exporter->OnScrape([this, membership] { Refresh(*membership); })) {
  for (auto kind :
       {MembershipEvent::Kind::kJoined, MembershipEvent::Kind::kLeft,
        MembershipEvent::Kind::kExpired}) {
    events_.Add({{"event", EventName(kind)}});  // present from the start
  }
}

void CoordinatorMetrics::Event(const MembershipEvent& event) {
  events_.Add({{"event", EventName(event.kind)}}).Increment();
}

void CoordinatorMetrics::Refresh(const Membership& membership) {
  const v1::ClusterView view = membership.View();
  servers_.Set(static_cast<double>(
      std::count_if(view.servers().begin(), view.servers().end(),
                    [](const v1::ServerSlot& s) { return s.alive(); })));
  workers_.Set(static_cast<double>(
      std::count_if(view.workers().begin(), view.workers().end(),
                    [](const v1::WorkerSlot& w) { return w.alive(); })));
  finished_workers_.Set(static_cast<double>(
      std::count_if(view.workers().begin(), view.workers().end(),
                    [](const v1::WorkerSlot& w) { return w.finished(); })));
  generation_.Set(static_cast<double>(view.generation()));
  global_step_.Set(static_cast<double>(view.global_step()));
  epoch_.Set(static_cast<double>(view.epoch()));
  job_finished_.Set(view.job_finished() ? 1 : 0);
}

}  // namespace shardps::coordinator
