// A rate-limited link for shardps-bench: two network namespaces (servers,
// workers) joined by a veth pair whose two ends each shape their egress with
// a tc tbf qdisc, so each direction carries at most the given rate. Needs
// root, ip and tc; removes what it made when destroyed, and on SIGINT or
// SIGTERM of the process.
#ifndef SHARDPS_TESTS_BENCH_NETNS_LINK_H_
#define SHARDPS_TESTS_BENCH_NETNS_LINK_H_

#include <signal.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "deploy/local/link_shaping.h"

namespace shardps::bench {

// Bytes that crossed the link, per direction, as counted by the workers'
// veth end.
struct LinkBytes {
  int64_t to_servers = 0;
  int64_t to_workers = 0;
};

// The two namespaces shardps-srv-<pid> and shardps-wrk-<pid>, joined by
// veth vs<pid> (10.213.0.1/30, servers) and vw<pid> (10.213.0.2/30,
// workers), each end shaped as local::TbfShapeFor says. The addresses are
// private to the two namespaces, so concurrent runs do not collide. Each
// command it runs is logged (common/log.h). Thread-compatible; the teardown
// also runs on the signal thread.
class NetnsLink {
 public:
  static constexpr char kServerHost[] = "10.213.0.1";
  static constexpr char kWorkerHost[] = "10.213.0.2";

  // Makes the namespaces, the veth pair (links and lo up) and a tbf of
  // `bits_per_second` on both veth ends, and from then on takes SIGINT and
  // SIGTERM: on either it kills what runs in the two namespaces, removes
  // them, and exits the process with 128 + the signal.
  //   FailedPrecondition: not root, or no ip or tc binary.
  //   Internal: a command failed; the message has its output. Whatever was
  //   made before it is removed again.
  // REQUIRES: called before the process starts any other thread. It blocks
  // SIGINT and SIGTERM in the calling thread, and threads started later
  // inherit that, so the signals wait for the signal thread.
  static absl::StatusOr<std::unique_ptr<NetnsLink>> Create(
      int64_t bits_per_second);
  // Kills what still runs in the namespaces (not this process), deletes
  // them, which deletes the veth pair, and restores the signal mask.
  ~NetnsLink();

  NetnsLink(const NetnsLink&) = delete;
  NetnsLink& operator=(const NetnsLink&) = delete;

  int64_t bits_per_second() const { return shape_.bits_per_second; }
  // tbf parameters of both ends: bucket size and how long a packet may
  // wait in the queue before it is dropped.
  int64_t burst_bytes() const { return shape_.burst_bytes; }
  int latency_ms() const { return shape_.latency_ms; }
  const std::string& server_namespace() const { return server_ns_; }
  const std::string& worker_namespace() const { return worker_ns_; }
  const std::string& ip_binary() const { return ip_; }

  // The argv that runs `binary` with `args` in the servers' namespace:
  // ip netns exec <server_namespace> binary args... (ip execs it, so the
  // process id is the program's).
  std::vector<std::string> ServerArgs(const std::string& binary,
                                      std::vector<std::string> args) const;

  // Moves the calling thread into the workers' namespace. Sockets it opens
  // afterwards, and threads it starts afterwards with theirs, are there.
  // Internal when setns(2) fails. REQUIRES: called once.
  absl::Status EnterWorkerNamespace();

  // Bytes the workers' veth end has sent and received so far.
  // REQUIRES: EnterWorkerNamespace() succeeded.
  absl::StatusOr<LinkBytes> Bytes() const;

  // One line per veth end: what tc counted (sent, dropped, overlimits).
  std::string QdiscStats() const;

 private:
  NetnsLink() = default;
  absl::Status Setup() ABSL_LOCKS_EXCLUDED(mu_);
  void Teardown() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The signal thread: waits on signal_fd_ and stop_fd_.
  void WatchSignals();

  local::TbfShape shape_;
  std::string ip_, tc_;
  std::string server_ns_, worker_ns_, server_veth_, worker_veth_;

  // The calling thread's signal mask before Create blocked SIGINT and
  // SIGTERM (when blocked_ says it did).
  sigset_t old_mask_;
  bool blocked_ = false;
  int signal_fd_ = -1;
  int stop_fd_ = -1;
  std::unique_ptr<std::thread> signal_thread_;
  // The calling thread's namespace before EnterWorkerNamespace, and
  // /proc/thread-self/net/dev opened in the workers' namespace.
  int home_ns_fd_ = -1;
  int net_dev_fd_ = -1;

  // Held while commands run, so that a signal's teardown waits for a
  // command of Setup in flight. Guards what exists and has to be removed.
  absl::Mutex mu_;
  bool made_server_ns_ ABSL_GUARDED_BY(mu_) = false;
  bool made_worker_ns_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardps::bench

#endif  // SHARDPS_TESTS_BENCH_NETNS_LINK_H_
