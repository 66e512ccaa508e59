// shardps-local end to end: a short real job (a coordinator, two server
// shards, two workers; and the same in static mode) with everything it leaves
// in its run directory, a failing worker, a failing coordinator, a worker
// that fails again after --restart_on_crash, SIGTERM to the launcher mid-run,
// and bad flags.
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::Must;
using ::shardps::testing::MustRun;
using ::shardps::testing::ReadLines;

// A short job keeps the test quick on two cores: 2048 samples an epoch.
std::vector<std::string> ShortJob(int epochs) {
  return {"--servers=2",
          "--workers=2",
          "--dataset=fashion-mnist",
          "--model=mlp:784-32-10",
          absl::StrCat("--epochs=", epochs),
          "--train_limit=2048",
          "--test_limit=1000",
          "--batch_size=128",
          "--timeout_s=240"};
}

std::set<std::string> FileNames(const std::string& dir) {
  std::set<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    names.insert(e.path().filename().string());
  }
  return names;
}

// Starts shardps-local with `args` (plus --run_dir=`run_dir`); its stdout and
// stderr go to the Daemon's log.
std::unique_ptr<Daemon> StartLauncher(const std::string& run_dir,
                                      std::vector<std::string> args) {
  args.push_back("--run_dir=" + run_dir);
  return Must(Daemon::StartProcess("local", SHARDPS_LOCAL_BIN, args));
}

// Runs shardps-local with `args` (plus --run_dir=`run_dir`) to its end, at
// most `timeout`.
CommandResult RunLauncher(const std::string& run_dir,
                          std::vector<std::string> args,
                          absl::Duration timeout) {
  args.push_back("--run_dir=" + run_dir);
  return MustRun(SHARDPS_LOCAL_BIN, std::move(args), timeout);
}

// The value of `key=` in the launcher's "final:" line; NaN if absent.
double FinalValue(const std::string& output, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::ConsumePrefix(&line, "final:")) continue;
    for (absl::string_view field : absl::StrSplit(line, ' ')) {
      if (!absl::ConsumePrefix(&field, key) ||
          !absl::ConsumePrefix(&field, "=")) {
        continue;
      }
      double value = 0;
      if (absl::SimpleAtod(field, &value)) return value;
    }
  }
  return std::nan("");
}

TEST(LocalLauncherTest, ShortJobFinishesWithMetricsModelAndLogs) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult done =
      RunLauncher(run_dir, ShortJob(1), absl::Minutes(5));
  const std::string& output = done.output;
  ASSERT_EQ(done.code, 0) << output;

  EXPECT_GT(FinalValue(output, "test_accuracy"), 0.5) << output;
  EXPECT_EQ(FinalValue(output, "epoch"), 1) << output;
  EXPECT_GT(FinalValue(output, "wall_s"), 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "peak RSS: coordinator ")) << output;
  for (const char* name :
       {"server-0 ", "server-1 ", "worker-0 ", "worker-1 "}) {
    EXPECT_TRUE(absl::StrContains(output, name)) << output;
  }

  // Worker 0's log was relayed as it was written.
  const std::vector<std::string> worker_log =
      ReadLines(run_dir + "/logs/worker-0.log");
  ASSERT_FALSE(worker_log.empty());
  EXPECT_TRUE(absl::StrContains(output, worker_log.back())) << output;
  // The chunk map, said: 25450 parameters in automatic 64 KiB chunks are
  // fc1.weight's two halves (12544 each) and three small tensors; the
  // partitioner leaves shard 0 12864 and shard 1 12586 elements.
  EXPECT_TRUE(absl::StrContains(
      output,
      "declared in 5 chunks of up to 64 KiB over 2 shards, the busiest "
      "shard 1.1 % over the mean; 16 steps per epoch"))
      << output;

  const std::vector<std::string> metrics = ReadLines(run_dir + "/metrics.csv");
  ASSERT_EQ(metrics.size(), 2u) << absl::StrJoin(metrics, "\n");
  EXPECT_TRUE(absl::StartsWith(metrics[0], "epoch,step,train_loss,test_loss,"))
      << metrics[0];
  std::error_code ec;
  EXPECT_GT(fs::file_size(run_dir + "/model.safetensors", ec), 0u)
      << ec.message();
  const std::set<std::string> logs = {"coordinator.log", "server-0.log",
                                      "server-1.log", "worker-0.log",
                                      "worker-1.log"};
  EXPECT_EQ(FileNames(run_dir + "/logs"), logs);
  const std::set<std::string> pids = {"coordinator.pid", "server-0.pid",
                                      "server-1.pid", "worker-0.pid",
                                      "worker-1.pid"};
  EXPECT_EQ(FileNames(run_dir + "/pids"), pids);
  // Servers and the coordinator ended by themselves when the job finished.
  EXPECT_FALSE(absl::StrContains(output, "SIGTERM")) << output;
  const std::vector<std::string> server_log =
      ReadLines(run_dir + "/logs/server-0.log");
  EXPECT_TRUE(std::any_of(server_log.begin(), server_log.end(),
                          [](const std::string& line) {
                            return absl::StrContains(
                                line, "finished: training completed");
                          }))
      << absl::StrJoin(server_log, "\n");
}

