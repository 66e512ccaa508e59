#include "coordinator/membership.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "coordinator/coordinator_protocol.h"
#include "gtest/gtest.h"

namespace shardps::coordinator {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(5);

// Time that moves only when the test says so.
class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1000000);
};

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override { membership_ = Make(2, 2); }

  std::unique_ptr<Membership> Make(uint32_t servers, uint32_t workers,
                                   uint64_t incarnation = 7) {
    MembershipOptions o;
    o.job_id = "mnist";
    o.num_servers = servers;
    o.num_workers = workers;
    o.heartbeat_timeout = kTimeout;
    o.clock = [this] { return clock_.Now(); };
    o.incarnation = incarnation;
    absl::StatusOr<std::unique_ptr<Membership>> m = Membership::Create(o);
    EXPECT_TRUE(m.ok()) << m.status();
    return *std::move(m);
  }

  static v1::JoinRequest Request(v1::Role role, const std::string& address,
                                 int32_t index = kAnyIndex) {
    v1::JoinRequest r;
    r.set_job_id("mnist");
    r.set_protocol_version(kCoordinatorProtocolVersion);
    r.set_role(role);
    r.set_address(address);
    r.set_requested_index(index);
    return r;
  }
  // Joins and returns the response; fails the test on an error.
  v1::JoinResponse MustJoin(const v1::JoinRequest& r) {
    absl::StatusOr<v1::JoinResponse> response = membership_->Join(r);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::JoinResponse();
  }
  v1::JoinResponse Server(const std::string& address,
                          int32_t index = kAnyIndex) {
    return MustJoin(Request(v1::ROLE_SERVER, address, index));
  }
  v1::JoinResponse Worker(int32_t index = kAnyIndex) {
    return MustJoin(Request(v1::ROLE_WORKER, "", index));
  }
  absl::Status Beat(const std::string& member_id, int64_t step = 0,
                    int64_t epoch = 0) {
    v1::HeartbeatRequest r;
    r.set_member_id(member_id);
    r.set_step(step);
    r.set_epoch(epoch);
    return membership_->Heartbeat(r).status();
  }

  FakeClock clock_;
  std::unique_ptr<Membership> membership_;
};

TEST_F(MembershipTest, JoinsGetTheLowestFreeIndexAndBumpTheGeneration) {
  EXPECT_EQ(membership_->generation(), 1u);
  EXPECT_EQ(Server("h:1").index(), 0u);
  EXPECT_EQ(Worker().index(), 0u);
  EXPECT_EQ(Server("h:2").index(), 1u);
  const v1::JoinResponse last = Worker();
  EXPECT_EQ(last.index(), 1u);
  EXPECT_EQ(last.heartbeat_timeout_ms(), 5000);
  const v1::ClusterView& view = last.view();
  EXPECT_EQ(view.generation(), 5u);
  EXPECT_TRUE(view.complete());
  EXPECT_EQ(view.job_id(), "mnist");
  ASSERT_EQ(view.servers_size(), 2);
  EXPECT_EQ(view.servers(1).address(), "h:2");
  EXPECT_TRUE(view.servers(1).alive());
  ASSERT_EQ(view.workers_size(), 2);
  EXPECT_TRUE(view.workers(1).alive());
}

TEST_F(MembershipTest, RequestedIndexIsGrantedWhenFree) {
  EXPECT_EQ(Server("h:1", 1).index(), 1u);
  EXPECT_EQ(Server("h:2").index(), 0u);
  EXPECT_EQ(Worker(1).index(), 1u);
  EXPECT_EQ(Worker().index(), 0u);
}

TEST_F(MembershipTest, DuplicateShardIndexIsAlreadyExistsAndChangesNothing) {
  Server("10.0.0.1:5000", 0);
  const std::string before = membership_->View().SerializeAsString();
  absl::StatusOr<v1::JoinResponse> dup =
      membership_->Join(Request(v1::ROLE_SERVER, "10.0.0.2:5000", 0));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(absl::StrContains(dup.status().message(), "shard index 0"))
      << dup.status();
  EXPECT_TRUE(absl::StrContains(dup.status().message(), "10.0.0.1:5000"))
      << dup.status();
  EXPECT_EQ(membership_->View().SerializeAsString(), before);
}

