#include "common/signal_wait.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>

#include "absl/time/clock.h"

namespace shardps {

int WaitForTerminationSignalFor(absl::Duration timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration left =
        std::max(deadline - absl::Now(), absl::ZeroDuration());
    const timespec wait = absl::ToTimespec(left);
    const int sig = sigtimedwait(&set, nullptr, &wait);
    if (sig > 0) return sig;
    // EINTR: another signal (SIGCHLD, a profiler) woke us early.
    if (errno != EINTR || left == absl::ZeroDuration()) return 0;
  }
}

}  // namespace shardps
