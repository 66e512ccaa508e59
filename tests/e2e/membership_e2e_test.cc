// Workers that leave and join a running job, every daemon a process on
// 127.0.0.1 through the coordinator: a worker killed and not restarted stops
// being waited for and the others finish the job (the lead's duties pass to
// the lowest rank left); a new worker takes the free rank and joins at an
// epoch start; a paused worker's stalled step shows in `shardps-ctl status`,
// the paused worker is dropped, and when it comes back it joins again; a
// server killed and restarted alone rolls the whole job back to the last
// committed checkpoint, and the job ends with the uninterrupted run's model.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;
using ::shardps::testing::ClusterOptions;
using ::shardps::testing::Daemon;
using ::shardps::testing::ExpectExitsZero;
using ::shardps::testing::TestCluster;
using ::shardps::testing::WaitForLog;

// 2048 samples in batches of 64: 32 steps per epoch.
constexpr int64_t kStepsPerEpoch = 32;
constexpr absl::Duration kTrainTimeout = absl::Minutes(3);

// The number after `prefix` in `text` (first occurrence), or -1.
int64_t NumberAfter(const std::string& text, const std::string& prefix) {
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return -1;
  size_t end = at + prefix.size();
  while (end < text.size() && isdigit(text[end])) ++end;
  int64_t n = -1;
  if (!absl::SimpleAtoi(
          text.substr(at + prefix.size(), end - at - prefix.size()), &n)) {
    return -1;
  }
  return n;
}

// A coordinated job of two servers and two workers; `heartbeat_ms` is the
// coordinator's heartbeat timeout (how long a dead worker holds steps up).
ClusterOptions Job(int heartbeat_ms) {
  ClusterOptions o;
  o.coordinated = true;
  o.job_id = "membership";
  o.num_servers = 2;
  o.num_workers = 2;
  o.coordinator_flags = {absl::StrCat("--heartbeat_timeout_ms=", heartbeat_ms)};
  return o;
}

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
    dir_ = testing::MakeTempDir("shardps-membership");
  }

  // Coordinator and two servers (see Job).
  void StartCluster(int heartbeat_ms) {
    ClusterOptions o = Job(heartbeat_ms);
    o.server_flags = {"--step_timeout_s=1"};
    cluster_ = std::make_unique<TestCluster>(std::move(o));
    ASSERT_NE(cluster_->StartCoordinator(), nullptr);
    ASSERT_TRUE(cluster_->StartServers());
  }

  // A worker of a job of `epochs` epochs asking for `rank` (-1: any),
  // slowed down so that the test can act while it trains.
  Daemon* StartWorker(int rank, int epochs) {
    return cluster_->StartWorker(
        {absl::StrCat("--rank=", rank), "--dataset=fashion-mnist",
         "--model=mlp:784-32-10", absl::StrCat("--epochs=", epochs),
         "--train_limit=2048", "--test_limit=500", "--batch_size=64",
         "--backend=cpu", "--fault_step_delay_ms=40", "--model_out=" + model_,
         "--metrics_csv=" + dir_ + "/metrics.csv"});
  }

  // Workers 0 and 1 (asking for those ranks) of an `epochs`-epoch job.
  std::vector<Daemon*> StartWorkers(int epochs) {
    std::vector<Daemon*> workers;
    for (int r = 0; r < 2; ++r) {
      workers.push_back(StartWorker(r, epochs));
      EXPECT_NE(workers.back(), nullptr);
    }
    return workers;
  }

  // Lets `w` train for `after`, then kills it with SIGKILL.
  void KillWhileTraining(Daemon* w, absl::Duration after) {
    ASSERT_TRUE(WaitForLog(*w, "declared")) << w->ReadLog();
    absl::SleepFor(after);
    ASSERT_TRUE(cluster_->Kill(w).ok());
  }

  // Both servers log that `rank` no longer holds steps up.
  void ExpectServersDropped(int rank) {
    for (int s = 0; s < cluster_->num_servers(); ++s) {
      const Daemon& server = cluster_->server(s);
      EXPECT_TRUE(
          WaitForLog(server, absl::StrCat("rank ", rank, " left the job")))
          << server.ReadLog();
    }
  }

  // Servers and coordinator exit 0 by themselves once the workers are done.
  void ExpectJobEnds() {
    cluster_->ExpectJobEnds(kTrainTimeout, absl::Seconds(60));
  }

  std::string dir_;
  std::string model_ = "";
  std::unique_ptr<TestCluster> cluster_;
};

