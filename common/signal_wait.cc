#include "common/signal_wait.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>

#include "absl/time/clock.h"

namespace shardps {
namespace {

sigset_t SignalSet(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : signals) sigaddset(&set, sig);
  return set;
}

sigset_t TerminationSignals() { return SignalSet({SIGINT, SIGTERM}); }

}  // namespace

void BlockTerminationSignals() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A peer that vanishes mid-write must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);
}

int WaitForTerminationSignal() {
  const sigset_t set = TerminationSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

int WaitForTerminationSignalFor(absl::Duration timeout) {
  return WaitForSignalFor({SIGINT, SIGTERM}, timeout);
}

int WaitForSignalFor(std::initializer_list<int> signals,
                     absl::Duration timeout) {
  const sigset_t set = SignalSet(signals);
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
