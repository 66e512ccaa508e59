// shardps-local --restart_on_crash end to end: kill -9 server-1, worker-1 or
// the coordinator of a sync job once a checkpoint is committed; the launcher
// restarts what died (the whole job from the checkpoint, or the coordinator
// alone), and the run ends with a model.safetensors byte-identical to that
// of an uninterrupted run with the same seed.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::NewestCommitted;
using ::shardps::testing::ReadFile;

constexpr int kEvery = 20;      // --checkpoint_every_steps
constexpr int kMaxSteps = 200;  // --max_steps

// A sync job of a few seconds; the step delay keeps it running long enough
// to be killed between checkpoints.
std::vector<std::string> JobFlags(const std::string& run_dir) {
  std::vector<std::string> flags = {"--servers=2", "--workers=2"};
  for (std::string& flag : testing::KillJobTrainingFlags(kMaxSteps)) {
    flags.push_back(std::move(flag));
  }
  flags.insert(flags.end(), {"--worker_extra_args=--fault_step_delay_ms=5",
                             "--timeout_s=300", "--run_dir=" + run_dir});
  return flags;
}

// The time stamp of the first line of the log at `path` that contains
// every one of `parts` and comes after `after`; nullopt if none does.
std::optional<absl::Time> LogTime(const std::string& path,
                                  const std::vector<std::string>& parts,
                                  absl::Time after = absl::InfinitePast()) {
  for (absl::string_view line : absl::StrSplit(ReadFile(path), '\n')) {
    bool match = true;
    for (const std::string& part : parts) {
      match = match && absl::StrContains(line, part);
    }
    absl::Time time;
    std::string error;
    // "2024-05-01T12:00:00.123Z INFO ..." (common/log.cc)
    if (match &&
        absl::ParseTime("%Y-%m-%dT%H:%M:%E*SZ",
                        std::string(line.substr(0, line.find(' '))),
                        absl::UTCTimeZone(), &time, &error) &&
        time >= after) {
      return time;
    }
  }
  return std::nullopt;
}

int ReadPid(const std::string& run_dir, const std::string& name) {
  int pid = 0;
  std::ifstream(absl::StrCat(run_dir, "/pids/", name, ".pid")) >> pid;
  return pid;
}

// Runs shardps-local to the end; its exit code and output.
CommandResult WaitForLauncher(Daemon& launcher) {
  absl::StatusOr<int> code = launcher.Wait(absl::Minutes(5));
  EXPECT_TRUE(code.ok()) << code.status() << "\n" << launcher.ReadLog();
  return {code.ok() ? *code : -1, launcher.ReadLog()};
}

// The uninterrupted run, once for every test: its model and how long a
// step took.
struct Reference {
  std::string model;
  absl::Duration per_step;
};
const Reference& GetReference() {
  static const Reference* const reference = [] {
    auto* r = new Reference;
    const std::string run_dir = testing::MakeTempDir("shardps-ref") + "/run";
    absl::StatusOr<std::unique_ptr<Daemon>> launcher = Daemon::StartProcess(
        "local-reference", SHARDPS_LOCAL_BIN, JobFlags(run_dir));
    if (!launcher.ok()) return r;
    const CommandResult done = WaitForLauncher(**launcher);
    if (done.code != 0) {
      ADD_FAILURE() << "the reference run failed:\n" << done.output;
      return r;
    }
    r->model = ReadFile(run_dir + "/model.safetensors");
    const std::string log = run_dir + "/logs/worker-0.log";
    const std::optional<absl::Time> first = LogTime(log, {"declared"});
    const std::optional<absl::Time> last = LogTime(log, {"done: "});
    if (first && last) r->per_step = (*last - *first) / kMaxSteps;
    std::printf("reference: %.1f ms per step\n",
                absl::ToDoubleMilliseconds(r->per_step));
    return r;
  }();
  return *reference;
}

void ExpectSameModel(const std::string& got, const std::string& want) {
  ASSERT_FALSE(want.empty()) << "no reference model";
  ASSERT_EQ(got.size(), want.size()) << "model.safetensors sizes differ";
  const auto diff = std::mismatch(got.begin(), got.end(), want.begin());
  EXPECT_TRUE(diff.first == got.end())
      << "model.safetensors differs first at byte "
      << (diff.first - got.begin()) << " of " << got.size();
}