TEST_F(MembershipTest, BadJoinsAreRefusedWithoutChangingState) {
  struct Case {
    const char* name;
    v1::JoinRequest request;
    absl::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  cases.push_back({"job", Request(v1::ROLE_SERVER, "h:1"),
                   absl::StatusCode::kFailedPrecondition,
                   "job id \"cifar\", this coordinator runs job \"mnist\""});
  cases.back().request.set_job_id("cifar");
  cases.push_back({"version", Request(v1::ROLE_WORKER, ""),
                   absl::StatusCode::kFailedPrecondition,
                   "protocol version 9"});
  cases.back().request.set_protocol_version(9);
  cases.push_back({"role", Request(v1::ROLE_UNSPECIFIED, "h:1"),
                   absl::StatusCode::kInvalidArgument, "ROLE_UNSPECIFIED"});
  cases.push_back({"no address", Request(v1::ROLE_SERVER, ""),
                   absl::StatusCode::kInvalidArgument, "host:port"});
  cases.push_back({"no port", Request(v1::ROLE_SERVER, "h:"),
                   absl::StatusCode::kInvalidArgument, "host:port"});
  cases.push_back({"shard range", Request(v1::ROLE_SERVER, "h:1", 2),
                   absl::StatusCode::kInvalidArgument, "shard index 2"});
  cases.push_back({"rank range", Request(v1::ROLE_WORKER, "", 5),
                   absl::StatusCode::kInvalidArgument, "rank 5"});
  const std::string before = membership_->View().SerializeAsString();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<v1::JoinResponse> r = membership_->Join(c.request);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.message))
        << r.status();
  }
  EXPECT_EQ(membership_->View().SerializeAsString(), before);
}

TEST_F(MembershipTest, FullRoleIsResourceExhausted) {
  Worker();
  Worker();
  absl::StatusOr<v1::JoinResponse> third =
      membership_->Join(Request(v1::ROLE_WORKER, ""));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted)
      << third.status();
  EXPECT_EQ(membership_->generation(), 3u);
}

TEST_F(MembershipTest, RejoinFromALiveAddressReplacesTheOldMembership) {
  const v1::JoinResponse old = Server("h:1", 1);
  const v1::JoinResponse again = Server("h:1");
  EXPECT_EQ(again.index(), 1u);
  EXPECT_NE(again.member_id(), old.member_id());
  EXPECT_EQ(again.view().generation(), 3u);
  EXPECT_EQ(Beat(old.member_id()).code(), absl::StatusCode::kNotFound);
  SHARDPS_EXPECT_OK(Beat(again.member_id()));
  // The same live address cannot take a second index.
  absl::StatusOr<v1::JoinResponse> other =
      membership_->Join(Request(v1::ROLE_SERVER, "h:1", 0));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(MembershipTest, RestartedServerTakesItsOldIndexBack) {
  membership_ = Make(3, 1);
  const v1::JoinResponse a = Server("h:a", 2);
  const v1::JoinResponse b = Server("h:b", 1);
  clock_.Advance(kTimeout);
  SHARDPS_ASSERT_OK(Beat(b.member_id()));
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(membership_->Expire(), 1);  // a
  // Index 0 is the lowest free one, but "h:a" held index 2.
  EXPECT_EQ(Server("h:a").index(), 2u);
  EXPECT_EQ(Server("h:c").index(), 0u);
}

TEST_F(MembershipTest, WorkersAreNotMatchedByAddress) {
  EXPECT_EQ(MustJoin(Request(v1::ROLE_WORKER, "host")).index(), 0u);
  EXPECT_EQ(MustJoin(Request(v1::ROLE_WORKER, "host")).index(), 1u);
}

TEST_F(MembershipTest, HeartbeatsKeepAMemberAlive) {
  const v1::JoinResponse s = Server("h:1");
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(kTimeout);  // exactly the timeout is not yet too old
    EXPECT_EQ(membership_->Expire(), 0);
    SHARDPS_ASSERT_OK(Beat(s.member_id()));
  }
  EXPECT_EQ(membership_->generation(), 2u);
}

