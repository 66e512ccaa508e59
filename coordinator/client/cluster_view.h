// Reading a coordinator's ClusterView (coordinator.proto): who is there,
// whether the job can train, and a one-line description for daemons' logs.
// Pure functions.
#ifndef SHARDPS_COORDINATOR_CLIENT_CLUSTER_VIEW_H_
#define SHARDPS_COORDINATOR_CLIENT_CLUSTER_VIEW_H_

#include <string>

#include "shardps/v1/coordinator.pb.h"

namespace shardps::coordinator {

// Counts of one view, for logs and for waits.
struct ViewCounts {
  int alive_servers = 0;
  int alive_workers = 0;
  int finished_workers = 0;
};
ViewCounts CountMembers(const v1::ClusterView& view);
// Every server slot is alive and every worker slot is alive or finished:
// the job can train (a worker that finished early does not hold it up).
bool ReadyToTrain(const v1::ClusterView& view);
// "generation 5: servers 2/2 alive, workers 1/2 alive, 1 finished".
std::string DescribeView(const v1::ClusterView& view);

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_CLIENT_CLUSTER_VIEW_H_