// Kills `victim` with SIGKILL once a checkpoint at a random multiple of
// kEvery is committed, and checks that the run ends like the reference.
void KillAndFinish(const std::string& victim) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  const Reference& reference = GetReference();
  const std::string run_dir = testing::MakeTempDir("shardps-restart") + "/run";
  const std::string checkpoints = run_dir + "/checkpoints";
  std::vector<std::string> flags = JobFlags(run_dir);
  flags.push_back(absl::StrCat("--checkpoint_every_steps=", kEvery));
  flags.push_back("--restart_on_crash");
  absl::StatusOr<std::unique_ptr<Daemon>> launcher =
      Daemon::StartProcess("local", SHARDPS_LOCAL_BIN, flags);
  ASSERT_TRUE(launcher.ok()) << launcher.status();

  // Steps 20..100 of 200: the run goes on for a while after the kill.
  std::mt19937 rng(static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  const int64_t kill_after = kEvery * (1 + rng() % 5);
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (NewestCommitted(checkpoints) < kill_after && absl::Now() < deadline) {
    ASSERT_FALSE((*launcher)->Wait(absl::ZeroDuration()).ok())
        << "exited before the kill:\n"
        << (*launcher)->ReadLog();
    absl::SleepFor(absl::Milliseconds(2));
  }
  const int64_t committed = NewestCommitted(checkpoints);
  ASSERT_GE(committed, kill_after) << (*launcher)->ReadLog();
  // Then up to half an interval more (at the reference's pace), so that a
  // restart has steps past its checkpoint to replay. Timing only sets where
  // the kill lands; the checks hold wherever it does.
  absl::SleepFor(reference.per_step * static_cast<int>(rng() % (kEvery / 2)));
  const int pid = ReadPid(run_dir, victim);
  ASSERT_GT(pid, 0) << victim;
  ASSERT_EQ(kill(pid, SIGKILL), 0) << victim << " pid " << pid;
  const absl::Time killed = absl::Now();
  std::printf("killed %s (pid %d) after the checkpoint of step %ld\n",
              victim.c_str(), pid, static_cast<long>(committed));

  const CommandResult done = WaitForLauncher(**launcher);
  ASSERT_EQ(done.code, 0) << done.output;
  EXPECT_TRUE(absl::StrContains(
      done.output, absl::StrCat(victim, " (signal 9, SIGKILL) died: ")))
      << done.output;
  EXPECT_TRUE(absl::StrContains(done.output, "restart 1 of at most 5"))
      << done.output;
  EXPECT_TRUE(absl::StrContains(done.output, "final: epoch=1 step=200"))
      << done.output;
  EXPECT_TRUE(absl::StrContains(done.output, "peak RSS: coordinator "))
      << done.output;
  EXPECT_NE(ReadPid(run_dir, victim), pid) << "pid file not updated";
  const std::string worker0_log = run_dir + "/logs/worker-0.log";
  const double per_step_ms = absl::ToDoubleMilliseconds(reference.per_step);

  if (victim == "coordinator") {
    EXPECT_TRUE(absl::StrContains(done.output, "restarting it on port"))
        << done.output;
    // Training went on: no process but the coordinator started again.
    EXPECT_FALSE(absl::StrContains(ReadFile(worker0_log), "resuming at step"));
    const std::string log = run_dir + "/logs/coordinator.log";
    const std::optional<absl::Time> serving =
        LogTime(log, {"coordinator listening"}, killed);
    ASSERT_TRUE(serving.has_value()) << ReadFile(log);
    // Members rejoin at their next heartbeat, or when they finish.
    const std::optional<absl::Time> rejoined =
        LogTime(log, {" joined; "}, *serving);
    std::printf(
        "coordinator: serving again %.0f ms after the kill, the first member "
        "rejoined after %.0f ms; 0 steps replayed\n",
        absl::ToDoubleMilliseconds(*serving - killed),
        rejoined ? absl::ToDoubleMilliseconds(*rejoined - killed) : -1.0);
  } else {
    // The launcher read the newest committed step once the job had stopped.
    const std::string from = "restarting it from the checkpoint of step ";
    const size_t at = done.output.find(from);
    ASSERT_NE(at, std::string::npos) << done.output;
    absl::string_view digits =
        absl::string_view(done.output).substr(at + from.size());
    int64_t resumed = -1;
    ASSERT_TRUE(absl::SimpleAtoi(digits.substr(0, digits.find(' ')), &resumed))
        << done.output;
    EXPECT_GE(resumed, committed);
    const std::string step = absl::StrCat(" step ", resumed);
    EXPECT_TRUE(absl::StrContains(
        ReadFile(run_dir + "/logs/server-0.log"),
        absl::StrCat("restored from the checkpoint of", step)));
    const std::optional<absl::Time> resuming =
        LogTime(worker0_log, {absl::StrCat("resuming at", step)}, killed);
    ASSERT_TRUE(resuming.has_value()) << ReadFile(worker0_log);
    // The step reached at the kill, from when step `committed` was written
    // (the surviving shard's log line) and the reference's pace.
    const std::optional<absl::Time> written = LogTime(
        run_dir + "/logs/server-" + (victim == "server-1" ? "0" : "1") + ".log",
        {absl::StrCat("checkpoint of step ", committed, " written")});
    const double since =
        written ? absl::ToDoubleMilliseconds(killed - *written) : 0;
    const double replayed =
        committed - resumed + (per_step_ms > 0 ? since / per_step_ms : 0);
    const std::optional<absl::Time> stopped =
        LogTime((*launcher)->log_path(), {"died: stopped the job"}, killed);
    std::printf(
        "%s: job stopped %.0f ms and first step after the restart %.0f ms "
        "after the kill; resumed at step %ld; about %.0f step(s) replayed "
        "(killed %.0f ms after step %ld was written, %.1f ms per step)\n",
        victim.c_str(),
        stopped ? absl::ToDoubleMilliseconds(*stopped - killed) : -1.0,
        absl::ToDoubleMilliseconds(*resuming - killed),
        static_cast<long>(resumed), std::max(0.0, replayed), since,
        static_cast<long>(committed), per_step_ms);
  }
  ExpectSameModel(ReadFile(run_dir + "/model.safetensors"), reference.model);
}

TEST(LocalRestartE2ETest, KilledServerRestartsTheJobFromItsCheckpoint) {
  KillAndFinish("server-1");
}

TEST(LocalRestartE2ETest, KilledWorkerRestartsTheJobFromItsCheckpoint) {
  KillAndFinish("worker-1");
}

TEST(LocalRestartE2ETest, KilledCoordinatorIsRestartedAlone) {
  KillAndFinish("coordinator");
}

}  // namespace
}  // namespace shardps