TEST(LocalLauncherTest, WorkerSaysWhenOneShardCarriesMoreOfTheModel) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  // Five chunks over three shards: one gets fc1.weight's half alone, another
  // the other half, the third the small rest.
  const CommandResult done =
      RunLauncher(run_dir,
                  {"--servers=3", "--workers=1", "--dataset=fashion-mnist",
                   "--model=mlp:784-32-10", "--epochs=1", "--train_limit=256",
                   "--test_limit=100", "--batch_size=128", "--timeout_s=240"},
                  absl::Minutes(5));
  ASSERT_EQ(done.code, 0) << done.output;
  EXPECT_TRUE(absl::StrContains(
      done.output,
      "declared in 5 chunks of up to 64 KiB over 3 shards, the busiest "
      "shard 47.9 % over the mean (its link bounds a step across a network; "
      "a smaller --chunk_kib balances finer"))
      << done.output;
}

TEST(LocalLauncherTest, AutomaticChunksAreFinerOnASlowLink) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // Told that the link is slow, automatic chunks get finer (16 KiB at
  // 100 Mbit/s): fc1.weight's 25088 elements become 7 chunks, not 2.
  const std::string slow_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult slow =
      RunLauncher(slow_dir,
                  {"--servers=3", "--workers=1", "--dataset=fashion-mnist",
                   "--model=mlp:784-32-10", "--epochs=1", "--train_limit=256",
                   "--test_limit=100", "--batch_size=128", "--timeout_s=240",
                   "--link_rate=100mbit"},
                  absl::Minutes(5));
  ASSERT_EQ(slow.code, 0) << slow.output;
  EXPECT_TRUE(absl::StrContains(
      slow.output, "declared in 10 chunks of up to 16 KiB over 3 shards"))
      << slow.output;
}

TEST(LocalLauncherTest, AutomaticChunksCountTheBytesOnTheWire) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  // bf16 both ways on the same slow link: 16 KiB on the wire is 32 KiB of
  // fp32, so fc1.weight becomes 4 chunks, not 7.
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult done = RunLauncher(
      run_dir,
      {"--servers=3", "--workers=1", "--dataset=fashion-mnist",
       "--model=mlp:784-32-10", "--epochs=1", "--train_limit=256",
       "--test_limit=100", "--batch_size=128", "--timeout_s=240",
       "--link_rate=100mbit", "--compression=bf16", "--weight_encoding=bf16"},
      absl::Minutes(5));
  ASSERT_EQ(done.code, 0) << done.output;
  EXPECT_TRUE(absl::StrContains(
      done.output, "declared in 7 chunks of up to 32 KiB over 3 shards"))
      << done.output;
}

