#include "coordinator/client/coordinator_client.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/port_reservation.h"
#include "common/status_matchers.h"
#include "coordinator/client/join_job.h"
#include "coordinator/coordinator_protocol.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/membership.h"
#include "grpc/grpc.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace shardps::coordinator {
namespace {

constexpr char kJob[] = "test";

// A coordinator served in-process on a port the test reserved. Without the
// daemon's keeper thread, silent members expire only when a join or a
// heartbeat looks.
class TestCoordinator {
 public:
  TestCoordinator(int port, uint32_t servers, uint32_t workers,
                  absl::Duration heartbeat_timeout) {
    MembershipOptions o;
    o.job_id = kJob;
    o.num_servers = servers;
    o.num_workers = workers;
    o.heartbeat_timeout = heartbeat_timeout;
    o.incarnation = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    membership_ = *Membership::Create(o);
    service_ = std::make_unique<CoordinatorService>(membership_.get());
    grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port),
                             grpc::InsecureServerCredentials(), &bound);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    EXPECT_EQ(bound, port);
  }
  ~TestCoordinator() {
    service_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
    server_->Wait();
  }
  Membership* membership() { return membership_.get(); }

 private:
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
};

class CoordinatorClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<PortReservation>> r =
        PortReservation::Reserve("127.0.0.1", 0);
    ASSERT_TRUE(r.ok()) << r.status();
    reservation_ = *std::move(r);
  }
  std::string address() const {
    return absl::StrCat("127.0.0.1:", reservation_->port());
  }
  std::unique_ptr<CoordinatorClient> NewClient(
      std::function<void(const absl::Status&, absl::Duration)> on_retry = {}) {
    CoordinatorClientOptions o;
    o.coordinator = address();
    o.initial_backoff = absl::Milliseconds(20);
    o.max_backoff = absl::Milliseconds(100);
    o.on_retry = std::move(on_retry);
    return *CoordinatorClient::Create(o);
  }
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

  std::unique_ptr<PortReservation> reservation_;
};

TEST_F(CoordinatorClientTest, JoinWaitsForACoordinatorThatStartsLater) {
  absl::Notification retried;
  absl::Mutex mu;
  std::vector<absl::Status> reasons;
  std::unique_ptr<CoordinatorClient> client =
      NewClient([&](const absl::Status& s, absl::Duration) {
        absl::MutexLock lock(&mu);
        reasons.push_back(s);
        if (!retried.HasBeenNotified()) retried.Notify();
      });
  absl::Status joined;
  std::thread join([&] {
    joined = client->Join(v1::ROLE_WORKER, "w", kAnyIndex, kJob, Deadline());
  });
  ASSERT_TRUE(retried.WaitForNotificationWithTimeout(absl::Seconds(30)));
  TestCoordinator coordinator(reservation_->port(), 1, 1, absl::Seconds(30));
  join.join();
  SHARDPS_ASSERT_OK(joined);
  EXPECT_EQ(client->index(), 0u);
  EXPECT_TRUE(client->view().workers(0).alive());
  absl::MutexLock lock(&mu);
  ASSERT_FALSE(reasons.empty());
  EXPECT_EQ(reasons[0].code(), absl::StatusCode::kUnavailable) << reasons[0];
  EXPECT_TRUE(absl::StrContains(reasons[0].message(), address())) << reasons[0];
}