TEST_F(MembershipTest, MembersArrivingLongAfterTheCoordinatorTrainTogether) {
  // The coordinator has settled (up for more than its heartbeat timeout)
  // before anyone joins: the first workers are still the job's cohort.
  cluster_ = std::make_unique<TestCluster>(Job(/*heartbeat_ms=*/500));
  ASSERT_NE(cluster_->StartCoordinator(), nullptr);
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE(cluster_->StartServers());
  std::vector<Daemon*> workers = StartWorkers(1);
  ASSERT_FALSE(HasFailure());
  for (Daemon* w : workers) {
    ExpectExitsZero(w, kTrainTimeout);
    EXPECT_FALSE(absl::StrContains(w->ReadLog(), "joins the running job"))
        << w->ReadLog();
  }
  for (int s = 0; s < cluster_->num_servers(); ++s) {
    const std::string log = cluster_->server(s).ReadLog();
    EXPECT_FALSE(absl::StrContains(log, "left the job")) << log;
  }
  ExpectJobEnds();
}

TEST_F(MembershipTest, WorkerKilledAndNotReplacedLeavesTheOthersToFinish) {
  model_ = dir_ + "/model.safetensors";
  StartCluster(/*heartbeat_ms=*/1000);
  std::vector<Daemon*> workers = StartWorkers(3);
  ASSERT_FALSE(HasFailure());
  Daemon* w1 = workers[1];
  // Rank 0, the lead, dies a little into the first epoch.
  KillWhileTraining(workers[0], absl::Milliseconds(700));
  ASSERT_FALSE(HasFailure());
  const absl::Time kill_time = absl::Now();
  ExpectServersDropped(0);
  const absl::Duration to_drop = absl::Now() - kill_time;

  ExpectExitsZero(w1, kTrainTimeout);
  const std::string log = w1->ReadLog();
  // Re-sharded at the next epoch, and rank 1 took over evaluation and the
  // model file.
  EXPECT_TRUE(absl::StrContains(
      log, "the global batch is sharded over 1 worker(s), ranks 1"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "epoch 3/3 step 96")) << log;
  EXPECT_TRUE(absl::StrContains(log, "done: epoch 3 step 96")) << log;
  EXPECT_GT(fs::file_size(model_), 100000u);
  EXPECT_TRUE(fs::exists(dir_ + "/metrics.csv"));
  ExpectJobEnds();
  EXPECT_TRUE(absl::StrContains(cluster_->coordinator().ReadLog(),
                                "1 of 2 workers finished"))
      << cluster_->coordinator().ReadLog();
  std::cout << "rank 0 killed; servers stopped waiting for it after "
            << absl::FormatDuration(to_drop) << "\n";
}

TEST_F(MembershipTest, NewWorkerJoinsARunningJobAtAnEpochStart) {
  model_ = dir_ + "/model.safetensors";
  StartCluster(/*heartbeat_ms=*/1000);
  std::vector<Daemon*> workers = StartWorkers(5);
  ASSERT_FALSE(HasFailure());
  Daemon* w0 = workers[0];
  KillWhileTraining(workers[1], absl::Milliseconds(500));
  ASSERT_FALSE(HasFailure());
  ExpectServersDropped(1);
  // Rank 0 trains alone from the next epoch on.
  ASSERT_TRUE(
      WaitForLog(*w0, "the global batch is sharded over 1 worker(s), ranks 0"))
      << w0->ReadLog();
  // A new process takes the free rank (1) and joins the running job.
  Daemon* fresh = StartWorker(-1, 5);
  ASSERT_NE(fresh, nullptr);
  ASSERT_TRUE(WaitForLog(*fresh, "joins the running job at step"))
      << fresh->ReadLog();
  const int64_t join =
      NumberAfter(fresh->ReadLog(), "joins the running job at step ");
  EXPECT_GE(join, 2 * kStepsPerEpoch);
  EXPECT_LT(join, 5 * kStepsPerEpoch);
  EXPECT_EQ(join % kStepsPerEpoch, 0) << "not an epoch start: " << join;

  ExpectExitsZero(w0, kTrainTimeout);
  ExpectExitsZero(fresh, kTrainTimeout);
  const std::string log0 = w0->ReadLog();
  EXPECT_TRUE(absl::StrContains(
      log0, absl::StrCat("epoch ", join / kStepsPerEpoch + 1,
                         ": the global batch is sharded over 2 worker(s), "
                         "ranks 0,1")))
      << log0;
  EXPECT_TRUE(absl::StrContains(log0, "done: epoch 5 step 160")) << log0;
  EXPECT_TRUE(absl::StrContains(fresh->ReadLog(), "done: epoch 5 step 160"))
      << fresh->ReadLog();
  for (int s = 0; s < cluster_->num_servers(); ++s) {
    const std::string log = cluster_->server(s).ReadLog();
    EXPECT_TRUE(
        absl::StrContains(log, "rank 1 is held by a new worker process"))
        << log;
  }
  ExpectJobEnds();
  std::cout << "replacement joined at step " << join << " (epoch "
            << join / kStepsPerEpoch + 1 << ")\n";
}

