// Kill tests: kill -9 a server or a worker in the middle of a sync run with
// checkpoints, restart the job (as a supervisor would), and the final model
// is bitwise identical to the same run without the kill.
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::Daemon;
using ::shardps::testing::NewestCommitted;
using ::shardps::testing::TestCluster;

constexpr int kWorkers = 2;
constexpr int kEvery = 20;

std::vector<std::string> WorkerFlags() {
  std::vector<std::string> flags =
      testing::KillJobTrainingFlags(/*max_steps=*/200);
  flags.push_back("--fault_step_delay_ms=5");
  return flags;
}

// A job of `num_servers` static servers and kWorkers workers as processes
// on 127.0.0.1, with checkpoints in `ckpt_dir` unless it is empty; rank 0
// writes the model. Null after a failed start.
std::unique_ptr<TestCluster> StartJob(int num_servers,
                                      const std::string& ckpt_dir) {
  ClusterOptions o;
  o.num_servers = num_servers;
  o.num_workers = kWorkers;
  if (!ckpt_dir.empty()) {
    o.checkpoint_dir = ckpt_dir;
    o.checkpoint_every_steps = kEvery;
  }
  o.worker_flags = WorkerFlags();
  auto job = std::make_unique<TestCluster>(std::move(o));
  if (!job->StartServers() || !job->StartWorkers({{job->model_out_flag()}})) {
    return nullptr;
  }
  return job;
}

absl::StatusOr<std::vector<LoadedTensor>> ReferenceModel() {
  std::unique_ptr<TestCluster> job = StartJob(2, "");
  if (job == nullptr) return absl::InternalError("the job did not start");
  if (absl::Status s = job->WorkersSucceed(absl::Seconds(240)); !s.ok()) {
    return s;
  }
  return job->ReadModel();
}

void ExpectSameModel(const std::vector<LoadedTensor>& got,
                     const std::vector<LoadedTensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t t = 0; t < got.size(); ++t) {
    EXPECT_EQ(got[t].name, want[t].name);
    EXPECT_TRUE(got[t].data == want[t].data) << got[t].name << " differs";
  }
}

enum class Victim { kServer, kWorker };

// Kills `victim` mid-run (with `servers` servers) and restarts the job with
// `restart_servers` servers.
void KillAndRestart(Victim victim, int servers = 2, int restart_servers = 2) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  absl::StatusOr<std::vector<LoadedTensor>> want = ReferenceModel();
  SHARDPS_ASSERT_OK(want);

  const std::string ckpt = testing::MakeTempDir("shardps-ckpt");
  // Kill once a checkpoint at a random multiple of kEvery is committed.
  std::mt19937 rng(static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  const int64_t kill_after = kEvery * (1 + rng() % 5);
  {
    std::unique_ptr<TestCluster> job = StartJob(servers, ckpt);
    ASSERT_NE(job, nullptr);
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (NewestCommitted(ckpt) < kill_after && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_GE(NewestCommitted(ckpt), kill_after);
    Daemon* target =
        victim == Victim::kServer ? &job->server(1) : &job->worker(1);
    SHARDPS_ASSERT_OK(job->Kill(target));
    std::printf("killed %s after the checkpoint of step %ld was committed\n",
                victim == Victim::kServer ? "server-1" : "worker-1",
                static_cast<long>(NewestCommitted(ckpt)));
    // The supervisor restarts the whole job: stop what is left.
  }
  const int64_t restored = NewestCommitted(ckpt);
  const absl::Time restart = absl::Now();
  std::unique_ptr<TestCluster> again = StartJob(restart_servers, ckpt);
  ASSERT_NE(again, nullptr);
  SHARDPS_ASSERT_OK(again->WorkersSucceed(absl::Seconds(240)));
  std::printf("restarted from step %ld; finished %.2f s after the restart\n",
              static_cast<long>(restored),
              absl::ToDoubleSeconds(absl::Now() - restart));
  EXPECT_NE(again->server(0).ReadLog().find(absl::StrCat(
                "restored from the checkpoint of step ", restored)),
            std::string::npos)
      << again->server(0).ReadLog();
  EXPECT_NE(again->worker(0).ReadLog().find(
                absl::StrCat("resuming at step ", restored)),
            std::string::npos)
      << again->worker(0).ReadLog();
  absl::StatusOr<std::vector<LoadedTensor>> got = again->ReadModel();
  SHARDPS_ASSERT_OK(got);
  ExpectSameModel(*got, *want);
}

TEST(KillE2ETest, ServerKilledMidRunEndsBitwiseLikeAnUninterruptedRun) {
  KillAndRestart(Victim::kServer);
}

TEST(KillE2ETest, WorkerKilledMidRunEndsBitwiseLikeAnUninterruptedRun) {
  KillAndRestart(Victim::kWorker);
}

// The checkpoint of 3 shards loads into 2 and into 4 (the partitioner
// re-maps the chunks, optimizer state included); the sums do not depend on
// the placement, so the result is still bitwise that of the 2-server run.
TEST(KillE2ETest, CheckpointOfThreeServersRestoresOntoTwoAndFour) {
  KillAndRestart(Victim::kServer, 3, 2);
  KillAndRestart(Victim::kServer, 3, 4);
}

}  // namespace
}  // namespace shardps
