// shardps-local -- CMD end to end, with /bin/sh commands as the workers:
// every rank runs with the job's environment (coordinator or static server
// list), rank 0's output is relayed, a failing command fails the launcher,
// --restart_on_crash runs a command that crashed once again, SIGTERM
// reaches the commands, and the training flags are refused.
#include <signal.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::Must;
using ::shardps::testing::MustRun;
using ::shardps::testing::ReadFile;

// Prints the variables a command gets, one "name=value" a line.
constexpr char kPrintEnv[] =
    "echo rank=$SHARDPS_RANK of $SHARDPS_NUM_WORKERS; "
    "echo coordinator=$SHARDPS_COORDINATOR; echo servers=$SHARDPS_SERVERS; "
    "echo job=$SHARDPS_JOB_ID; echo run_dir=$SHARDPS_RUN_DIR; "
    "echo pythonpath=$PYTHONPATH; echo checkpoints=$SHARDPS_CHECKPOINT_DIR";

// shardps-local `flags` --run_dir=`run_dir` -- /bin/sh -c `script`, to its
// end.
CommandResult RunWithScript(const std::string& run_dir,
                            std::vector<std::string> flags,
                            const std::string& script) {
  flags.push_back("--run_dir=" + run_dir);
  flags.push_back("--timeout_s=120");
  for (const char* arg : {"--", "/bin/sh", "-c"}) flags.push_back(arg);
  flags.push_back(script);
  return MustRun(SHARDPS_LOCAL_BIN, std::move(flags), absl::Minutes(3));
}

std::string Log(const std::string& run_dir, int rank) {
  return ReadFile(absl::StrCat(run_dir, "/logs/worker-", rank, ".log"));
}

std::string Port(const std::string& run_dir, const std::string& name) {
  return std::string(absl::StripAsciiWhitespace(
      ReadFile(absl::StrCat(run_dir, "/ports/", name, ".port"))));
}

TEST(WorkerCommandE2eTest, EveryRankRunsWithTheCoordinatorsAddress) {
  const std::string run_dir = testing::MakeTempDir("shardps-cmd") + "/run";
  const CommandResult done = RunWithScript(
      run_dir, {"--servers=1", "--workers=2", "--checkpoint_every_steps=10"},
      kPrintEnv);
  ASSERT_EQ(done.code, 0) << done.output;
  const std::string coordinator =
      absl::StrCat("coordinator=127.0.0.1:", Port(run_dir, "coordinator"));
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    const std::string log = Log(run_dir, rank);
    EXPECT_TRUE(absl::StrContains(log, absl::StrCat("rank=", rank, " of 2")))
        << log;
    EXPECT_TRUE(absl::StrContains(log, coordinator + "\n")) << log;
    EXPECT_TRUE(absl::StrContains(log, "servers=\n")) << log;
    EXPECT_TRUE(absl::StrContains(log, "job=shardps\n")) << log;
    EXPECT_TRUE(absl::StrContains(log, "run_dir=" + run_dir + "\n")) << log;
    EXPECT_TRUE(
        absl::StrContains(log, "checkpoints=" + run_dir + "/checkpoints\n"))
        << log;
    EXPECT_TRUE(
        fs::exists(absl::StrCat(run_dir, "/pids/worker-", rank, ".pid")));
  }
  // The build tree's package, when this build has one.
  const fs::path python = fs::path(SHARDPS_LOCAL_BIN).parent_path() / ".." /
                          ".." / "worker" / "python";
  if (fs::is_directory(python)) {
    EXPECT_TRUE(absl::StrContains(
        Log(run_dir, 0), "pythonpath=" + python.lexically_normal().string()))
        << Log(run_dir, 0);
  }
  // Rank 0's output is relayed, rank 1's is not; no metrics line is owed.
  EXPECT_TRUE(absl::StrContains(done.output, "rank=0 of 2")) << done.output;
  EXPECT_FALSE(absl::StrContains(done.output, "rank=1 of 2")) << done.output;
  EXPECT_FALSE(absl::StrContains(done.output, "final:")) << done.output;
}

TEST(WorkerCommandE2eTest, StaticModeGivesTheServersAddresses) {
  const std::string run_dir = testing::MakeTempDir("shardps-cmd") + "/run";
  const CommandResult done = RunWithScript(
      run_dir, {"--static", "--servers=2", "--workers=1"}, kPrintEnv);
  ASSERT_EQ(done.code, 0) << done.output;
  const std::string log = Log(run_dir, 0);
  EXPECT_TRUE(absl::StrContains(
      log, absl::StrCat("servers=127.0.0.1:", Port(run_dir, "server-0"),
                        ",127.0.0.1:", Port(run_dir, "server-1"), "\n")))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "coordinator=\n")) << log;
  EXPECT_TRUE(absl::StrContains(log, "rank=0 of 1")) << log;
}