TEST_F(CoordinatorClientTest, JoinGivesUpAtTheDeadlineOrOnAFatalError) {
  std::unique_ptr<CoordinatorClient> client = NewClient();
  const absl::Status late = client->Join(v1::ROLE_WORKER, "w", kAnyIndex, kJob,
                                         absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_TRUE(absl::StrContains(late.message(), "UNAVAILABLE")) << late;

  TestCoordinator coordinator(reservation_->port(), 1, 1, absl::Seconds(30));
  const absl::Status wrong_job =
      NewClient()->Join(v1::ROLE_WORKER, "w", kAnyIndex, "other", Deadline());
  EXPECT_EQ(wrong_job.code(), absl::StatusCode::kFailedPrecondition)
      << wrong_job;
}

TEST_F(CoordinatorClientTest, JoinJobTellsEachRetryInOneLine) {
  absl::Mutex mu;
  std::vector<std::string> lines;
  JoinOptions o;
  o.client.coordinator = address();
  o.client.initial_backoff = absl::Milliseconds(20);
  o.client.max_backoff = absl::Milliseconds(100);
  o.role = v1::ROLE_WORKER;
  o.address = "w";
  o.job_id = kJob;
  o.timeout = absl::Milliseconds(300);
  o.on_retry = [&](const std::string& line) {
    absl::MutexLock lock(&mu);
    lines.push_back(line);
  };
  const absl::StatusOr<std::unique_ptr<CoordinatorClient>> late = JoinJob(o);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded)
      << late.status();
  {
    absl::MutexLock lock(&mu);
    ASSERT_FALSE(lines.empty());
    EXPECT_TRUE(absl::StartsWith(lines[0], "not joined yet (UNAVAILABLE: "))
        << lines[0];
    EXPECT_TRUE(absl::StrContains(lines[0], "; retrying in ")) << lines[0];
  }

  TestCoordinator coordinator(reservation_->port(), 1, 1, absl::Seconds(30));
  o.timeout = absl::Seconds(30);
  o.requested_index = 0;
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> joined = JoinJob(o);
  SHARDPS_ASSERT_OK(joined);
  EXPECT_EQ((*joined)->index(), 0u);
  EXPECT_TRUE((*joined)->view().workers(0).alive());
}

TEST_F(CoordinatorClientTest, ViewsProgressAndFinishingEndTheJob) {
  TestCoordinator coordinator(reservation_->port(), 1, 2, absl::Seconds(30));
  std::unique_ptr<CoordinatorClient> server = NewClient();
  SHARDPS_ASSERT_OK(
      server->Join(v1::ROLE_SERVER, "h:1", kAnyIndex, kJob, Deadline()));
  std::unique_ptr<CoordinatorClient> w0 = NewClient();
  SHARDPS_ASSERT_OK(
      w0->Join(v1::ROLE_WORKER, "a", kAnyIndex, kJob, Deadline()));
  absl::StatusOr<v1::ClusterView> early =
      w0->WaitForView(ReadyToTrain, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(early.status().message(), "workers 1/2 alive"))
      << early.status();

  std::unique_ptr<CoordinatorClient> w1 = NewClient();
  SHARDPS_ASSERT_OK(
      w1->Join(v1::ROLE_WORKER, "b", kAnyIndex, kJob, Deadline()));
  EXPECT_EQ(w1->index(), 1u);
  absl::StatusOr<v1::ClusterView> ready =
      w0->WaitForView(ReadyToTrain, Deadline());
  SHARDPS_ASSERT_OK(ready);
  EXPECT_EQ(ready->servers(0).address(), "h:1");

  SHARDPS_ASSERT_OK(w0->Finish(Deadline()));
  EXPECT_FALSE(coordinator.membership()->job_finished());
  // A worker that finished early does not hold the others up.
  EXPECT_TRUE(ReadyToTrain(coordinator.membership()->View()));
  SHARDPS_ASSERT_OK(w1->Finish(Deadline()));
  absl::StatusOr<v1::ClusterView> done = server->WaitForView(
      [](const v1::ClusterView& v) { return v.job_finished(); }, Deadline());
  SHARDPS_ASSERT_OK(done);
  EXPECT_TRUE(server->job_finished());
  EXPECT_TRUE(
      absl::StrContains(DescribeView(*done), "2 finished; job finished"))
      << DescribeView(*done);
  SHARDPS_EXPECT_OK(server->Leave(Deadline()));
}

