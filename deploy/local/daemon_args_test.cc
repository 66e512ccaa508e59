#include "deploy/local/daemon_args.h"

#include <algorithm>
#include <string>
#include <vector>

#include "deploy/local/emulated_hosts.h"
#include "gtest/gtest.h"

namespace shardps::local {
namespace {

LaunchOptions Options() {
  LaunchOptions o;
  o.num_servers = 2;
  o.num_workers = 3;
  o.mode = "async";
  o.training_args = {"--epochs=1"};
  return o;
}

TEST(DaemonArgsTest, CoordinatorGetsTheJobShapeAndAPortFile) {
  const RunDir dir("/r");
  EXPECT_EQ(CoordinatorArgs(Options(), dir, 0),
            (std::vector<std::string>{
                "--num_servers=2", "--num_workers=3", "--port=0",
                "--port_file=/r/ports/coordinator.port", "--log_format=text"}));
  // A restarted coordinator keeps its port.
  EXPECT_EQ(CoordinatorArgs(Options(), dir, 7000)[2], "--port=7000");
}

TEST(DaemonArgsTest, EveryDaemonGetsTheSecurityFlags) {
  const RunDir dir("/r");
  LaunchOptions o = Options();
  o.security_args = {"--tls_cert=/t/tls.crt", "--tls_key=/t/tls.key",
                     "--tls_ca=/t/ca.crt", "--auth_token_file=/t/token"};
  for (const std::vector<std::string>& args :
       {CoordinatorArgs(o, dir, 0), ServerArgs(o, dir, 0, "127.0.0.1:7"),
        ServerArgs(o, dir, 1, ""), WorkerArgs(o, dir, 0, "127.0.0.1:7", {}),
        WorkerArgs(o, dir, 1, "", {"127.0.0.1:5", "127.0.0.1:6"})}) {
    for (const std::string& flag : o.security_args) {
      EXPECT_NE(std::find(args.begin(), args.end(), flag), args.end())
          << flag << " missing from " << args[0];
    }
  }
}

TEST(DaemonArgsTest, WithACoordinatorMembersGetItsAddressInsteadOfLists) {
  const RunDir dir("/r");
  EXPECT_EQ(ServerArgs(Options(), dir, 1, "127.0.0.1:7"),
            (std::vector<std::string>{
                "--shard_index=1", "--coordinator=127.0.0.1:7", "--mode=async",
                "--port=0", "--port_file=/r/ports/server-1.port",
                "--log_format=text"}));
  EXPECT_EQ(WorkerArgs(Options(), dir, 2, "127.0.0.1:7", {}),
            (std::vector<std::string>{
                "--rank=2", "--coordinator=127.0.0.1:7", "--epochs=1",
                "--metrics_csv=/r/metrics.csv",
                "--model_out=/r/model.safetensors", "--log_format=text"}));
}

TEST(DaemonArgsTest, EveryWorkerGetsTheOutputPathsAnyOneMayLead) {
  // With a coordinator the lowest rank left takes over from rank 0.
  const RunDir dir("/r");
  for (int rank = 0; rank < 3; ++rank) {
    for (const std::vector<std::string>& args :
         {WorkerArgs(Options(), dir, rank, "127.0.0.1:7", {}),
          WorkerArgs(Options(), dir, rank, "", {"h:1", "h:2"})}) {
      for (const char* flag : {"--metrics_csv=/r/metrics.csv",
                               "--model_out=/r/model.safetensors"}) {
        EXPECT_NE(std::find(args.begin(), args.end(), flag), args.end())
            << flag << " missing for rank " << rank;
      }
    }
  }
}

TEST(DaemonArgsTest, StaticModeGivesTheShapeAndTheServers) {
  const RunDir dir("/r");
  EXPECT_EQ(ServerArgs(Options(), dir, 0, ""),
            (std::vector<std::string>{
                "--shard_index=0", "--num_shards=2", "--num_workers=3",
                "--mode=async", "--port=0",
                "--port_file=/r/ports/server-0.port", "--log_format=text"}));
  EXPECT_EQ(WorkerArgs(Options(), dir, 0, "", {"h:1", "h:2"}),
            (std::vector<std::string>{
                "--rank=0", "--servers=h:1,h:2", "--num_workers=3",
                "--epochs=1", "--metrics_csv=/r/metrics.csv",
                "--model_out=/r/model.safetensors", "--log_format=text"}));
}

TEST(DaemonArgsTest, ServersGetTheCheckpointFlagsAndWorkersTheExtraArgs) {
  const RunDir dir("/r");
  LaunchOptions o = Options();
  o.checkpoint_dir = "/r/checkpoints";
  o.checkpoint_every_steps = 20;
  o.keep_checkpoints = 2;
  o.worker_extra_args = {"--fault_step_delay_ms=5", "--epochs=3"};
  EXPECT_EQ(
      ServerArgs(o, dir, 1, "127.0.0.1:7"),
      (std::vector<std::string>{
          "--shard_index=1", "--coordinator=127.0.0.1:7", "--mode=async",
          "--checkpoint_dir=/r/checkpoints", "--checkpoint_every_steps=20",
          "--keep_checkpoints=2", "--port=0",
          "--port_file=/r/ports/server-1.port", "--log_format=text"}));
  // Last, so that they win over a training flag of the same name.
  EXPECT_EQ(
      WorkerArgs(o, dir, 1, "127.0.0.1:7", {}),
      (std::vector<std::string>{
          "--rank=1", "--coordinator=127.0.0.1:7", "--epochs=1",
          "--metrics_csv=/r/metrics.csv", "--model_out=/r/model.safetensors",
          "--log_format=text", "--fault_step_delay_ms=5", "--epochs=3"}));
}

TEST(DaemonArgsTest, EmulatedHostsBindTheirAddressWithoutSharedMemory) {
  const RunDir dir("/r");
  LaunchOptions o = Options();
  o.emulate_hosts = true;
  o.link_bits_per_second = 1000000000;
  o.training_args = {"--epochs=1", "--shared_memory=true", "--link_rate="};
  const std::vector<std::string> coordinator = CoordinatorArgs(o, dir, 0);
  EXPECT_NE(
      std::find(coordinator.begin(), coordinator.end(), "--host=10.213.0.1"),
      coordinator.end());
  const std::vector<std::string> server = ServerArgs(o, dir, 1, "10.213.0.1:7");
  // The links' rate sizes the receive buffers of the server's connections.
  for (const char* flag : {"--host=10.213.0.3", "--shared_memory=false",
                           "--link_rate=1000000000bit"}) {
    EXPECT_NE(std::find(server.begin(), server.end(), flag), server.end())
        << flag;
  }
  // In place of the training flags' --shared_memory, and the links' rate
  // for automatic chunks where the user gave none.
  EXPECT_EQ(WorkerArgs(o, dir, 2, "10.213.0.1:7", {}),
            (std::vector<std::string>{
                "--rank=2", "--coordinator=10.213.0.1:7", "--epochs=1",
                "--shared_memory=false", "--link_rate=1000000000bit",
                "--metrics_csv=/r/metrics.csv",
                "--model_out=/r/model.safetensors", "--log_format=text"}));
  // A rate the user gave is kept.
  o.training_args = {"--link_rate=10gbit"};
  const std::vector<std::string> worker =
      WorkerArgs(o, dir, 2, "10.213.0.1:7", {});
  EXPECT_EQ(std::count_if(worker.begin(), worker.end(),
                          [](const std::string& a) {
                            return a.rfind("--link_rate=", 0) == 0;
                          }),
            1);
  EXPECT_NE(std::find(worker.begin(), worker.end(), "--link_rate=10gbit"),
            worker.end());
}

TEST(DaemonArgsTest, EmulatedHostsAreNumberedByRoleInOneSubnet) {
  LaunchOptions o = Options();
  o.emulate_hosts = true;
  const std::vector<EmulatedHost> hosts = JobHosts(o);
  std::vector<std::string> got;
  for (const EmulatedHost& h : hosts) got.push_back(h.name + " " + h.address);
  EXPECT_EQ(got, (std::vector<std::string>{
                     "coordinator 10.213.0.1", "server-0 10.213.0.2",
                     "server-1 10.213.0.3", "worker-0 10.213.0.4",
                     "worker-1 10.213.0.5", "worker-2 10.213.0.6"}));
  EXPECT_EQ(DaemonHost(o, "worker-2"), "10.213.0.6");
  // Static mode keeps the numbers, without the coordinator's host.
  o.use_coordinator = false;
  EXPECT_EQ(JobHosts(o).front().address, "10.213.0.2");
  o.emulate_hosts = false;
  EXPECT_EQ(DaemonHost(o, "server-1"), "127.0.0.1");
}

}  // namespace
}  // namespace shardps::local