TEST_F(MembershipTest, SilentMemberExpiresAndMustRejoin) {
  const v1::JoinResponse s = Server("h:1");
  const v1::JoinResponse w = Worker();
  clock_.Advance(kTimeout / 2);
  SHARDPS_ASSERT_OK(Beat(w.member_id()));
  clock_.Advance(kTimeout / 2 + absl::Milliseconds(1));
  EXPECT_EQ(membership_->Expire(), 1);
  const v1::ClusterView view = membership_->View();
  EXPECT_EQ(view.generation(), 4u);
  EXPECT_FALSE(view.servers(0).alive());
  EXPECT_EQ(view.servers(0).address(), "h:1");  // last holder, for operators
  EXPECT_TRUE(view.workers(0).alive());
  absl::Status late = Beat(s.member_id());
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(late.message(), "join again")) << late;
}

TEST_F(MembershipTest, HeartbeatAfterTheTimeoutIsNotFoundWithoutExpire) {
  const v1::JoinResponse w = Worker();
  clock_.Advance(kTimeout + absl::Milliseconds(1));
  EXPECT_EQ(Beat(w.member_id()).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(membership_->View().workers(0).alive());
}

TEST_F(MembershipTest, HeartbeatChecksOnlyItsOwnLease) {
  // Every member beats, so a beat that scanned every lease would cost
  // O(members^2) a heartbeat interval: silent members are Expire's.
  const v1::JoinResponse w0 = Worker();
  const v1::JoinResponse w1 = Worker();
  clock_.Advance(kTimeout / 2);
  SHARDPS_ASSERT_OK(Beat(w0.member_id()));
  clock_.Advance(kTimeout / 2 + absl::Milliseconds(1));
  SHARDPS_ASSERT_OK(Beat(w0.member_id()));
  EXPECT_TRUE(membership_->View().workers(1).alive());
  EXPECT_FALSE(membership_->View().complete());  // no servers
  EXPECT_EQ(membership_->Expire(), 1);           // w1
  EXPECT_FALSE(membership_->View().workers(1).alive());
  EXPECT_EQ(Beat(w1.member_id()).code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, HeartbeatReportsWhetherEverySlotIsHeld) {
  membership_ = Make(1, 1);
  const v1::JoinResponse s = Server("h:1");
  v1::HeartbeatRequest beat;
  beat.set_member_id(s.member_id());
  absl::StatusOr<v1::HeartbeatResponse> r = membership_->Heartbeat(beat);
  SHARDPS_ASSERT_OK(r);
  EXPECT_FALSE(r->complete());
  const v1::JoinResponse w = Worker();
  r = membership_->Heartbeat(beat);
  SHARDPS_ASSERT_OK(r);
  EXPECT_TRUE(r->complete());
  v1::LeaveRequest leave;
  leave.set_member_id(w.member_id());
  SHARDPS_ASSERT_OK(membership_->Leave(leave));
  r = membership_->Heartbeat(beat);
  SHARDPS_ASSERT_OK(r);
  EXPECT_FALSE(r->complete());
}

TEST_F(MembershipTest, LeaveVacatesTheSlot) {
  const v1::JoinResponse w = Worker(1);
  v1::LeaveRequest leave;
  leave.set_member_id(w.member_id());
  absl::StatusOr<v1::LeaveResponse> left = membership_->Leave(leave);
  SHARDPS_ASSERT_OK(left);
  EXPECT_EQ(left->generation(), 3u);
  EXPECT_FALSE(membership_->View().workers(1).alive());
  EXPECT_EQ(membership_->Leave(leave).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Worker(1).index(), 1u);
}

TEST_F(MembershipTest, ProgressIsTheLargestReported) {
  const v1::JoinResponse w0 = Worker();
  const v1::JoinResponse w1 = Worker();
  SHARDPS_ASSERT_OK(Beat(w0.member_id(), 10, 1));
  v1::ProgressRequest p;
  p.set_member_id(w1.member_id());
  p.set_step(7);
  p.set_epoch(2);
  absl::StatusOr<v1::ProgressResponse> progress =
      membership_->ReportProgress(p);
  SHARDPS_ASSERT_OK(progress);
  EXPECT_EQ(progress->global_step(), 10);
  EXPECT_EQ(progress->epoch(), 2);
  SHARDPS_ASSERT_OK(Beat(w0.member_id(), 3, 0));  // never goes back
  EXPECT_EQ(membership_->View().global_step(), 10);
  EXPECT_EQ(Beat(w0.member_id(), -1, 0).code(),
            absl::StatusCode::kInvalidArgument);
  const v1::JobStatus status = membership_->Report();
  ASSERT_EQ(status.members_size(), 4);
  EXPECT_EQ(status.members(2).step(), 3);  // worker 0's latest
  EXPECT_EQ(status.members(3).epoch(), 2);
}

TEST_F(MembershipTest, StatusReportsHeartbeatAges) {
  Server("h:1");
  clock_.Advance(absl::Milliseconds(1500));
  const v1::JobStatus status = membership_->Report();
  EXPECT_EQ(status.uptime_ms(), 1500);
  EXPECT_EQ(status.heartbeat_timeout_ms(), 5000);
  EXPECT_EQ(status.protocol_version(), kCoordinatorProtocolVersion);
  ASSERT_EQ(status.members_size(), 4);
  EXPECT_EQ(status.members(0).role(), v1::ROLE_SERVER);
  EXPECT_EQ(status.members(0).heartbeat_age_ms(), 1500);
  EXPECT_EQ(status.members(1).heartbeat_age_ms(), -1);  // never held
  EXPECT_EQ(status.members(3).role(), v1::ROLE_WORKER);
  EXPECT_EQ(status.members(3).index(), 1u);
}

TEST_F(MembershipTest, MemberIdsOfAnotherIncarnationAreUnknown) {
  const v1::JoinResponse w = Worker();
  membership_ = Make(2, 2, /*incarnation=*/8);
  const v1::JoinResponse w2 = Worker();
  EXPECT_NE(w.member_id(), w2.member_id());
  EXPECT_EQ(Beat(w.member_id()).code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, EventsDescribeEveryChangeInOrder) {
  const v1::JoinResponse s = Server("h:1");
  EXPECT_FALSE(membership_->Join(Request(v1::ROLE_SERVER, "h:2", 0)).ok());
  clock_.Advance(kTimeout + absl::Milliseconds(1));
  membership_->Expire();
  const std::vector<MembershipEvent> events =
      membership_->AwaitEvents(absl::Now() + absl::Seconds(10));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, MembershipEvent::Kind::kJoined);
  EXPECT_EQ(DescribeEvent(events[0]), "server 0 (h:1) joined; generation 2");
  EXPECT_EQ(events[1].kind, MembershipEvent::Kind::kRejected);
  EXPECT_TRUE(absl::StrContains(DescribeEvent(events[1]), "ALREADY_EXISTS"))
      << DescribeEvent(events[1]);
  EXPECT_EQ(events[2].kind, MembershipEvent::Kind::kExpired);
  EXPECT_EQ(events[2].generation, 3u);
  // Taken: nothing is pending, so the wait ends at its deadline.
  EXPECT_TRUE(membership_->AwaitEvents(absl::Now()).empty());
}

TEST_F(MembershipTest, AwaitViewAfterWaitsForTheNextGeneration) {
  EXPECT_FALSE(membership_->AwaitViewAfter(1, absl::Now()).has_value());
  std::optional<v1::ClusterView> view = membership_->AwaitViewAfter(
      0, absl::Now() + absl::Seconds(10));  // differs at once
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->generation(), 1u);
  std::thread joiner([this] { Worker(); });
  view = membership_->AwaitViewAfter(1, absl::Now() + absl::Seconds(30));
  joiner.join();
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->generation(), 2u);
  EXPECT_TRUE(view->workers(0).alive());
}