TEST(LocalLauncherTest, StaticModeRunsWithoutACoordinator) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  std::vector<std::string> args = ShortJob(1);
  args.push_back("--static");
  const CommandResult done = RunLauncher(run_dir, args, absl::Minutes(5));
  const std::string& output = done.output;
  ASSERT_EQ(done.code, 0) << output;
  EXPECT_GT(FinalValue(output, "test_accuracy"), 0.5) << output;
  const std::set<std::string> logs = {"server-0.log", "server-1.log",
                                      "worker-0.log", "worker-1.log"};
  EXPECT_EQ(FileNames(run_dir + "/logs"), logs);
}

TEST(LocalLauncherTest, FailingCoordinatorIsAFailure) {
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult done =
      RunLauncher(run_dir,
                  {"--servers=1", "--workers=1",
                   "--coordinator_binary=/bin/false", "--timeout_s=120"},
                  absl::Minutes(3));
  const std::string& output = done.output;
  EXPECT_EQ(done.code, 1) << output;
  EXPECT_TRUE(absl::StrContains(output, "coordinator failed (exit code 1)"))
      << output;
  EXPECT_FALSE(absl::StrContains(output, "started server-0")) << output;
}

TEST(LocalLauncherTest, FailingWorkerIsNamedWithItsError) {
  // Fails while loading data, so this needs no dataset installed.
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult done =
      RunLauncher(run_dir,
                  {"--servers=1", "--workers=2", "--dataset=idx:/nonexistent",
                   "--model=mlp:784-10", "--timeout_s=120"},
                  absl::Minutes(3));
  const std::string& output = done.output;
  EXPECT_EQ(done.code, 1) << output;
  // Both workers fail; whichever is reaped first is reported with the last
  // line of its log.
  bool reported = false;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string name = absl::StrCat("worker-", rank);
    const std::vector<std::string> log =
        ReadLines(absl::StrCat(run_dir, "/logs/", name, ".log"));
    if (log.empty()) continue;
    if (absl::StrContains(output, name + " failed (exit code") &&
        absl::StrContains(output, "  " + log.back())) {
      reported = true;
    }
  }
  EXPECT_TRUE(reported) << output;
  EXPECT_FALSE(absl::StrContains(output, "final:")) << output;
}

TEST(LocalLauncherTest, RestartOnCrashGivesUpAfterMaxRestarts) {
  // The worker fails while loading data, every time: no dataset needed.
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  const CommandResult done =
      RunLauncher(run_dir,
                  {"--servers=1", "--workers=1", "--static",
                   "--dataset=idx:/nonexistent", "--model=mlp:784-10",
                   "--restart_on_crash", "--max_restarts=1", "--timeout_s=120"},
                  absl::Minutes(3));
  const std::string& output = done.output;
  EXPECT_EQ(done.code, 1) << output;
  for (const char* line :
       {"no checkpoints (--checkpoint_every_steps=0): a job restarted",
        "worker-0 (exit code 1) died: stopped the job; restarting it from "
        "step 0 (no checkpoints: --checkpoint_every_steps=0) (restart 1 of "
        "at most 1)",
        "worker-0 died after 1 restart(s) (--max_restarts=1): giving up",
        "worker-0 failed (exit code 1)"}) {
    EXPECT_TRUE(absl::StrContains(output, line)) << line << "\n" << output;
  }
  EXPECT_FALSE(absl::StrContains(output, "restart 2 of")) << output;
  // Both lives of each process share its log: the second one appended.
  for (const char* name : {"server-0", "worker-0"}) {
    const std::vector<std::string> log =
        ReadLines(absl::StrCat(run_dir, "/logs/", name, ".log"));
    EXPECT_EQ(std::count(log.begin(), log.end(),
                         absl::StrCat("---- shardps-local: restart 1: "
                                      "starting ",
                                      name, " again ----")),
              1)
        << name << ":\n"
        << absl::StrJoin(log, "\n");
  }
  const std::vector<std::string> worker_log =
      ReadLines(run_dir + "/logs/worker-0.log");
  EXPECT_EQ(std::count_if(worker_log.begin(), worker_log.end(),
                          [](const std::string& line) {
                            return absl::StrContains(line, "/nonexistent");
                          }),
            2)
      << absl::StrJoin(worker_log, "\n");
}

