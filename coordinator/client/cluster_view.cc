#include "coordinator/client/cluster_view.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardps::coordinator {

ViewCounts CountMembers(const v1::ClusterView& view) {
  ViewCounts c;
  for (const v1::ServerSlot& s : view.servers()) c.alive_servers += s.alive();
  for (const v1::WorkerSlot& w : view.workers()) {
    c.alive_workers += w.alive();
    c.finished_workers += w.finished();
  }
  return c;
}

bool ReadyToTrain(const v1::ClusterView& view) {
  const ViewCounts c = CountMembers(view);
  return view.num_shards() > 0 && view.num_workers() > 0 &&
         c.alive_servers == static_cast<int>(view.num_shards()) &&
         c.alive_workers + c.finished_workers ==
             static_cast<int>(view.num_workers());
}

std::string DescribeView(const v1::ClusterView& view) {
  const ViewCounts c = CountMembers(view);
  std::string text =
      absl::StrFormat("generation %d: servers %d/%d alive, workers %d/%d alive",
                      view.generation(), c.alive_servers, view.num_shards(),
                      c.alive_workers, view.num_workers());
  if (c.finished_workers > 0) {
    absl::StrAppend(&text, ", ", c.finished_workers, " finished");
  }
  if (view.job_finished()) {
    absl::StrAppend(&text, "; job finished");
  } else if (view.complete()) {
    absl::StrAppend(&text, "; complete");
  }
  return text;
}

}  // namespace shardps::coordinator
