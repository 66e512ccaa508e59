// SIGINT and SIGTERM taken synchronously: a daemon blocks them first thing in
// main, then waits for them (for as long as it serves, or in bounded slices
// when it must also notice other reasons to stop, such as a finished job).
// Only *_main.cc files and the launcher include this.
#ifndef SHARDPS_COMMON_SIGNAL_WAIT_H_
#define SHARDPS_COMMON_SIGNAL_WAIT_H_

#include <initializer_list>

#include "absl/time/time.h"

namespace shardps {

// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts
// afterwards, and ignores SIGPIPE; call first thing in main. The waits below
// then receive them synchronously.
void BlockTerminationSignals();

// Waits until SIGINT or SIGTERM arrives and returns its number.
int WaitForTerminationSignal();

// Waits up to `timeout` for SIGINT or SIGTERM and returns its number, or 0
// when none arrived in time. REQUIRES: both signals blocked in every thread,
// so that they wait as pending until taken here.
int WaitForTerminationSignalFor(absl::Duration timeout);

// As WaitForTerminationSignalFor, for any of `signals` (e.g. SIGCHLD too).
// REQUIRES: each of them blocked in every thread.
int WaitForSignalFor(std::initializer_list<int> signals,
                     absl::Duration timeout);

}  // namespace shardps

#endif  // SHARDPS_COMMON_SIGNAL_WAIT_H_
