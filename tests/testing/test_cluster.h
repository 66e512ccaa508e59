// A shardps job of real processes on 127.0.0.1 for end-to-end tests: a
// coordinator, servers and workers started with the flags their mode needs
// (static lists or --coordinator), ports picked at run time, every member's
// log in one temporary directory. Members can be killed and restarted; the
// cluster waits for the workers (with deadlines), reads the model file, and
// stops what is left when destroyed. Test-only.
#ifndef SHARDPS_TESTS_TESTING_TEST_CLUSTER_H_
#define SHARDPS_TESTS_TESTING_TEST_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/safetensors.h"
#include "tests/testing/daemon.h"

namespace shardps::testing {

// The Fashion-MNIST files the training tests use, and why a test skips
// without them: `if (!HaveFashionMnist()) GTEST_SKIP() << kNoFashionMnist;`
inline constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";
inline constexpr char kNoFashionMnist[] =
    "/usr/share/datasets/fashion-mnist is missing: apt-get install "
    "dataset-fashion-mnist";
bool HaveFashionMnist();

struct ClusterOptions {
  // Static: servers get --shard_index, --num_shards and --num_workers, workers
  // --servers, --rank and --num_workers. Coordinated: the coordinator gets
  // --job_id, --num_servers and --num_workers; servers and workers only
  // --job_id and --coordinator.
  bool coordinated = false;
  std::string job_id = "e2e";
  int num_servers = 1;
  int num_workers = 1;
  // The coordinator's port; 0 picks one when it starts. Set, the members
  // can be started before the coordinator.
  int coordinator_port = 0;
  // Given to every server: --mode, --checkpoint_dir and
  // --checkpoint_every_steps when set.
  std::string mode;
  std::string checkpoint_dir;
  int checkpoint_every_steps = 0;
  // Extra flags of every member of a role, before a member's own.
  std::vector<std::string> coordinator_flags;
  std::vector<std::string> server_flags;
  std::vector<std::string> worker_flags;
};

// Whether a start waits for the member's port file (a serving daemon) or
// only starts the process (a worker, or a server that does not serve yet).
enum class Await { kPort, kStart };

class TestCluster {
 public:
  explicit TestCluster(ClusterOptions options);
  // Stops every member still running: workers, servers, the coordinator.
  ~TestCluster();
  TestCluster(const TestCluster&) = delete;
  TestCluster& operator=(const TestCluster&) = delete;

  // Each start returns the member, or null after failing the test with why.
  // `flags` come last. Names: coordinator, server-<i>, worker-<i> (in start
  // order), the log <dir>/<name>.log.
  Daemon* StartCoordinator(std::vector<std::string> flags = {});
  Daemon* StartServer(std::vector<std::string> flags = {},
                      Await await = Await::kPort);
  Daemon* StartWorker(std::vector<std::string> flags = {});
  // options.num_servers servers / options.num_workers workers (rank r gets
  // rank_flags[r] when given); false after a failed start.
  bool StartServers();
  bool StartWorkers(
      const std::vector<std::vector<std::string>>& rank_flags = {});
  // The coordinator (when coordinated) and every server, then every worker.
  bool Start();

  // SIGKILL, and the exit; ExpectJobEnds leaves a killed member out.
  absl::Status Kill(Daemon* member);
  // Starts an exited member again with its flags, at the same port; its log
  // is <name>-restart-<n>.log. Null after failing the test.
  Daemon* Restart(Daemon* member);

  // Every worker's exit code in start order, each waited for up to
  // `timeout`; DeadlineExceeded (naming the worker) if one still runs.
  absl::StatusOr<std::vector<int>> WaitForWorkers(absl::Duration timeout);
  // As WaitForWorkers, but an error naming the first worker that did not
  // exit 0, with its log.
  absl::Status WorkersSucceed(absl::Duration timeout);
  // Each worker not killed exits 0 within `timeout` (test failures with
  // the log otherwise).
  void ExpectWorkersExitZero(absl::Duration timeout);
  // The workers as above, then every server and the coordinator not killed
  // exit 0 by themselves within `self_exit_timeout` each.
  void ExpectJobEnds(absl::Duration timeout, absl::Duration self_exit_timeout);

  const std::string& dir() const { return dir_; }
  // Where tests point --model_out; ReadModel and ModelBytes read it.
  std::string model_path() const { return dir_ + "/model.safetensors"; }
  std::string model_out_flag() const { return "--model_out=" + model_path(); }
  absl::StatusOr<std::vector<LoadedTensor>> ReadModel() const;
  std::string ModelBytes() const;

  // "127.0.0.1:<port>" of the coordinator (also before it starts, with
  // options.coordinator_port).
  std::string coordinator_address() const;
  std::vector<std::string> server_addresses() const;
  // --servers=<every server's address>.
  std::string servers_flag() const;

  Daemon& coordinator() { return *coordinator_.daemon; }
  Daemon& server(int i) { return *servers_[i].daemon; }
  Daemon& worker(int i) { return *workers_[i].daemon; }
  int num_servers() const { return static_cast<int>(servers_.size()); }
  int num_workers() const { return static_cast<int>(workers_.size()); }

  // The last non-empty line of `member`'s log.
  static std::string FinalLine(const Daemon& member);

 private:
  struct Member {
    std::string name;
    std::string binary;
    std::vector<std::string> args;
    Await await = Await::kPort;
    int restarts = 0;
    bool killed = false;
    std::unique_ptr<Daemon> daemon;
  };

  Daemon* StartMember(Member* member);
  Member* Find(const Daemon* daemon);

  const ClusterOptions options_;
  const std::string dir_;
  Member coordinator_;
  std::vector<Member> servers_;
  std::vector<Member> workers_;
};

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_TEST_CLUSTER_H_
