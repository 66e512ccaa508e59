#include "server/shard_lifecycle.h"

#include <signal.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/grpc_server.h"
#include "common/status_matchers.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/membership.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "server/optimizer.h"
#include "tests/testing/daemon.h"

namespace shardps::server {
namespace {

constexpr char kJob[] = "test";
// Every wait on the shard or the coordinator ends by then.
constexpr absl::Duration kWait = absl::Seconds(30);

// A coordinator served in-process on a port of its own choosing. Without
// the daemon's ticker, silent members expire only when a join or a
// heartbeat looks (and the heartbeat timeout is long).
class TestCoordinator {
 public:
  TestCoordinator(uint32_t servers, uint32_t workers) {
    coordinator::MembershipOptions o;
    o.job_id = kJob;
    o.num_servers = servers;
    o.num_workers = workers;
    o.heartbeat_timeout = absl::Seconds(60);
    o.incarnation = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    membership_ = *coordinator::Membership::Create(o);
    service_ =
        std::make_unique<coordinator::CoordinatorService>(membership_.get());
    server_ = *StartGrpcServer(GrpcServerOptions(), {service_.get()}, &port_);
  }
  ~TestCoordinator() {
    service_->Shutdown();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    server_->Wait();
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  coordinator::Membership* membership() { return membership_.get(); }

  // Joins a member directly (no client, no heartbeats) and returns its id.
  std::string Join(v1::Role role, int32_t index, uint64_t incarnation,
                   int64_t restored_step = -1) {
    v1::JoinRequest r;
    r.set_job_id(kJob);
    r.set_protocol_version(coordinator::kCoordinatorProtocolVersion);
    r.set_role(role);
    r.set_address(absl::StrCat("member-", index, ":1"));
    r.set_requested_index(index);
    r.set_incarnation(incarnation);
    if (restored_step >= 0) {
      r.set_restored(true);
      r.set_restored_step(restored_step);
    }
    absl::StatusOr<v1::JoinResponse> joined = membership_->Join(r);
    EXPECT_TRUE(joined.ok()) << joined.status();
    return joined.ok() ? joined->member_id() : "";
  }
  void Leave(const std::string& member_id, bool finished) {
    v1::LeaveRequest r;
    r.set_member_id(member_id);
    r.set_finished(finished);
    SHARDPS_EXPECT_OK(membership_->Leave(r).status());
  }

 private:
  std::unique_ptr<coordinator::Membership> membership_;
  std::unique_ptr<coordinator::CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// One tensor of 8 chunks (100 floats each), plain SGD: shard 0 of 2 owns
// some of them.
v1::DeclareRequest Declaration() {
  v1::DeclareRequest d;
  d.mutable_layout()->set_chunk_bytes(400);
  v1::TensorSpec* t = d.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(800);
  d.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  d.mutable_optimizer()->set_learning_rate(0.1f);
  return d;
}

// Commits a one-shard checkpoint of `declaration` at `step` in `dir`.
void CommitCheckpointAt(const std::string& dir, int64_t step,
                        const v1::DeclareRequest& declaration) {
  const int slots = (*Optimizer::Create(declaration.optimizer()))->num_slots();
  std::vector<ChunkState> chunks;
  for (const ChunkSpec& spec : MakeChunks(declaration.layout())) {
    ChunkState c{spec.id, step, {}, {}};
    c.weights.assign(static_cast<size_t>(spec.num_elements), 0.5f);
    c.slots.assign(slots, c.weights);
    chunks.push_back(std::move(c));
  }
  absl::StatusOr<ShardFile> file =
      WriteShardCheckpoint(dir, step, 0, 1, declaration, chunks);
  SHARDPS_ASSERT_OK(file);
  SHARDPS_ASSERT_OK(CommitCheckpoint(dir, step, 1, {*file}));
}

// RunShard on a thread of its own, told to stop by `stop` (the test's
// signal); stopped and joined at the latest when destroyed.
class BackgroundRun {
 public:
  BackgroundRun(ShardLifecycleOptions options, std::function<void()> stop)
      : stop_(std::move(stop)) {
    options.on_listening = [this](int port) {
      port_ = port;
      listening_.Notify();
      return absl::OkStatus();
    };
    thread_ = std::thread([this, options = std::move(options)]() mutable {
      result_ = RunShard(std::move(options));
      done_.Notify();
    });
  }
  ~BackgroundRun() { Stop().IgnoreError(); }

  // The shard's port once it listens; 0 when it did not in time.
  int AwaitListening() {
    return listening_.WaitForNotificationWithTimeout(kWait) ? port_ : 0;
  }
  // The run's result once it ended by itself; DeadlineExceeded (and
  // stopped) when it did not in time.
  absl::Status AwaitEnd() {
    if (done_.WaitForNotificationWithTimeout(kWait)) return Stop();
    Stop().IgnoreError();
    return absl::DeadlineExceededError("the run did not end by itself");
  }
  // Stops the run and returns its result.
  absl::Status Stop() {
    if (thread_.joinable()) {
      stop_();
      thread_.join();
    }
    return result_;
  }

 private:
  const std::function<void()> stop_;
  absl::Notification listening_;
  absl::Notification done_;
  int port_ = 0;  // written before listening_ is notified
  absl::Status result_ = absl::UnknownError("still running");
  std::thread thread_;
};

class ShardLifecycleTest : public ::testing::Test {
 protected:
  // Options for a shard of the job at `coordinator`: port 0, a stop that
  // Stop() requests, log lines kept for the test.
  ShardLifecycleOptions Options(const TestCoordinator& coordinator) {
    ShardLifecycleOptions o;
    o.server.host = "127.0.0.1";
    o.server.port = 0;
    o.coordinator = coordinator.address();
    o.job_id = kJob;
    o.join_timeout = kWait;
    o.view_check_interval = absl::Milliseconds(10);
    o.wait_for_signal = [this](absl::Duration timeout) {
      return stop_.WaitForNotificationWithTimeout(
                 std::min(timeout, absl::Hours(1)))
                 ? SIGTERM
                 : 0;
    };
    o.log = [this](LogLevel, const std::string& line) {
      absl::MutexLock lock(&log_mu_);
      log_.push_back(line);
    };
    return o;
  }
  void Stop() { stop_.Notify(); }
  bool Logged(absl::string_view text) {
    absl::MutexLock lock(&log_mu_);
    for (const std::string& line : log_) {
      if (absl::StrContains(line, text)) return true;
    }
    return false;
  }
  std::string LogText() {
    absl::MutexLock lock(&log_mu_);
    return absl::StrJoin(log_, "\n");
  }
  // Waits until the shard's client holds a view `ready` accepts.
  static void AwaitView(
      CoordinatedShard* shard,
      const std::function<bool(const v1::ClusterView&)>& ready) {
    SHARDPS_ASSERT_OK(
        shard->client()->WaitForView(ready, absl::Now() + kWait).status());
  }

  absl::Notification stop_;
  absl::Mutex log_mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(log_mu_);
};

TEST_F(ShardLifecycleTest, AdoptsTheJobsShape) {
  TestCoordinator coordinator(/*servers=*/2, /*workers=*/3);
  ShardLifecycleOptions o = Options(coordinator);
  o.requested_index = 1;
  o.server.store.num_shards = 1;  // static defaults, replaced by the job's
  o.server.store.num_workers = 1;
  uint32_t joined_as = 99;
  o.on_joined = [&joined_as](uint32_t index) { joined_as = index; };
  absl::StatusOr<std::unique_ptr<CoordinatedShard>> shard =
      CoordinatedShard::Listen(std::move(o));
  SHARDPS_ASSERT_OK(shard);
  SHARDPS_ASSERT_OK((*shard)->Join());
  EXPECT_EQ(joined_as, 1u);
  const StoreOptions& store = (*shard)->server()->store()->options();
  EXPECT_EQ(store.shard_index, 1u);
  EXPECT_EQ(store.num_shards, 2u);
  EXPECT_EQ(store.num_workers, 3u);
  const v1::ClusterView view = coordinator.membership()->View();
  ASSERT_EQ(view.servers_size(), 2);
  EXPECT_TRUE(view.servers(1).alive());
  EXPECT_EQ(view.servers(1).address(), (*shard)->address());
  EXPECT_TRUE(Logged(
      absl::StrCat("shard 1 of 2 listening on 127.0.0.1:", (*shard)->port())))
      << LogText();
}

TEST_F(ShardLifecycleTest, RefusesAShapeTheJobDoesNotHave) {
  struct Case {
    std::optional<uint32_t> shards, workers;
    std::string error;
  };
  for (const Case& c : std::vector<Case>{
           {3, std::nullopt, "--num_shards=3 but job test has 2 shards"},
           {std::nullopt, 5, "--num_workers=5 but job test has 3 workers"}}) {
    SCOPED_TRACE(c.error);
    TestCoordinator coordinator(/*servers=*/2, /*workers=*/3);
    ShardLifecycleOptions o = Options(coordinator);
    o.num_shards = c.shards;
    o.num_workers = c.workers;
    absl::StatusOr<std::unique_ptr<CoordinatedShard>> shard =
        CoordinatedShard::Listen(std::move(o));
    SHARDPS_ASSERT_OK(shard);
    const absl::Status joined = (*shard)->Join();
    EXPECT_EQ(joined.code(), absl::StatusCode::kFailedPrecondition) << joined;
    EXPECT_EQ(joined.message(), c.error);
    // It left again: its slot is free for a shard of the right shape.
    const v1::ClusterView view = coordinator.membership()->View();
    for (const v1::ServerSlot& s : view.servers()) {
      EXPECT_FALSE(s.alive()) << s.address();
    }
  }
}

TEST_F(ShardLifecycleTest, AppliesNewViewsToTheStore) {
  TestCoordinator coordinator(/*servers=*/1, /*workers=*/2);
  absl::StatusOr<std::unique_ptr<CoordinatedShard>> shard =
      CoordinatedShard::Listen(Options(coordinator));
  SHARDPS_ASSERT_OK(shard);
  SHARDPS_ASSERT_OK((*shard)->Join());
  (*shard)->Serve();
  coordinator.Join(v1::ROLE_WORKER, 0, /*incarnation=*/10);
  const std::string rank1 = coordinator.Join(v1::ROLE_WORKER, 1, 11);
  coordinator.Leave(rank1, /*finished=*/false);
  const uint64_t left = coordinator.membership()->generation();
  AwaitView(shard->get(), [left](const v1::ClusterView& v) {
    return v.generation() >= left;
  });
  EXPECT_FALSE((*shard)->Follow());
  EXPECT_TRUE(Logged(absl::StrCat("rank 1 left the job (generation ", left,
                                  "): steps no longer wait for it")))
      << LogText();
  // Once per generation: the next look changes nothing.
  const std::string before = LogText();
  EXPECT_FALSE((*shard)->Follow());
  EXPECT_EQ(LogText(), before);
}

TEST_F(ShardLifecycleTest, RetriesARollbackUntilItsCheckpointIsThere) {
  TestCoordinator coordinator(/*servers=*/2, /*workers=*/1);
  ShardLifecycleOptions o = Options(coordinator);
  o.requested_index = 0;
  o.server.checkpoint_dir = testing::MakeTempDir("shard_lifecycle");
  const std::string dir = o.server.checkpoint_dir;
  absl::StatusOr<std::unique_ptr<CoordinatedShard>> shard =
      CoordinatedShard::Listen(std::move(o));
  SHARDPS_ASSERT_OK(shard);
  SHARDPS_ASSERT_OK((*shard)->Join());
  (*shard)->Serve();
  v1::DeclareRequest declaration = Declaration();
  declaration.set_num_shards(2);
  declaration.set_shard_index(0);
  SHARDPS_ASSERT_OK((*shard)->server()->store()->Declare(declaration).status());

  // Shard 1 restarts from the checkpoint of step 5: the job rolls back.
  coordinator.Join(v1::ROLE_SERVER, 1, /*incarnation=*/1);
  coordinator.Join(v1::ROLE_SERVER, 1, /*incarnation=*/2, /*restored_step=*/5);
  const uint64_t rollback = coordinator.membership()->View().rollback_id();
  ASSERT_GT(rollback, 0u);
  AwaitView(shard->get(), [rollback](const v1::ClusterView& v) {
    return v.rollback_id() == rollback;
  });
  (*shard)->Follow();
  EXPECT_EQ((*shard)->applied_rollback(), 0u);
  EXPECT_TRUE(Logged(
      absl::StrCat("rollback ", rollback, " to step 5 failed (retrying)")))
      << LogText();

  CommitCheckpointAt(dir, 5, Declaration());
  (*shard)->Follow();
  EXPECT_EQ((*shard)->applied_rollback(), rollback);
  const v1::GetStatusResponse report = (*shard)->server()->store()->Report();
  EXPECT_EQ(report.rollback_id(), rollback);
  EXPECT_EQ(report.min_version(), 5);
  EXPECT_EQ(report.max_version(), 5);
  EXPECT_TRUE(Logged(absl::StrCat("rollback ", rollback,
                                  ": shard reset to the checkpoint of step 5")))
      << LogText();
}

TEST_F(ShardLifecycleTest, RunEndsWhenTheJobFinishes) {
  TestCoordinator coordinator(/*servers=*/1, /*workers=*/1);
  BackgroundRun run(Options(coordinator), [this] { Stop(); });
  ASSERT_NE(run.AwaitListening(), 0) << LogText();
  const std::string worker = coordinator.Join(v1::ROLE_WORKER, 0, 10);
  coordinator.Leave(worker, /*finished=*/true);
  ASSERT_TRUE(coordinator.membership()->job_finished());
  const absl::Status ended = run.AwaitEnd();
  EXPECT_TRUE(ended.ok()) << ended << "\n" << LogText();
  EXPECT_TRUE(Logged("job test finished: training completed; exiting"))
      << LogText();
  EXPECT_TRUE(Logged("stopped after 0 pushes, 0 updates, 0 rejected"))
      << LogText();
}

TEST_F(ShardLifecycleTest, RunLeavesTheJobOnASignal) {
  TestCoordinator coordinator(/*servers=*/1, /*workers=*/1);
  BackgroundRun run(Options(coordinator), [this] { Stop(); });
  ASSERT_NE(run.AwaitListening(), 0) << LogText();
  SHARDPS_EXPECT_OK(run.Stop());
  EXPECT_TRUE(Logged(
      absl::StrCat("signal ", SIGTERM, ": leaving the job and shutting down")))
      << LogText();
  EXPECT_FALSE(coordinator.membership()->View().servers(0).alive());
}

TEST_F(ShardLifecycleTest, StaticRunServesUntilASignal) {
  TestCoordinator unused(/*servers=*/1, /*workers=*/1);
  ShardLifecycleOptions o = Options(unused);
  o.coordinator.clear();  // static mode: the command line's shape
  o.server.store.shard_index = 1;
  o.server.store.num_shards = 2;
  o.server.store.num_workers = 3;
  BackgroundRun run(std::move(o), [this] { Stop(); });
  const int port = run.AwaitListening();
  ASSERT_NE(port, 0) << LogText();
  SHARDPS_EXPECT_OK(run.Stop());
  EXPECT_TRUE(Logged(absl::StrCat("shard 1 of 2 listening on 127.0.0.1:", port,
                                  " (mode=sync, workers=3)")))
      << LogText();
  EXPECT_TRUE(Logged(absl::StrCat("signal ", SIGTERM, ": shutting down")))
      << LogText();
}

}  // namespace
}  // namespace shardps::server
