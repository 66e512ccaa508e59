// End to end: a real shardps-coordinator process on 127.0.0.1, members played
// by gRPC stubs in the test, and shardps-ctl run as a process against it.
#include <signal.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "coordinator/coordinator_protocol.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "shardps/v1/coordinator.grpc.pb.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::MustRun;
using ::shardps::testing::TestCluster;
using ::shardps::testing::WaitForLog;

constexpr char kServerA[] = "127.0.0.1:50001";
constexpr char kServerB[] = "127.0.0.1:50002";

// The coordinator of a job of 2 servers and 2 workers, played by the test.
ClusterOptions Job(int heartbeat_timeout_ms = 30000) {
  ClusterOptions o;
  o.coordinated = true;
  o.num_servers = 2;
  o.num_workers = 2;
  o.coordinator_flags = {
      absl::StrCat("--heartbeat_timeout_ms=", heartbeat_timeout_ms)};
  return o;
}

std::unique_ptr<v1::Coordinator::Stub> Connect(const Daemon& d) {
  return v1::Coordinator::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
}

void SetDeadline(grpc::ClientContext* ctx,
                 absl::Duration timeout = absl::Seconds(10)) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(timeout));
}

v1::JoinRequest Request(v1::Role role, const std::string& address,
                        int32_t index = coordinator::kAnyIndex) {
  v1::JoinRequest r;
  r.set_job_id("e2e");
  r.set_protocol_version(coordinator::kCoordinatorProtocolVersion);
  r.set_role(role);
  r.set_address(address);
  r.set_requested_index(index);
  return r;
}

grpc::Status Join(v1::Coordinator::Stub* stub, const v1::JoinRequest& r,
                  v1::JoinResponse* response) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return stub->Join(&ctx, r, response);
}

grpc::Status Beat(v1::Coordinator::Stub* stub, const std::string& member_id,
                  v1::HeartbeatResponse* response) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::HeartbeatRequest r;
  r.set_member_id(member_id);
  return stub->Heartbeat(&ctx, r, response);
}

v1::ClusterView JobView(v1::Coordinator::Stub* stub) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::JobStatus status;
  EXPECT_TRUE(stub->GetJobStatus(&ctx, v1::JobStatusRequest(), &status).ok());
  return status.view();
}

// One WatchCluster stream with a deadline; cancelled when destroyed.
class Watcher {
 public:
  Watcher(v1::Coordinator::Stub* stub, uint64_t after_generation) {
    SetDeadline(&ctx_, absl::Seconds(60));
    v1::WatchRequest r;
    r.set_after_generation(after_generation);
    reader_ = stub->WatchCluster(&ctx_, r);
  }
  ~Watcher() {
    if (finished_) return;
    ctx_.TryCancel();
    v1::ClusterView ignored;
    while (reader_->Read(&ignored)) {
    }
    reader_->Finish().ok();
  }

  // Reads views until `done` holds for one and returns it; nullopt if the
  // stream ends first. Checks that generations only increase.
  std::optional<v1::ClusterView> ReadUntil(
      const std::function<bool(const v1::ClusterView&)>& done) {
    v1::ClusterView view;
    while (reader_->Read(&view)) {
      EXPECT_GT(view.generation(), last_generation_);
      last_generation_ = view.generation();
      if (done(view)) return view;
    }
    return std::nullopt;
  }
  grpc::Status Finish() {
    v1::ClusterView ignored;
    while (reader_->Read(&ignored)) {
    }
    finished_ = true;
    return reader_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> reader_;
  uint64_t last_generation_ = 0;
  bool finished_ = false;
};

CommandResult RunCtl(std::vector<std::string> args) {
  return MustRun(SHARDPS_CTL_BIN, std::move(args));
}

TEST(CoordinatorE2ETest, MembersJoinAndWatchersSeeEveryGeneration) {
  TestCluster cluster(Job());
  Daemon* coordinator = cluster.StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  auto stub = Connect(*coordinator);
  Watcher watcher(stub.get(), 0);
  std::optional<v1::ClusterView> first =
      watcher.ReadUntil([](const v1::ClusterView&) { return true; });
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->generation(), 1u);
  EXPECT_FALSE(first->complete());

