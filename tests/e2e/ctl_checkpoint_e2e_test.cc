// shardps-ctl checkpoint and status against real daemons on 127.0.0.1: a
// checkpoint asked for mid-run is committed at the step the command prints,
// status shows every shard's load and that checkpoint, and the final model is
// byte-identical to the one of the same job without it. Also the errors: a
// job without --checkpoint_dir, a step already past, a negative step, a
// checkpoint a finished job never reaches.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::RunCommand;
using ::shardps::testing::TestCluster;
using ::shardps::testing::WaitForLog;

// The slowed-down job trains for about 4 s; the deadlines allow a loaded
// machine.
constexpr absl::Duration kTrainTimeout = absl::Minutes(3);
constexpr absl::Duration kSelfExitTimeout = absl::Seconds(60);
constexpr absl::Duration kCtlTimeout = absl::Seconds(90);

// Slowed down (20 ms a step) so that the test acts while the job runs; the
// pause does not change the weights.
std::vector<std::string> TrainingArgs(int steps) {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-32-10",
          absl::StrCat("--max_steps=", steps),
          "--train_limit=2048",
          "--test_limit=500",
          "--batch_size=64",
          "--backend=cpu",
          "--fault_step_delay_ms=20"};
}

// A coordinated job of two servers and two workers. With `checkpoint_dir`,
// the servers write checkpoints there (only when asked: no periodic ones).
ClusterOptions Job(const std::string& checkpoint_dir, int steps) {
  ClusterOptions o;
  o.coordinated = true;
  o.job_id = "ctl-e2e";
  o.num_servers = 2;
  o.num_workers = 2;
  o.checkpoint_dir = checkpoint_dir;
  o.worker_flags = TrainingArgs(steps);
  return o;
}

// Starts `job` with the model written by whichever worker is rank 0.
bool StartJob(TestCluster& job) {
  return job.StartCoordinator() != nullptr && job.StartServers() &&
         job.StartWorkers({{job.model_out_flag()}, {job.model_out_flag()}});
}

// Every process exits 0 by itself; returns the model's bytes.
std::string Finish(TestCluster& job) {
  job.ExpectJobEnds(kTrainTimeout, kSelfExitTimeout);
  return job.ModelBytes();
}

// The step of the "checkpoint of step N committed in DIR" line; -1 if none.
int64_t CommittedStep(const std::string& output, const std::string& dir) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::ConsumePrefix(&line, "checkpoint of step ")) continue;
    const std::string suffix = absl::StrCat(" committed in ", dir);
    int64_t step = 0;
    if (absl::ConsumeSuffix(&line, suffix) && absl::SimpleAtoi(line, &step)) {
      return step;
    }
  }
  return -1;
}

// Whether a line of `output` starts with `first`, contains `middle` and
// ends with `last`.
bool HasRow(const std::string& output, const std::string& first,
            const std::string& middle, const std::string& last) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::StartsWith(line, first) && absl::StrContains(line, middle) &&
        absl::EndsWith(line, last)) {
      return true;
    }
  }
  return false;
}

class CtlCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
    dir_ = testing::MakeTempDir("shardps-ctl-checkpoint");
  }
  std::string dir_;
};

TEST_F(CtlCheckpointTest, CheckpointMidRunIsCommittedAndChangesNoWeight) {
  constexpr int kSteps = 200;
  const std::string checkpoints = dir_ + "/checkpoints";
  TestCluster job(Job(checkpoints, kSteps));
  ASSERT_TRUE(StartJob(job));
  ASSERT_TRUE(WaitForLog(job.worker(0), "declared")) << job.worker(0).ReadLog();

  const std::string coordinator = "--coordinator=" + job.coordinator_address();
  const CommandResult ctl =
      RunCommand(SHARDPS_CTL_BIN, {"checkpoint", coordinator}, kCtlTimeout);
  ASSERT_EQ(ctl.code, 0) << ctl.output;
  const int64_t step = CommittedStep(ctl.output, checkpoints);
  ASSERT_GT(step, 0) << ctl.output;
  EXPECT_LT(step, kSteps) << ctl.output;
  EXPECT_TRUE(absl::StrContains(
      ctl.output, absl::StrCat("for a checkpoint of step ", step)))
      << ctl.output;

  // The only checkpoint in the directory, committed, every file verified.
  absl::StatusOr<server::CheckpointInfo> latest =
      server::LatestCommitted(checkpoints);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->step, step);
  EXPECT_EQ(latest->num_shards, 2u);
  EXPECT_TRUE(latest->skipped.empty());

  // Status, while the job still runs: the members, then one row per shard
  // with its load and that checkpoint.
  const CommandResult status =
      RunCommand(SHARDPS_CTL_BIN, {"status", coordinator});
  ASSERT_EQ(status.code, 0) << status.output;
  for (const char* want : {"SHARD", "PUSHES", "CHECKPOINT"}) {
    EXPECT_TRUE(absl::StrContains(status.output, want)) << want << " in\n"
                                                        << status.output;
  }
  for (int s = 0; s < 2; ++s) {
    // Shard s's row: its address, and last the committed checkpoint.
    EXPECT_TRUE(HasRow(status.output, absl::StrCat(s, "/2 "),
                       absl::StrCat(" ", job.server(s).address(), " "),
                       absl::StrCat(" ", step)))
        << status.output;
  }
  EXPECT_FALSE(absl::StrContains(status.output, "error")) << status.output;

  const std::string with = Finish(job);
  ASSERT_FALSE(with.empty());
  for (int s = 0; s < 2; ++s) {
    EXPECT_TRUE(absl::StrContains(
        job.server(s).ReadLog(),
        absl::StrCat("checkpoint of step ", step, " written")))
        << job.server(s).ReadLog();
  }

  // The same job, never asked for a checkpoint, ends with the same bytes.
  TestCluster plain(Job("", kSteps));
  ASSERT_TRUE(StartJob(plain));
  const std::string without = Finish(plain);
  ASSERT_EQ(with.size(), without.size());
  EXPECT_TRUE(with == without) << "models differ";
}