TEST(LocalLauncherTest, SigtermStopsEveryChild) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  // Long enough to be running when the signal comes.
  std::unique_ptr<Daemon> launcher = StartLauncher(run_dir, ShortJob(10000));
  ASSERT_NE(launcher, nullptr);

  // Mid-run: worker 0 has written the metrics of an epoch, so every process
  // is up and training.
  const std::string metrics = run_dir + "/metrics.csv";
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (ReadLines(metrics).size() < 2 && absl::Now() < deadline) {
    ASSERT_FALSE(launcher->Wait(absl::ZeroDuration()).ok())
        << "exited early:\n"
        << launcher->ReadLog();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_GE(ReadLines(metrics).size(), 2u) << launcher->ReadLog();

  absl::StatusOr<int> code = launcher->Stop(SIGTERM, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << launcher->ReadLog();
  EXPECT_EQ(*code, 128 + SIGTERM) << launcher->ReadLog();
  for (const char* name :
       {"coordinator", "server-0", "server-1", "worker-0", "worker-1"}) {
    const std::vector<std::string> pid_file =
        ReadLines(absl::StrCat(run_dir, "/pids/", name, ".pid"));
    ASSERT_EQ(pid_file.size(), 1u) << name;
    int pid = 0;
    ASSERT_TRUE(absl::SimpleAtoi(pid_file[0], &pid)) << pid_file[0];
    errno = 0;
    EXPECT_EQ(kill(pid, 0), -1) << name << " (pid " << pid << ") is alive";
    EXPECT_EQ(errno, ESRCH) << name;
  }
}

TEST(LocalLauncherTest, BadFlagsExitOneWithOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--servers=0"}, "--servers=0 must be in [1, "},
      {{"--workers=0"}, "--workers=0 must be in [1, "},
      {{"--mode=eventual"}, "--mode=eventual is not one of: sync, async"},
      {{"--timeout_s=-5"}, "--timeout_s=-5 is negative"},
      {{"--checkpoint_every_steps=-1"},
       "--checkpoint_every_steps=-1 is negative"},
      {{"--keep_checkpoints=0"}, "--keep_checkpoints=0 must be at least 1"},
      {{"--max_restarts=-1"}, "--max_restarts=-1 is negative"},
      {{"--no_such_flag"}, "no_such_flag"},
      // The workers' flags, checked before any worker is started.
      {{"--link_rate=fast"}, "--link_rate=fast: not a number and a unit"},
      {{"--epochs=0"}, "--epochs and --eval_every_epochs must be >= 1"},
      {{"--chunk_kib=-1"}, "--chunk_kib in [0, 65536]"},
      {{"--clip_grad_norm=nan"}, "--clip_grad_norm=nan must be finite"},
      {{"--compression=zstd"}, "unknown compression \"zstd\""},
      {{"--worker_binary=/nonexistent/shardps-worker"},
       "cannot find shardps-worker at /nonexistent/shardps-worker; build it or "
       "pass --worker_binary"},
  };
  const std::string run_dir = testing::MakeTempDir("shardps-local") + "/run";
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[0]);
    const CommandResult done = RunLauncher(run_dir, c.args, absl::Seconds(30));
    const std::string& output = done.output;
    EXPECT_EQ(done.code, 1) << output;
    EXPECT_TRUE(absl::StrContains(output, c.message)) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
  }
  // Nothing was started, so nothing was created.
  EXPECT_FALSE(fs::exists(run_dir));
}

}  // namespace
}  // namespace shardps