  v1::JoinResponse a, b, w0, w1;
  ASSERT_TRUE(Join(stub.get(), Request(v1::ROLE_SERVER, kServerB, 1), &b).ok());
  ASSERT_TRUE(Join(stub.get(), Request(v1::ROLE_SERVER, kServerA), &a).ok());
  ASSERT_TRUE(Join(stub.get(), Request(v1::ROLE_WORKER, "w"), &w0).ok());
  ASSERT_TRUE(Join(stub.get(), Request(v1::ROLE_WORKER, "w"), &w1).ok());
  EXPECT_EQ(b.index(), 1u);
  EXPECT_EQ(a.index(), 0u);
  EXPECT_EQ(w0.index(), 0u);
  EXPECT_EQ(w1.index(), 1u);
  EXPECT_EQ(w1.view().generation(), 5u);
  EXPECT_TRUE(w1.view().complete());
  EXPECT_EQ(w1.view().servers(0).address(), kServerA);

  std::optional<v1::ClusterView> complete = watcher.ReadUntil(
      [](const v1::ClusterView& v) { return v.generation() == 5; });
  ASSERT_TRUE(complete.has_value());
  EXPECT_TRUE(complete->complete());
  v1::HeartbeatResponse beat;
  ASSERT_TRUE(Beat(stub.get(), a.member_id(), &beat).ok());
  EXPECT_EQ(beat.generation(), 5u);
  EXPECT_TRUE(beat.complete());

  const CommandResult status = RunCtl(
      {"status", absl::StrCat("--coordinator=", coordinator->address())});
  EXPECT_EQ(status.code, 0) << status.output;
  for (const char* want :
       {kServerA, kServerB, "generation 5", "complete: yes"}) {
    EXPECT_TRUE(absl::StrContains(status.output, want)) << want << " in\n"
                                                        << status.output;
  }

  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::LeaveRequest leave;
  leave.set_member_id(w1.member_id());
  v1::LeaveResponse left;
  ASSERT_TRUE(stub->Leave(&ctx, leave, &left).ok());
  std::optional<v1::ClusterView> after = watcher.ReadUntil(
      [](const v1::ClusterView& v) { return v.generation() == 6; });
  ASSERT_TRUE(after.has_value());
  EXPECT_FALSE(after->workers(1).alive());
  EXPECT_FALSE(after->complete());
  EXPECT_TRUE(WaitForLog(*coordinator, "worker 1 (w) left; generation 6"))
      << coordinator->ReadLog();
}

TEST(CoordinatorE2ETest, SilentMemberIsExpiredAndWatchersSeeIt) {
  TestCluster cluster(Job(/*heartbeat_timeout_ms=*/400));
  Daemon* coordinator = cluster.StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  auto stub = Connect(*coordinator);
  v1::JoinResponse server, worker;
  ASSERT_TRUE(
      Join(stub.get(), Request(v1::ROLE_SERVER, kServerA), &server).ok());
  ASSERT_TRUE(Join(stub.get(), Request(v1::ROLE_WORKER, ""), &worker).ok());
  // The worker keeps heartbeating; the server goes silent.
  std::atomic<bool> worker_lost{false};
  absl::Notification stop;
  std::thread heartbeats([&] {
    while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
      v1::HeartbeatResponse r;
      if (!Beat(stub.get(), worker.member_id(), &r).ok()) worker_lost = true;
    }
  });
  Watcher watcher(stub.get(), worker.view().generation());
  std::optional<v1::ClusterView> expired = watcher.ReadUntil(
      [](const v1::ClusterView& v) { return !v.servers(0).alive(); });
  stop.Notify();
  heartbeats.join();
  ASSERT_TRUE(expired.has_value());
  EXPECT_EQ(expired->generation(), worker.view().generation() + 1);
  EXPECT_EQ(expired->servers(0).address(), kServerA);
  EXPECT_TRUE(expired->workers(0).alive());
  EXPECT_FALSE(worker_lost);

  v1::HeartbeatResponse beat;
  EXPECT_EQ(Beat(stub.get(), server.member_id(), &beat).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(WaitForLog(*coordinator, "server 0 (127.0.0.1:50001) expired"))
      << coordinator->ReadLog();
  // The restarted server gets its shard index back.
  v1::JoinResponse again;
  ASSERT_TRUE(
      Join(stub.get(), Request(v1::ROLE_SERVER, kServerA), &again).ok());
  EXPECT_EQ(again.index(), 0u);
}

