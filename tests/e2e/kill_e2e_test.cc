// Kill tests: kill -9 a server or a worker in the middle of a sync run with
// checkpoints, restart the job (as a supervisor would), and the final model
// is bitwise identical to the same run without the kill.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

using ::shardps::testing::Daemon;

constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";
constexpr int kWorkers = 2;
constexpr int kEvery = 20;

std::vector<std::string> WorkerFlags() {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-64-32-10",
          "--batch_size=64",
          "--max_steps=200",
          "--train_limit=12800",
          "--test_limit=500",
          "--chunk_kib=16",
          "--backend=cpu",
          "--seed=9",
          "--optimizer=adam",
          "--lr=0.002",
          "--fault_step_delay_ms=5"};
}

// A job: servers and workers as separate processes on 127.0.0.1.
struct Job {
  std::vector<std::unique_ptr<Daemon>> servers;
  std::vector<std::unique_ptr<Daemon>> workers;
};

absl::StatusOr<Job> StartJob(int num_servers, const std::string& ckpt_dir,
                             const std::string& model_out) {
  const int kServers = num_servers;
  Job job;
  std::vector<std::string> addresses;
  for (int s = 0; s < kServers; ++s) {
    std::vector<std::string> args = {absl::StrCat("--shard_index=", s),
                                     absl::StrCat("--num_shards=", kServers),
                                     absl::StrCat("--num_workers=", kWorkers)};
    if (!ckpt_dir.empty()) {
      args.push_back("--checkpoint_dir=" + ckpt_dir);
      args.push_back(absl::StrCat("--checkpoint_every_steps=", kEvery));
    }
    absl::StatusOr<std::unique_ptr<Daemon>> d =
        Daemon::Start(absl::StrCat("server-", s), SHARDPS_SERVER_BIN, args);
    if (!d.ok()) return d.status();
    addresses.push_back((*d)->address());
    job.servers.push_back(*std::move(d));
  }
  for (int r = 0; r < kWorkers; ++r) {
    std::vector<std::string> args = WorkerFlags();
    args.push_back("--servers=" + absl::StrJoin(addresses, ","));
    args.push_back(absl::StrCat("--rank=", r));
    args.push_back(absl::StrCat("--num_workers=", kWorkers));
    if (r == 0) args.push_back("--model_out=" + model_out);
    absl::StatusOr<std::unique_ptr<Daemon>> w = Daemon::StartProcess(
        absl::StrCat("worker-", r), SHARDPS_WORKER_BIN, args);
    if (!w.ok()) return w.status();
    job.workers.push_back(*std::move(w));
  }
  return job;
}

absl::Status WaitForWorkers(Job& job) {
  for (auto& w : job.workers) {
    absl::StatusOr<int> code = w->Wait(absl::Seconds(240));
    if (!code.ok()) return code.status();
    if (*code != 0) {
      return absl::InternalError(
          absl::StrCat("worker exited with ", *code, ":\n", w->ReadLog()));
    }
  }
  return absl::OkStatus();
}

// The newest committed checkpoint step in `dir`, or -1.
int64_t NewestCommitted(const std::string& dir) {
  int64_t newest = -1;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (!absl::StartsWith(name, "step-")) continue;
    struct stat st;
    if (stat((dir + "/" + name + "/COMMITTED").c_str(), &st) == 0) {
      newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
    }
  }
  closedir(d);
  return newest;
}

absl::StatusOr<std::vector<LoadedTensor>> ReferenceModel() {
  const std::string out =
      testing::MakeTempDir("shardps-ref") + "/model.safetensors";
  absl::StatusOr<Job> job = StartJob(2, "", out);
  if (!job.ok()) return job.status();
  if (absl::Status s = WaitForWorkers(*job); !s.ok()) return s;
  return ReadSafetensors(out);
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
  struct stat st;
  if (stat(kFashionMnist, &st) != 0) {
    GTEST_SKIP() << "no " << kFashionMnist
                 << " (apt-get install dataset-fashion-mnist)";
  }
  absl::StatusOr<std::vector<LoadedTensor>> want = ReferenceModel();
  SHARDPS_ASSERT_OK(want);

  const std::string ckpt = testing::MakeTempDir("shardps-ckpt");
  const std::string out =
      testing::MakeTempDir("shardps-killed") + "/model.safetensors";
  // Kill once a checkpoint at a random multiple of kEvery is committed.
  std::mt19937 rng(static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  const int64_t kill_after = kEvery * (1 + rng() % 5);
  {
    absl::StatusOr<Job> job = StartJob(servers, ckpt, out);
    SHARDPS_ASSERT_OK(job);
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (NewestCommitted(ckpt) < kill_after && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_GE(NewestCommitted(ckpt), kill_after);
    Daemon* target = victim == Victim::kServer ? job->servers[1].get()
                                               : job->workers[1].get();
    SHARDPS_ASSERT_OK(target->Stop(SIGKILL, absl::Seconds(10)));
    std::printf("killed %s after the checkpoint of step %ld was committed\n",
                victim == Victim::kServer ? "server-1" : "worker-1",
                static_cast<long>(NewestCommitted(ckpt)));
    // The supervisor restarts the whole job: stop what is left.
  }
  const int64_t restored = NewestCommitted(ckpt);
  const absl::Time restart = absl::Now();
  absl::StatusOr<Job> again = StartJob(restart_servers, ckpt, out);
  SHARDPS_ASSERT_OK(again);
  SHARDPS_ASSERT_OK(WaitForWorkers(*again));
  std::printf("restarted from step %ld; finished %.2f s after the restart\n",
              static_cast<long>(restored),
              absl::ToDoubleSeconds(absl::Now() - restart));
  EXPECT_NE(again->servers[0]->ReadLog().find(absl::StrCat(
                "restored from the checkpoint of step ", restored)),
            std::string::npos)
      << again->servers[0]->ReadLog();
  EXPECT_NE(again->workers[0]->ReadLog().find(
                absl::StrCat("resuming at step ", restored)),
            std::string::npos)
      << again->workers[0]->ReadLog();
  absl::StatusOr<std::vector<LoadedTensor>> got = ReadSafetensors(out);
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
