// A whole job through the coordinator, every daemon a process on 127.0.0.1:
// servers and workers get only --coordinator (no static lists), every process
// exits 0 by itself when the workers are done, and the model equals the one
// of the same job run with static lists. Also: workers that start before the
// servers wait for them, and shardps-ctl status lists the members.
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;
using ::shardps::testing::Daemon;
using ::shardps::testing::ExpectExitsZero;
using ::shardps::testing::Must;
using ::shardps::testing::ReadFile;
using ::shardps::testing::WaitForLog;

constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";
constexpr char kJob[] = "--job_id=e2e";
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

std::unique_ptr<Daemon> StartCoordinator() {
  return Must(Daemon::Start("coordinator", SHARDPS_COORDINATOR_BIN,
                            {kJob, "--num_servers=2", "--num_workers=2"}));
}

// A server that knows only the coordinator; it reports its port once joined.
std::unique_ptr<Daemon> StartServer(const std::string& name,
                                    const Daemon& coordinator) {
  return Must(Daemon::Start(
      name, SHARDPS_SERVER_BIN,
      {kJob, absl::StrCat("--coordinator=", coordinator.address())}));
}

std::unique_ptr<Daemon> StartWorker(const std::string& name,
                                    const Daemon& coordinator,
                                    const std::string& model_out) {
  std::vector<std::string> args = TrainingArgs();
  args.push_back(kJob);
  args.push_back(absl::StrCat("--coordinator=", coordinator.address()));
  args.push_back(absl::StrCat("--model_out=", model_out));
  return Must(Daemon::StartProcess(name, SHARDPS_WORKER_BIN, args));
}

// The model of the same job with static lists: explicit shapes and
// addresses, servers stopped by SIGTERM.
std::string TrainStatic(const std::string& dir) {
  std::vector<std::unique_ptr<Daemon>> servers;
  std::string addresses;
  for (int s = 0; s < 2; ++s) {
    servers.push_back(Must(
        Daemon::Start(absl::StrCat("static-server-", s), SHARDPS_SERVER_BIN,
                      {absl::StrCat("--shard_index=", s), "--num_shards=2",
                       "--num_workers=2"})));
    if (servers.back() == nullptr) return "";
    absl::StrAppend(&addresses, s == 0 ? "" : ",", servers.back()->address());
  }
  const std::string model = dir + "/static.safetensors";
  std::vector<std::unique_ptr<Daemon>> workers;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> args = TrainingArgs();
    args.insert(args.end(),
                {"--servers=" + addresses, absl::StrCat("--rank=", r),
                 "--num_workers=2", "--model_out=" + model});
    workers.push_back(Must(Daemon::StartProcess(
        absl::StrCat("static-worker-", r), SHARDPS_WORKER_BIN, args)));
  }
  for (auto& w : workers) ExpectExitsZero(w.get(), kTrainTimeout);
  return ReadFile(model);
}

class CoordinatedJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kFashionMnist)) {
      GTEST_SKIP() << kFashionMnist
                   << " is missing: apt-get install dataset-fashion-mnist";
    }
    dir_ = testing::MakeTempDir("shardps-coordinated");
  }
  std::string dir_;
};

TEST_F(CoordinatedJobTest, EveryProcessExitsByItselfWithTheStaticModel) {
  std::unique_ptr<Daemon> coordinator = StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  std::unique_ptr<Daemon> s0 = StartServer("server-0", *coordinator);
  std::unique_ptr<Daemon> s1 = StartServer("server-1", *coordinator);
  ASSERT_NE(s0, nullptr);
  ASSERT_NE(s1, nullptr);
  // Both workers may write the model: only the one given rank 0 does.
  const std::string model = dir_ + "/coordinated.safetensors";
  std::unique_ptr<Daemon> w0 = StartWorker("worker-a", *coordinator, model);
  std::unique_ptr<Daemon> w1 = StartWorker("worker-b", *coordinator, model);
  ExpectExitsZero(w0.get(), kTrainTimeout);
  ExpectExitsZero(w1.get(), kTrainTimeout);
  // Nobody signals them: the coordinator tells the servers the job ended.
  ExpectExitsZero(s0.get(), kSelfExitTimeout);
  ExpectExitsZero(s1.get(), kSelfExitTimeout);
  ExpectExitsZero(coordinator.get(), kSelfExitTimeout);
  EXPECT_TRUE(absl::StrContains(s0->ReadLog(), "job e2e finished"))
      << s0->ReadLog();
  EXPECT_TRUE(absl::StrContains(coordinator->ReadLog(),
                                "job finished (all 2 workers finished)"))
      << coordinator->ReadLog();

  const std::string coordinated = ReadFile(model);
  ASSERT_FALSE(coordinated.empty()) << w0->ReadLog() << w1->ReadLog();
  const std::string static_model = TrainStatic(dir_);
  ASSERT_EQ(coordinated.size(), static_model.size());
  EXPECT_TRUE(coordinated == static_model) << "models differ";
}