TEST(CoordinatorE2ETest, BadJoinsGetClearErrorsAndLeaveTheJobAlone) {
  TestCluster cluster(Job());
  Daemon* coordinator = cluster.StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  auto stub = Connect(*coordinator);
  v1::JoinResponse holder;
  ASSERT_TRUE(
      Join(stub.get(), Request(v1::ROLE_SERVER, kServerA, 0), &holder).ok());
  const std::string before = JobView(stub.get()).SerializeAsString();

  struct Case {
    const char* name;
    v1::JoinRequest request;
    grpc::StatusCode code;
    std::vector<std::string> message;
  };
  std::vector<Case> cases;
  cases.push_back({"duplicate shard",
                   Request(v1::ROLE_SERVER, kServerB, 0),
                   grpc::StatusCode::ALREADY_EXISTS,
                   {"shard index 0", kServerA}});
  cases.push_back({"job id",
                   Request(v1::ROLE_WORKER, ""),
                   grpc::StatusCode::FAILED_PRECONDITION,
                   {"job id \"other\"", "runs job \"e2e\""}});
  cases.back().request.set_job_id("other");
  cases.push_back({"protocol",
                   Request(v1::ROLE_WORKER, ""),
                   grpc::StatusCode::FAILED_PRECONDITION,
                   {"protocol version 2"}});
  cases.back().request.set_protocol_version(2);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::JoinResponse response;
    grpc::Status s = Join(stub.get(), c.request, &response);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    for (const std::string& part : c.message) {
      EXPECT_TRUE(absl::StrContains(s.error_message(), part))
          << s.error_message();
    }
  }
  EXPECT_EQ(JobView(stub.get()).SerializeAsString(), before);
  v1::HeartbeatResponse beat;
  EXPECT_TRUE(Beat(stub.get(), holder.member_id(), &beat).ok());
  EXPECT_TRUE(WaitForLog(*coordinator, "rejected join"))
      << coordinator->ReadLog();
}

TEST(CoordinatorE2ETest, HealthAndSigterm) {
  TestCluster cluster(Job());
  Daemon* coordinator = cluster.StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  const std::string addr = coordinator->address();
  for (const char* service : {"", "shardps.v1.Coordinator"}) {
    SCOPED_TRACE(service);
    const CommandResult health = RunCtl(
        {"health", "--addr=" + addr, absl::StrCat("--service=", service)});
    EXPECT_EQ(health.code, 0) << health.output;
    EXPECT_TRUE(absl::StrContains(health.output, "SERVING")) << health.output;
  }
  // An open watch stream does not hold up the shutdown.
  auto stub = Connect(*coordinator);
  Watcher watcher(stub.get(), 0);
  ASSERT_TRUE(watcher.ReadUntil([](const v1::ClusterView&) { return true; })
                  .has_value());
  absl::StatusOr<int> code = coordinator->Stop(SIGTERM, absl::Seconds(10));
  SHARDPS_ASSERT_OK(code);
  EXPECT_EQ(*code, 0) << coordinator->ReadLog();
  EXPECT_EQ(watcher.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);

  const CommandResult closed =
      RunCtl({"health", "--addr=" + addr, "--timeout_ms=2000"});
  EXPECT_EQ(closed.code, 1) << closed.output;
  EXPECT_TRUE(absl::StrContains(closed.output, addr)) << closed.output;
}

TEST(CoordinatorE2ETest, CtlShowsShardsAndRefusesBadUsage) {
  TestCluster cluster((ClusterOptions()));
  Daemon* server = cluster.StartServer();
  ASSERT_NE(server, nullptr);
  const CommandResult shards = RunCtl({"shards", cluster.servers_flag()});
  EXPECT_EQ(shards.code, 0) << shards.output;
  EXPECT_TRUE(absl::StrContains(shards.output, server->address()))
      << shards.output;
  EXPECT_TRUE(absl::StrContains(shards.output, "0/1")) << shards.output;

  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{}, "usage"},
      {{"frobnicate"}, "unknown subcommand"},
      {{"status"}, "--coordinator"},
      {{"health", "--addr=127.0.0.1:1", "--timeout_ms=0"}, "--timeout_ms"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const CommandResult r = RunCtl(c.args);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.message)) << r.output;
  }
}

TEST(CoordinatorE2ETest, BadFlagsExitNonZeroWithAMessage) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{"--num_servers=0"}, "--num_servers=0"},
      {{"--heartbeat_timeout_ms=0"}, "--heartbeat_timeout_ms=0"},
      {{"--job_id="}, "--job_id is empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const CommandResult r =
        MustRun(SHARDPS_COORDINATOR_BIN, c.args, absl::Seconds(10));
    EXPECT_NE(r.code, 0);
    EXPECT_TRUE(absl::StrContains(r.output, c.message)) << r.output;
  }
}

}  // namespace
}  // namespace shardps
