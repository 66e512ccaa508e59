// A whole job through the coordinator, every daemon a process on 127.0.0.1:
// servers and workers get only --coordinator (no static lists), every process
// exits 0 by itself when the workers are done, and the model equals the one
// of the same job run with static lists. Also: workers that start before the
// servers wait for them, and shardps-ctl status lists the members.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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
using ::shardps::testing::Await;
using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::MustRun;
using ::shardps::testing::TestCluster;
using ::shardps::testing::WaitForLog;

// Training a short job takes seconds; the deadlines allow a loaded machine.
constexpr absl::Duration kTrainTimeout = absl::Minutes(3);
constexpr absl::Duration kSelfExitTimeout = absl::Seconds(60);

std::vector<std::string> TrainingArgs() {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-32-10",
          "--max_steps=30",
          "--train_limit=2048",
          "--test_limit=500",
          "--batch_size=64",
          "--backend=cpu"};
}

// Two servers and two workers. Coordinated: servers and workers know only
// the coordinator (a server reports its port once joined), and every worker
// may write the model (only the one given rank 0 does).
ClusterOptions Job(bool coordinated) {
  ClusterOptions o;
  o.coordinated = coordinated;
  o.num_servers = 2;
  o.num_workers = 2;
  o.worker_flags = TrainingArgs();
  return o;
}

// The model of the same job with static lists: explicit shapes and
// addresses, servers stopped by SIGTERM.
std::string TrainStatic() {
  TestCluster job(Job(/*coordinated=*/false));
  if (!job.StartServers() ||
      !job.StartWorkers({{job.model_out_flag()}, {job.model_out_flag()}})) {
    return "";
  }
  job.ExpectWorkersExitZero(kTrainTimeout);
  return job.ModelBytes();
}

class CoordinatedJobTest : public ::testing::Test {
 protected:
  CoordinatedJobTest() : job_(Job(/*coordinated=*/true)) {}
  void SetUp() override {
    if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  }
  TestCluster job_;
};

TEST_F(CoordinatedJobTest, EveryProcessExitsByItselfWithTheStaticModel) {
  ASSERT_NE(job_.StartCoordinator(), nullptr);
  ASSERT_TRUE(job_.StartServers());
  ASSERT_TRUE(
      job_.StartWorkers({{job_.model_out_flag()}, {job_.model_out_flag()}}));
  // Nobody signals the servers: the coordinator tells them the job ended.
  job_.ExpectJobEnds(kTrainTimeout, kSelfExitTimeout);
  EXPECT_TRUE(absl::StrContains(job_.server(0).ReadLog(), "job e2e finished"))
      << job_.server(0).ReadLog();
  EXPECT_TRUE(absl::StrContains(job_.coordinator().ReadLog(),
                                "job finished (all 2 workers finished)"))
      << job_.coordinator().ReadLog();

  const std::string coordinated = job_.ModelBytes();
  ASSERT_FALSE(coordinated.empty())
      << job_.worker(0).ReadLog() << job_.worker(1).ReadLog();
  const std::string static_model = TrainStatic();
  ASSERT_EQ(coordinated.size(), static_model.size());
  EXPECT_TRUE(coordinated == static_model) << "models differ";
}

TEST_F(CoordinatedJobTest, EarlyWorkersWaitForTheServersAndCtlListsMembers) {
  ASSERT_NE(job_.StartCoordinator(), nullptr);
  ASSERT_TRUE(
      job_.StartWorkers({{job_.model_out_flag()}, {job_.model_out_flag()}}));
  Daemon& w0 = job_.worker(0);
  Daemon& w1 = job_.worker(1);
  // Each says what it waits for before any server exists.
  EXPECT_TRUE(WaitForLog(w0, "waiting for 2 server(s)")) << w0.ReadLog();
  EXPECT_TRUE(WaitForLog(w1, "waiting for 2 server(s)")) << w1.ReadLog();
  Daemon* s0 = job_.StartServer();
  ASSERT_NE(s0, nullptr);

  // Mid-job (one server still missing), shardps-ctl shows who is there.
  const CommandResult ctl =
      MustRun(SHARDPS_CTL_BIN,
              {"status", "--coordinator=" + job_.coordinator_address()});
  EXPECT_EQ(ctl.code, 0) << ctl.output;
  const std::string status = ctl.output;
  for (const std::string& want :
       {s0->address(), std::string("servers 1/2 alive"),
        std::string("workers 2/2 alive"), std::string("job state: running"),
        std::string("vacant")}) {
    EXPECT_TRUE(absl::StrContains(status, want)) << want << " in\n" << status;
  }

  ASSERT_NE(job_.StartServer(), nullptr);
  job_.ExpectJobEnds(kTrainTimeout, kSelfExitTimeout);
  EXPECT_TRUE(absl::StrContains(w0.ReadLog(), "told the coordinator"))
      << w0.ReadLog();
  EXPECT_TRUE(fs::exists(job_.model_path()));
}

TEST_F(CoordinatedJobTest, ServerIsNotServingUntilItHasItsShard) {
  // The coordinator is not up yet: the server listens, answers health
  // NOT_SERVING and its methods UNAVAILABLE while it waits for the shard map.
  ClusterOptions o;
  o.coordinated = true;
  o.coordinator_port = testing::FreePort();
  const int server_port = testing::FreePort();
  ASSERT_GT(o.coordinator_port, 0);
  ASSERT_GT(server_port, 0);
  TestCluster job(o);
  Daemon* server =
      job.StartServer({absl::StrCat("--port=", server_port)}, Await::kStart);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(WaitForLog(*server, "not joined yet")) << server->ReadLog();
  const std::string addr = absl::StrCat("--addr=127.0.0.1:", server_port);
  testing::CommandResult health =
      testing::RunCommand(SHARDPS_CTL_BIN, {"health", addr});
  EXPECT_NE(health.code, 0) << health.output;
  EXPECT_TRUE(absl::StrContains(health.output, "NOT_SERVING")) << health.output;
  testing::CommandResult shards = testing::RunCommand(
      SHARDPS_CTL_BIN,
      {"shards", absl::StrCat("--servers=127.0.0.1:", server_port)});
  EXPECT_TRUE(absl::StrContains(shards.output,
                                "waiting for the coordinator's shard map"))
      << shards.output;
  // Once the coordinator is there, the shard is joined and installed.
  ASSERT_NE(job.StartCoordinator(), nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    health = testing::RunCommand(SHARDPS_CTL_BIN, {"health", addr});
    if (health.code == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(health.code, 0) << health.output << server->ReadLog();
  EXPECT_TRUE(absl::StrContains(health.output, "SERVING")) << health.output;
}

}  // namespace
}  // namespace shardps