TEST_F(CoordinatedJobTest, EarlyWorkersWaitForTheServersAndCtlListsMembers) {
  std::unique_ptr<Daemon> coordinator = StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  const std::string model = dir_ + "/model.safetensors";
  std::unique_ptr<Daemon> w0 = StartWorker("worker-a", *coordinator, model);
  std::unique_ptr<Daemon> w1 = StartWorker("worker-b", *coordinator, model);
  ASSERT_NE(w0, nullptr);
  ASSERT_NE(w1, nullptr);
  // Each says what it waits for before any server exists.
  EXPECT_TRUE(WaitForLog(*w0, "waiting for 2 server(s)")) << w0->ReadLog();
  EXPECT_TRUE(WaitForLog(*w1, "waiting for 2 server(s)")) << w1->ReadLog();
  std::unique_ptr<Daemon> s0 = StartServer("server-0", *coordinator);
  ASSERT_NE(s0, nullptr);

  // Mid-job (one server still missing), shardps-ctl shows who is there.
  std::unique_ptr<Daemon> ctl = Must(Daemon::StartProcess(
      "ctl", SHARDPS_CTL_BIN,
      {"status", absl::StrCat("--coordinator=", coordinator->address())}));
  ExpectExitsZero(ctl.get(), absl::Seconds(30));
  const std::string status = ctl->ReadLog();
  for (const std::string& want :
       {s0->address(), std::string("servers 1/2 alive"),
        std::string("workers 2/2 alive"), std::string("job state: running"),
        std::string("vacant")}) {
    EXPECT_TRUE(absl::StrContains(status, want)) << want << " in\n" << status;
  }

  std::unique_ptr<Daemon> s1 = StartServer("server-1", *coordinator);
  ASSERT_NE(s1, nullptr);
  ExpectExitsZero(w0.get(), kTrainTimeout);
  ExpectExitsZero(w1.get(), kTrainTimeout);
  ExpectExitsZero(s0.get(), kSelfExitTimeout);
  ExpectExitsZero(s1.get(), kSelfExitTimeout);
  ExpectExitsZero(coordinator.get(), kSelfExitTimeout);
  EXPECT_TRUE(absl::StrContains(w0->ReadLog(), "told the coordinator"))
      << w0->ReadLog();
  EXPECT_TRUE(fs::exists(model));
}

TEST_F(CoordinatedJobTest, ServerIsNotServingUntilItHasItsShard) {
  // The coordinator is not up yet: the server listens, answers health
  // NOT_SERVING and its methods UNAVAILABLE while it waits for the shard map.
  const int coordinator_port = testing::FreePort();
  const int server_port = testing::FreePort();
  ASSERT_GT(coordinator_port, 0);
  ASSERT_GT(server_port, 0);
  std::unique_ptr<Daemon> server = Must(Daemon::StartProcess(
      "server", SHARDPS_SERVER_BIN,
      {kJob, absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
       absl::StrCat("--port=", server_port)}));
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
  std::unique_ptr<Daemon> coordinator =
      Must(Daemon::Start("coordinator", SHARDPS_COORDINATOR_BIN,
                         {kJob, "--num_servers=1", "--num_workers=1",
                          absl::StrCat("--port=", coordinator_port)}));
  ASSERT_NE(coordinator, nullptr);
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