absl::Status LeaveFinished(Membership* m, const std::string& member_id) {
  v1::LeaveRequest r;
  r.set_member_id(member_id);
  r.set_finished(true);
  return m->Leave(r).status();
}

TEST_F(MembershipTest, JobFinishesWhenEveryWorkerHasFinished) {
  const v1::JoinResponse s = Server("h:1");
  Server("h:2");
  const v1::JoinResponse w0 = Worker();
  const v1::JoinResponse w1 = Worker();
  ASSERT_EQ(membership_->generation(), 5u);
  SHARDPS_ASSERT_OK(LeaveFinished(membership_.get(), w0.member_id()));
  v1::ClusterView view = membership_->View();
  EXPECT_EQ(view.generation(), 6u);
  EXPECT_TRUE(view.workers(0).finished());
  EXPECT_FALSE(view.workers(0).alive());
  EXPECT_FALSE(view.job_finished());
  EXPECT_FALSE(membership_->job_finished());

  SHARDPS_ASSERT_OK(LeaveFinished(membership_.get(), w1.member_id()));
  view = membership_->View();
  EXPECT_EQ(view.generation(), 8u);  // the leave, then the job's end
  EXPECT_TRUE(view.job_finished());
  EXPECT_TRUE(membership_->job_finished());
  v1::HeartbeatRequest beat;
  beat.set_member_id(s.member_id());
  absl::StatusOr<v1::HeartbeatResponse> r = membership_->Heartbeat(beat);
  SHARDPS_ASSERT_OK(r);
  EXPECT_TRUE(r->job_finished());
  EXPECT_TRUE(membership_->Report().members(2).finished());

  absl::StatusOr<v1::JoinResponse> late =
      membership_->Join(Request(v1::ROLE_WORKER, "", 0));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(late.status().message(), "has finished"))
      << late.status();

  std::vector<MembershipEvent> events =
      membership_->AwaitEvents(absl::Now() + absl::Seconds(10));
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[events.size() - 3].kind, MembershipEvent::Kind::kFinished);
  EXPECT_EQ(events[events.size() - 2].kind,
            MembershipEvent::Kind::kJobFinished);
  EXPECT_EQ(DescribeEvent(events[events.size() - 2]),
            "job finished (all 2 workers finished); generation 8");
}