// Two static servers for one worker (they keep running after the worker is
// done), with checkpoints in `checkpoint_dir` unless it is empty.
ClusterOptions StaticJob(const std::string& checkpoint_dir) {
  ClusterOptions o;
  o.num_servers = 2;
  o.checkpoint_dir = checkpoint_dir;
  o.worker_flags = TrainingArgs(30);
  return o;
}

TEST_F(CtlCheckpointTest, ClearErrorsForWhatCannotBeCheckpointed) {
  {
    TestCluster job(StaticJob(""));
    ASSERT_TRUE(job.StartServers());
    const CommandResult off = RunCommand(
        SHARDPS_CTL_BIN, {"checkpoint", job.servers_flag()}, kCtlTimeout);
    EXPECT_EQ(off.code, 1) << off.output;
    EXPECT_TRUE(absl::StrContains(off.output, "FAILED_PRECONDITION"))
        << off.output;
    EXPECT_TRUE(absl::StrContains(off.output, "--checkpoint_dir"))
        << off.output;
  }

  // A finished static job of 30 steps: its shards are at step 30.
  const std::string checkpoints = dir_ + "/checkpoints";
  TestCluster job(StaticJob(checkpoints));
  ASSERT_TRUE(job.StartServers());
  ASSERT_TRUE(job.StartWorkers());
  job.ExpectWorkersExitZero(kTrainTimeout);

  const std::string servers_flag = job.servers_flag();
  const CommandResult past = RunCommand(
      SHARDPS_CTL_BIN, {"checkpoint", servers_flag, "--step=3"}, kCtlTimeout);
  EXPECT_EQ(past.code, 1) << past.output;
  EXPECT_TRUE(absl::StrContains(past.output, "OUT_OF_RANGE")) << past.output;
  EXPECT_TRUE(absl::StrContains(past.output, "already reached step 30"))
      << past.output;

  const CommandResult negative = RunCommand(
      SHARDPS_CTL_BIN, {"checkpoint", servers_flag, "--step=-2"}, kCtlTimeout);
  EXPECT_EQ(negative.code, 1) << negative.output;
  EXPECT_TRUE(absl::StrContains(negative.output, "INVALID_ARGUMENT"))
      << negative.output;

  // Nobody trains any more: step 32 never comes.
  const CommandResult never = RunCommand(
      SHARDPS_CTL_BIN, {"checkpoint", servers_flag, "--checkpoint_timeout_s=2"},
      kCtlTimeout);
  EXPECT_EQ(never.code, 1) << never.output;
  EXPECT_TRUE(absl::StrContains(never.output, "DEADLINE_EXCEEDED"))
      << never.output;
  EXPECT_TRUE(absl::StrContains(never.output, "step 32 was not committed"))
      << never.output;

  const CommandResult neither =
      RunCommand(SHARDPS_CTL_BIN, {"checkpoint"}, kCtlTimeout);
  EXPECT_EQ(neither.code, 1) << neither.output;
  EXPECT_TRUE(absl::StrContains(neither.output, "--coordinator"))
      << neither.output;
  EXPECT_FALSE(server::LatestCommitted(checkpoints).ok());
}

}  // namespace
}  // namespace shardps