TEST_F(CoordinatorClientTest, HeartbeatsReportProgress) {
  TestCoordinator coordinator(reservation_->port(), 1, 1,
                              absl::Milliseconds(300));
  std::unique_ptr<CoordinatorClient> worker = NewClient();
  SHARDPS_ASSERT_OK(
      worker->Join(v1::ROLE_WORKER, "w", kAnyIndex, kJob, Deadline()));
  worker->SetProgress(7, 2);
  const absl::Time deadline = Deadline();
  while (coordinator.membership()->View().global_step() != 7 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(coordinator.membership()->View().global_step(), 7);
  EXPECT_EQ(coordinator.membership()->View().epoch(), 2);
  // Heartbeats (every 100 ms) kept it alive past the 300 ms timeout.
  EXPECT_TRUE(coordinator.membership()->View().workers(0).alive());
  SHARDPS_EXPECT_OK(worker->health());
}

TEST_F(CoordinatorClientTest, RestartingServerWaitsForItsOldIndex) {
  TestCoordinator coordinator(reservation_->port(), 1, 1,
                              absl::Milliseconds(300));
  // The old server process: joined, then silent.
  v1::JoinRequest old;
  old.set_job_id(kJob);
  old.set_protocol_version(kCoordinatorProtocolVersion);
  old.set_role(v1::ROLE_SERVER);
  old.set_address("127.0.0.1:1");
  old.set_requested_index(0);
  SHARDPS_ASSERT_OK(coordinator.membership()->Join(old));
  std::vector<absl::StatusCode> codes;
  std::unique_ptr<CoordinatorClient> restarted =
      NewClient([&](const absl::Status& s, absl::Duration) {
        codes.push_back(s.code());  // Join's own thread
      });
  SHARDPS_ASSERT_OK(
      restarted->Join(v1::ROLE_SERVER, "127.0.0.1:2", 0, kJob, Deadline()));
  EXPECT_EQ(restarted->index(), 0u);
  ASSERT_FALSE(codes.empty());
  EXPECT_EQ(codes[0], absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(restarted->view().servers(0).address(), "127.0.0.1:2");
}

TEST_F(CoordinatorClientTest, RejoinsARestartedCoordinator) {
  auto coordinator = std::make_unique<TestCoordinator>(
      reservation_->port(), 1, 1, absl::Milliseconds(300));
  std::unique_ptr<CoordinatorClient> server = NewClient();
  SHARDPS_ASSERT_OK(server->Join(v1::ROLE_SERVER, "127.0.0.1:9", kAnyIndex,
                                 kJob, Deadline()));
  coordinator.reset();
  coordinator = std::make_unique<TestCoordinator>(reservation_->port(), 1, 1,
                                                  absl::Milliseconds(300));
  // The new coordinator does not know the member id: a heartbeat gets
  // NOT_FOUND and the client joins again, with the same index.
  const absl::Time deadline = Deadline();
  while (server->rejoins() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server->rejoins(), 1);
  const v1::ClusterView view = coordinator->membership()->View();
  EXPECT_TRUE(view.servers(0).alive());
  EXPECT_EQ(view.servers(0).address(), "127.0.0.1:9");
  EXPECT_EQ(server->view().generation(), view.generation());
}

v1::CollectiveRequest SumOfOne(uint64_t sequence, float value) {
  v1::CollectiveRequest r;
  r.set_sequence(sequence);
  r.set_op(v1::COLLECTIVE_OP_SUM);
  r.set_dtype(v1::COLLECTIVE_DTYPE_FLOAT32);
  r.add_shape(1);
  r.set_values(std::string(reinterpret_cast<const char*>(&value), 4));
  r.set_timeout_ms(30000);
  return r;
}

TEST_F(CoordinatorClientTest, CollectivesMeetAtTheCoordinator) {
  TestCoordinator coordinator(reservation_->port(), 1, 2, absl::Seconds(30));
  std::unique_ptr<CoordinatorClient> a = NewClient();
  std::unique_ptr<CoordinatorClient> b = NewClient();
  SHARDPS_ASSERT_OK(a->Join(v1::ROLE_WORKER, "a", 0, kJob, Deadline()));
  SHARDPS_ASSERT_OK(b->Join(v1::ROLE_WORKER, "b", 1, kJob, Deadline()));
  absl::StatusOr<v1::CollectiveResponse> from_a;
  std::thread call([&] { from_a = a->Collective(SumOfOne(1, 0.5f)); });
  absl::StatusOr<v1::CollectiveResponse> from_b =
      b->Collective(SumOfOne(1, 0.25f));
  call.join();
  SHARDPS_ASSERT_OK(from_a);
  SHARDPS_ASSERT_OK(from_b);
  EXPECT_EQ(from_a->values(), from_b->values());
  float sum = 0;
  std::memcpy(&sum, from_a->values().data(), 4);
  EXPECT_EQ(sum, 0.75f);
}

}  // namespace
}  // namespace shardps::coordinator