TEST_F(MembershipTest, OnlyWorkersFinish) {
  const v1::JoinResponse s = Server("h:1");
  const std::string before = membership_->View().SerializeAsString();
  EXPECT_EQ(LeaveFinished(membership_.get(), s.member_id()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(membership_->View().SerializeAsString(), before);
}

TEST_F(MembershipTest, AnyRankSkipsFinishedRanks) {
  const v1::JoinResponse w0 = Worker();
  Worker();
  SHARDPS_ASSERT_OK(LeaveFinished(membership_.get(), w0.member_id()));
  EXPECT_FALSE(membership_->job_finished());  // rank 1 still trains
  EXPECT_EQ(membership_->Join(Request(v1::ROLE_WORKER, "")).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Asked for by number, a finished rank is joined again.
  const v1::JoinResponse again = Worker(0);
  EXPECT_EQ(again.index(), 0u);
  EXPECT_FALSE(again.view().workers(0).finished());
}

TEST_F(MembershipTest, JobFinishesWhenTheOtherWorkersDiedUnreplaced) {
  Server("h:1");
  Server("h:2");
  v1::JoinRequest r0 = Request(v1::ROLE_WORKER, "w0");
  r0.set_incarnation(111);
  const v1::JoinResponse w0 = MustJoin(r0);
  v1::JoinRequest r1 = Request(v1::ROLE_WORKER, "w1");
  r1.set_incarnation(222);
  const v1::JoinResponse w1 = MustJoin(r1);
  EXPECT_EQ(w1.view().workers(0).incarnation(), 111u);
  EXPECT_EQ(w1.view().workers(1).incarnation(), 222u);
  // Rank 1 dies: its heartbeats stop and it expires; rank 0 goes on.
  clock_.Advance(kTimeout / 2);
  SHARDPS_ASSERT_OK(Beat(w0.member_id(), 40, 2));
  clock_.Advance(kTimeout / 2 + absl::Milliseconds(1));
  EXPECT_EQ(membership_->Expire(), 3);  // rank 1 and both silent servers
  EXPECT_FALSE(membership_->job_finished());
  SHARDPS_ASSERT_OK(LeaveFinished(membership_.get(), w0.member_id()));
  const v1::ClusterView view = membership_->View();
  EXPECT_TRUE(view.job_finished());
  EXPECT_TRUE(view.workers(0).finished());
  EXPECT_FALSE(view.workers(1).finished());
  std::vector<MembershipEvent> events =
      membership_->AwaitEvents(absl::Now() + absl::Seconds(10));
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, MembershipEvent::Kind::kJobFinished);
  EXPECT_TRUE(absl::StrContains(DescribeEvent(events.back()),
                                "1 of 2 workers finished"))
      << DescribeEvent(events.back());
}

TEST_F(MembershipTest, RestartedServerWithACheckpointRollsTheJobBack) {
  v1::JoinRequest first = Request(v1::ROLE_SERVER, "h:1", 0);
  first.set_restored(true);  // a job resumed: no rollback at a first join
  first.set_restored_step(10);
  MustJoin(first);
  Server("h:2", 1);
  EXPECT_EQ(membership_->View().rollback_id(), 0u);
  // Shard 1 restarts (same address: it replaces its old membership) from
  // the checkpoint of step 40.
  v1::JoinRequest again = Request(v1::ROLE_SERVER, "h:2", 1);
  again.set_restored(true);
  again.set_restored_step(40);
  const v1::JoinResponse r = MustJoin(again);
  const uint64_t id = r.view().rollback_id();
  // Numbered from the coordinator's start (in microseconds), so that a
  // restarted coordinator's rollbacks come after an earlier one's.
  EXPECT_GE(id, static_cast<uint64_t>(absl::ToUnixMicros(clock_.Now())));
  EXPECT_EQ(r.view().rollback_step(), 40);
  // Without a checkpoint there is nothing to roll back to.
  MustJoin(Request(v1::ROLE_SERVER, "h:2", 1));
  EXPECT_EQ(membership_->View().rollback_id(), id);
  // The next one is numbered one more.
  MustJoin(again);
  EXPECT_EQ(membership_->View().rollback_id(), id + 1);
  std::vector<MembershipEvent> events =
      membership_->AwaitEvents(absl::Now() + absl::Seconds(10));
  const bool logged =
      std::any_of(events.begin(), events.end(), [](const MembershipEvent& e) {
        return e.kind == MembershipEvent::Kind::kRollback &&
               absl::StrContains(DescribeEvent(e), "to step 40");
      });
  EXPECT_TRUE(logged);
}

TEST_F(MembershipTest, RankNotYetBackAfterACoordinatorRestartHoldsTheEnd) {
  // A restarted coordinator: rank 0 rejoined and finished, rank 1 has not
  // rejoined yet and may still be training.
  const v1::JoinResponse w0 = Worker(0);
  SHARDPS_ASSERT_OK(LeaveFinished(membership_.get(), w0.member_id()));
  EXPECT_FALSE(membership_->job_finished());
  // Nobody came back within a heartbeat timeout: rank 1 is gone.
  clock_.Advance(kTimeout + absl::Milliseconds(1));
  membership_->Expire();
  EXPECT_TRUE(membership_->job_finished());
}

TEST_F(MembershipTest, ServersReportWhatTheirStepsWaitFor) {
  const v1::JoinResponse s = Server("h:1");
  v1::HeartbeatRequest beat;
  beat.set_member_id(s.member_id());
  beat.set_stalled("step 7: 2 chunks wait for rank 1 (61.0 s)");
  SHARDPS_ASSERT_OK(membership_->Heartbeat(beat));
  EXPECT_EQ(membership_->Report().members(0).stalled(), beat.stalled());
  beat.clear_stalled();
  SHARDPS_ASSERT_OK(membership_->Heartbeat(beat));
  EXPECT_EQ(membership_->Report().members(0).stalled(), "");
}

TEST(MembershipCreateTest, RejectsBadOptions) {
  struct Case {
    const char* name;
    MembershipOptions options;
  };
  std::vector<Case> cases(4);
  cases[0] = {"job", {}};
  cases[0].options.job_id = "";
  cases[1] = {"servers", {}};
  cases[1].options.num_servers = 0;
  cases[2] = {"workers", {}};
  cases[2].options.num_workers = 70000;
  cases[3] = {"timeout", {}};
  cases[3].options.heartbeat_timeout = absl::ZeroDuration();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(Membership::Create(c.options).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace shardps::coordinator