TEST(WorkerCommandE2eTest, AFailingCommandFailsTheLauncher) {
  const std::string run_dir = testing::MakeTempDir("shardps-cmd") + "/run";
  const CommandResult done =
      RunWithScript(run_dir, {"--servers=1", "--workers=2"},
                    "echo started; [ \"$SHARDPS_RANK\" = 1 ] && exit 3; "
                    "exec sleep 30");
  EXPECT_NE(done.code, 0) << done.output;
  EXPECT_TRUE(absl::StrContains(done.output, "worker-1 failed (exit code 3)"))
      << done.output;
}

TEST(WorkerCommandE2eTest, RestartOnCrashRunsACrashedCommandAgain) {
  const std::string dir = testing::MakeTempDir("shardps-cmd");
  const std::string marker = dir + "/crashed-once";
  const CommandResult done = RunWithScript(
      dir + "/run",
      {"--static", "--servers=1", "--workers=2", "--restart_on_crash"},
      absl::StrCat("if [ \"$SHARDPS_RANK\" = 1 ] && [ ! -e ", marker,
                   " ]; then touch ", marker,
                   "; echo crashing; exit 9; fi; echo rank=$SHARDPS_RANK ok"));
  ASSERT_EQ(done.code, 0) << done.output;
  EXPECT_TRUE(fs::exists(marker));
  EXPECT_TRUE(absl::StrContains(done.output, "worker-1 (exit code 9) died"))
      << done.output;
  const std::string log = Log(dir + "/run", 1);
  // The first life's output, the restart line, then the same rank again.
  const size_t crash = log.find("crashing");
  const size_t restart = log.find("restart 1: starting worker-1 again");
  const size_t ok = log.find("rank=1 ok");
  ASSERT_NE(crash, std::string::npos) << log;
  ASSERT_NE(restart, std::string::npos) << log;
  ASSERT_NE(ok, std::string::npos) << log;
  EXPECT_LT(crash, restart) << log;
  EXPECT_LT(restart, ok) << log;
}

TEST(WorkerCommandE2eTest, SigtermReachesTheCommands) {
  const std::string run_dir = testing::MakeTempDir("shardps-cmd") + "/run";
  // `wait` returns when the trapped signal arrives; a plain `sleep` would
  // hold the trap back until it ends. "rea""dy" prints what the launcher's
  // own log of the command line does not hold.
  std::unique_ptr<Daemon> launcher = Must(Daemon::StartProcess(
      "local", SHARDPS_LOCAL_BIN,
      {"--static", "--servers=1", "--workers=2", "--run_dir=" + run_dir,
       "--timeout_s=120", "--", "/bin/sh", "-c",
       "trap 'echo got SIGTERM; kill $!; exit 0' TERM; echo rea\"\"dy; "
       "sleep 60 & wait"}));
  ASSERT_NE(launcher, nullptr);
  ASSERT_TRUE(testing::WaitForLog(*launcher, "ready", absl::Seconds(60)))
      << launcher->ReadLog();
  // Rank 1 may start a moment after rank 0 printed.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(Log(run_dir, 1), "ready") &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::StatusOr<int> code = launcher->Stop(SIGTERM, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGTERM) << launcher->ReadLog();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(absl::StrContains(Log(run_dir, rank), "got SIGTERM"))
        << rank << ": " << Log(run_dir, rank);
  }
}

TEST(WorkerCommandE2eTest, RefusesTrainingFlagsAndAMissingCommand) {
  const std::string run_dir = testing::MakeTempDir("shardps-cmd") + "/run";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--epochs=3", "--", "/bin/true"}, "--epochs is a shardps-worker flag"},
      {{"--worker_extra_args=--x", "--", "/bin/true"}, "--worker_extra_args"},
      {{"--"}, "no command after --"},
      {{"--", "no-such-command-anywhere"}, "is not on PATH"},
      {{"/bin/true"}, "a command to run as the workers follows --"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    std::vector<std::string> args = {"--run_dir=" + run_dir};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const CommandResult done =
        MustRun(SHARDPS_LOCAL_BIN, args, absl::Seconds(30));
    EXPECT_NE(done.code, 0) << done.output;
    EXPECT_TRUE(absl::StrContains(done.output, c.message)) << done.output;
    // Refused before anything started.
    EXPECT_FALSE(fs::exists(run_dir + "/logs")) << done.output;
  }
}

}  // namespace
}  // namespace shardps