TEST_F(MembershipTest, PausedWorkerShowsAsStalledIsDroppedAndJoinsAgain) {
  StartCluster(/*heartbeat_ms=*/4000);
  std::vector<Daemon*> workers = StartWorkers(5);
  ASSERT_FALSE(HasFailure());
  Daemon* w0 = workers[0];
  Daemon* w1 = workers[1];
  ASSERT_TRUE(WaitForLog(*w1, "declared")) << w1->ReadLog();
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(kill(w1->pid(), SIGSTOP), 0);
  // The step waits for rank 1; the servers' watchdog tells the coordinator,
  // and shardps-ctl status shows what is stalled.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  testing::CommandResult status;
  while (absl::Now() < deadline) {
    status = testing::RunCommand(
        SHARDPS_CTL_BIN,
        {"status", "--coordinator=" + cluster_->coordinator_address()});
    if (absl::StrContains(status.output, "stalled steps:")) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(status.code, 0) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "for rank(s) 1"))
      << status.output;
  // Paused past the heartbeat timeout, it is dropped; rank 0 goes on alone.
  ExpectServersDropped(1);
  ASSERT_EQ(kill(w1->pid(), SIGCONT), 0);
  // Back, its pushes are refused (it is no longer part of the job) and it
  // joins again at an epoch start.
  EXPECT_TRUE(WaitForLog(*w1, "joins the running job at step"))
      << w1->ReadLog();
  ExpectExitsZero(w0, kTrainTimeout);
  ExpectExitsZero(w1, kTrainTimeout);
  EXPECT_TRUE(absl::StrContains(w1->ReadLog(), "refused this worker's push"))
      << w1->ReadLog();
  EXPECT_TRUE(absl::StrContains(w0->ReadLog(), "done: epoch 5 step 160"))
      << w0->ReadLog();
  ExpectJobEnds();
}

// A sync job with checkpoints every 10 steps; `kill_server` kills server 1
// once a checkpoint is committed and restarts it alone at the same address.
// Returns the model file's bytes.
std::string RunCheckpointedJob(const std::string& dir, bool kill_server) {
  ClusterOptions o = Job(/*heartbeat_ms=*/2000);
  o.checkpoint_dir = dir + "/ckpt";
  o.checkpoint_every_steps = 10;
  TestCluster job(std::move(o));
  if (job.StartCoordinator() == nullptr) return "";
  for (int s = 0; s < 2; ++s) {
    if (job.StartServer({absl::StrCat("--shard_index=", s)}) == nullptr) {
      return "";
    }
  }
  for (int r = 0; r < 2; ++r) {
    if (job.StartWorker({absl::StrCat("--rank=", r), "--dataset=fashion-mnist",
                         "--model=mlp:784-32-10", "--epochs=3",
                         "--train_limit=2048", "--test_limit=500",
                         "--batch_size=64", "--backend=cpu", "--optimizer=adam",
                         "--lr=0.003", "--fault_step_delay_ms=30",
                         job.model_out_flag()}) == nullptr) {
      return "";
    }
  }
  if (kill_server) {
    EXPECT_TRUE(WaitForLog(job.server(1), "(all shards written)"))
        << job.server(1).ReadLog();
    absl::SleepFor(absl::Milliseconds(150));  // a few steps past it
    EXPECT_TRUE(job.Kill(&job.server(1)).ok());
    const absl::Time killed = absl::Now();
    if (job.Restart(&job.server(1)) == nullptr) return "";
    EXPECT_TRUE(
        WaitForLog(job.server(0), "shard reset to the checkpoint of step"))
        << job.server(0).ReadLog();
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(WaitForLog(job.worker(r), "the job rolls back to step"))
          << job.worker(r).ReadLog();
    }
    const std::string log = job.worker(0).ReadLog();
    const size_t at = log.find("the job rolls back to step");
    std::cout << "server 1 killed and restarted; every shard reset after "
              << absl::FormatDuration(absl::Now() - killed)
              << "; worker 0: " << log.substr(at, log.find(':', at) - at)
              << "\n";
  }
  job.ExpectJobEnds(kTrainTimeout, absl::Seconds(60));
  return job.ModelBytes();
}

TEST_F(MembershipTest, ServerRestartedAloneRollsTheJobBackToItsCheckpoint) {
  const std::string reference = RunCheckpointedJob(dir_ + "/reference", false);
  ASSERT_GT(reference.size(), 100000u);
  const std::string recovered = RunCheckpointedJob(dir_ + "/killed", true);
  EXPECT_TRUE(recovered == reference)
      << "the model after the rollback differs from the uninterrupted run's";
}

}  // namespace
}  // namespace shardps
