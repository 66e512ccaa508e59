// A bounded wait for SIGINT or SIGTERM, for daemons that must also notice
// other reasons to stop (a finished job) while they wait. Only *_main.cc
// files include this; the signals must be blocked (BlockTerminationSignals).
#ifndef SHARDPS_COMMON_SIGNAL_WAIT_H_
#define SHARDPS_COMMON_SIGNAL_WAIT_H_

#include "absl/time/time.h"

namespace shardps {

// Waits up to `timeout` for SIGINT or SIGTERM and returns its number, or 0
// when none arrived in time. REQUIRES: both signals blocked in every thread,
// so that they wait as pending until taken here.
int WaitForTerminationSignalFor(absl::Duration timeout);

}  // namespace shardps

#endif  // SHARDPS_COMMON_SIGNAL_WAIT_H_
