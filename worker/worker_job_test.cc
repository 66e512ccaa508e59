#include "worker/worker_job.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/port_reservation.h"
#include "common/status_matchers.h"
#include "coordinator/coordinator_protocol.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/membership.h"
#include "grpc/grpc.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace shardps::worker {
namespace {

// A view of `ranks.size()` workers, `alive` and `finished` per rank, and
// one server.
v1::ClusterView View(const std::vector<bool>& alive,
                     const std::vector<bool>& finished = {},
                     bool server_alive = true, int64_t global_step = 0) {
  v1::ClusterView view;
  view.set_num_shards(1);
  view.set_num_workers(static_cast<uint32_t>(alive.size()));
  view.set_global_step(global_step);
  v1::ServerSlot* s = view.add_servers();
  s->set_address("127.0.0.1:5000");
  s->set_alive(server_alive);
  for (size_t r = 0; r < alive.size(); ++r) {
    v1::WorkerSlot* w = view.add_workers();
    w->set_rank(static_cast<uint32_t>(r));
    w->set_alive(alive[r]);
    w->set_finished(r < finished.size() && finished[r]);
  }
  return view;
}

TEST(WorkerJobTest, AliveRanksAreAscendingAndSkipTheDead) {
  EXPECT_EQ(AliveRanks(View({true, false, true})),
            (std::vector<uint32_t>{0, 2}));
  EXPECT_TRUE(AliveRanks(View({false, false})).empty());
}

TEST(WorkerJobTest, TheLowestRankStillInTheJobLeads) {
  EXPECT_EQ(LeadRank(View({true, true}), 1), 0u);
  // Rank 0 died: rank 1 takes over.
  EXPECT_EQ(LeadRank(View({false, true, true}), 2), 1u);
  // Rank 0 finished its training: it stays the lead (it wrote the model).
  EXPECT_EQ(LeadRank(View({false, true}, {true, false}), 1), 0u);
  // A worker counts itself in even where its view does not show it yet.
  EXPECT_EQ(LeadRank(View({false, false, true}), 1), 1u);
  EXPECT_EQ(LeadRank(View({false, false}), 1), 1u);
}

TEST(WorkerJobTest, AJobTakesAWorkerWhenEveryoneIsThereOrItIsUnderWay) {
  EXPECT_TRUE(ReadyToJoin(View({true, true})));
  EXPECT_TRUE(ReadyToJoin(View({true, false}, {false, true})));
  // The first workers start together.
  EXPECT_FALSE(ReadyToJoin(View({true, false})));
  // Under way: a worker does not wait for ranks that left, only for the
  // servers.
  EXPECT_TRUE(ReadyToJoin(View({true, false}, {}, true, 40)));
  EXPECT_FALSE(ReadyToJoin(View({true, false}, {}, false, 40)));
}

constexpr char kJob[] = "test";

// A coordinator of one server and one worker, served in-process on a
// reserved port.
class WaitForClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<PortReservation>> r =
        PortReservation::Reserve("127.0.0.1", 0);
    SHARDPS_ASSERT_OK(r);
    reservation_ = *std::move(r);
    coordinator::MembershipOptions o;
    o.job_id = kJob;
    o.num_servers = 1;
    o.num_workers = 1;
    o.heartbeat_timeout = absl::Seconds(30);
    o.incarnation = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    absl::StatusOr<std::unique_ptr<coordinator::Membership>> m =
        coordinator::Membership::Create(o);
    SHARDPS_ASSERT_OK(m);
    membership_ = *std::move(m);
    service_ =
        std::make_unique<coordinator::CoordinatorService>(membership_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address(), grpc::InsecureServerCredentials());
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    service_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
    server_->Wait();
  }
  std::string address() const {
    return absl::StrCat("127.0.0.1:", reservation_->port());
  }
  std::unique_ptr<coordinator::CoordinatorClient> Join(v1::Role role,
                                                       const std::string& as) {
    coordinator::CoordinatorClientOptions o;
    o.coordinator = address();
    std::unique_ptr<coordinator::CoordinatorClient> c =
        *coordinator::CoordinatorClient::Create(o);
    EXPECT_TRUE(c->Join(role, as, coordinator::kAnyIndex, kJob,
                        absl::Now() + absl::Seconds(30))
                    .ok());
    return c;
  }

  std::unique_ptr<PortReservation> reservation_;
  std::unique_ptr<coordinator::Membership> membership_;
  std::unique_ptr<coordinator::CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(WaitForClusterTest, WaitsForTheServersAndReturnsTheirAddresses) {
  std::unique_ptr<coordinator::CoordinatorClient> worker =
      Join(v1::ROLE_WORKER, "w");
  // No server yet: the wait ends at its deadline.
  absl::StatusOr<std::vector<std::string>> servers =
      WaitForCluster(*worker, absl::Milliseconds(200), absl::Milliseconds(50));
  EXPECT_EQ(servers.status().code(), absl::StatusCode::kDeadlineExceeded)
      << servers.status();
  std::unique_ptr<coordinator::CoordinatorClient> server =
      Join(v1::ROLE_SERVER, "127.0.0.1:5555");
  servers = WaitForCluster(*worker, absl::Seconds(30));
  SHARDPS_ASSERT_OK(servers);
  EXPECT_EQ(*servers, std::vector<std::string>{"127.0.0.1:5555"});
}

}  // namespace
}  // namespace shardps::worker
