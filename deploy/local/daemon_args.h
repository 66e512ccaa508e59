// The command lines shardps-local gives the daemons of a job: with a
// coordinator, servers and workers get --coordinator and keep their index;
// in static mode they get the job's shape and the servers' addresses.
// Servers also get the checkpoint flags, workers the extra test arguments;
// every daemon gets the security flags. With emulate_hosts, the coordinator
// and servers bind their host's address, shared memory is off, servers get
// the links' rate (--link_rate) and workers get it unless the user gave one.
// Pure functions.
#ifndef SHARDPS_DEPLOY_LOCAL_DAEMON_ARGS_H_
#define SHARDPS_DEPLOY_LOCAL_DAEMON_ARGS_H_

#include <string>
#include <vector>

#include "deploy/local/launch_options.h"
#include "deploy/local/run_dir.h"

namespace shardps::local {

// shardps-coordinator, named "coordinator" in `dir`, listening on `port`
// (0: any; a restarted coordinator keeps its port, which members know).
std::vector<std::string> CoordinatorArgs(const LaunchOptions& options,
                                         const RunDir& dir, int port);
// shardps-server of shard `index`, named "server-<index>". `coordinator`:
// host:port, or empty in static mode.
std::vector<std::string> ServerArgs(const LaunchOptions& options,
                                    const RunDir& dir, int index,
                                    const std::string& coordinator);
// shardps-worker of `rank`, named "worker-<rank>". Every worker gets the
// metrics and model paths; the lead writes them. `servers` (shard order)
// only in static mode.
std::vector<std::string> WorkerArgs(const LaunchOptions& options,
                                    const RunDir& dir, int rank,
                                    const std::string& coordinator,
                                    const std::vector<std::string>& servers);

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_DAEMON_ARGS_H_
