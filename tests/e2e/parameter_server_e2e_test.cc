// End to end: real shardps-server processes on 127.0.0.1 (ports picked at run
// time) and real Clients in threads. The weights the servers return must equal,
// bitwise, the optimizer applied locally to the rank-ordered mean of the
// gradients.
#include <signal.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/chunking.h"
#include "common/status.h"
#include "common/status_matchers.h"
#include "common/tensor_init.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "server/optimizer.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"
#include "worker/client.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::MustRun;
using ::shardps::testing::TestCluster;

// Three tensors in 4 KiB chunks: 3000 floats -> 3 chunks, 1000 -> 1, 7 -> 1.
v1::Layout TestLayout() {
  v1::Layout layout;
  layout.set_chunk_bytes(4096);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"fc1.weight", {3000}}, {"fc1.bias", {50, 20}}, {"fc2.weight", {7}}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name(tensors[i].first);
    for (int64_t d : tensors[i].second) t->add_shape(d);
    t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
    t->mutable_init()->set_value(0.1f);
    t->mutable_init()->set_seed(42 + i);
  }
  return layout;
}

v1::OptimizerSpec Sgd() {
  v1::OptimizerSpec o;
  o.set_kind(v1::OptimizerSpec::KIND_SGD);
  o.set_learning_rate(0.05f);
  o.set_momentum(0.9f);
  o.set_weight_decay(1e-3f);
  return o;
}

v1::OptimizerSpec Adam() {
  v1::OptimizerSpec o;
  o.set_kind(v1::OptimizerSpec::KIND_ADAM);
  o.set_learning_rate(1e-2f);
  o.mutable_schedule()->set_kind(v1::LrSchedule::KIND_COSINE);
  o.mutable_schedule()->set_total_steps(10);
  return o;
}

// A model's tensors as owned buffers plus views for the Client.
struct Model {
  std::vector<std::vector<float>> tensors;
  explicit Model(const v1::Layout& layout) {
    for (const v1::TensorSpec& t : layout.tensors()) {
      tensors.emplace_back(NumElements(t), 0.0f);
    }
  }
  Tensors Views() {
    Tensors v;
    for (auto& t : tensors) v.emplace_back(t);
    return v;
  }
  ConstTensors ConstViews() const {
    ConstTensors v;
    for (const auto& t : tensors) v.emplace_back(t);
    return v;
  }
};

// Deterministic gradient of `rank` at `step`.
Model Gradient(const v1::Layout& layout, uint32_t rank, int64_t step) {
  Model g(layout);
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    for (size_t i = 0; i < g.tensors[t].size(); ++i) {
      g.tensors[t][i] = std::sin(0.37f * i + 1.3f * rank + 0.7f * step + t);
    }
  }
  return g;
}

// The weights after `steps` sync steps of `workers` workers, computed locally
// with the same Optimizer on the same chunks.
Model Reference(const v1::Layout& layout, const v1::OptimizerSpec& spec,
                uint32_t workers, int64_t steps) {
  Model w(layout);
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  for (const ChunkSpec& c : chunks) {
    FillInit(layout.tensors(c.tensor).init(), c.tensor, c.offset,
             w.tensors[c.tensor].data() + c.offset, c.num_elements);
  }
  std::unique_ptr<server::Optimizer> opt = *server::Optimizer::Create(spec);
  std::vector<std::vector<std::vector<float>>> slots(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    slots[i].assign(opt->num_slots(),
                    std::vector<float>(chunks[i].num_elements));
    std::vector<float*> ptrs;
    for (auto& s : slots[i]) ptrs.push_back(s.data());
    opt->InitSlots(ptrs, chunks[i].num_elements);
  }
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<Model> grads;
    for (uint32_t r = 0; r < workers; ++r) {
      grads.push_back(Gradient(layout, r, step));
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      const ChunkSpec& c = chunks[i];
      std::vector<const float*> contributions;
      for (uint32_t r = 0; r < workers; ++r) {
        contributions.push_back(grads[r].tensors[c.tensor].data() + c.offset);
      }
      std::vector<float*> ptrs;
      for (auto& s : slots[i]) ptrs.push_back(s.data());
      opt->Apply(step, contributions, w.tensors[c.tensor].data() + c.offset,
                 ptrs, c.num_elements);
    }
  }
  return w;
}

// `shards` static servers for `workers` workers; null after a failed start.
std::unique_ptr<TestCluster> StartCluster(uint32_t shards, uint32_t workers,
                                          const std::string& mode,
                                          std::vector<std::string> extra = {}) {
  ClusterOptions o;
  o.num_servers = static_cast<int>(shards);
  o.num_workers = static_cast<int>(workers);
  o.mode = mode;
  o.server_flags = std::move(extra);
  auto cluster = std::make_unique<TestCluster>(std::move(o));
  if (!cluster->StartServers()) return nullptr;
  return cluster;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(TestCluster& c, uint32_t rank,
                                                bool shared_memory = true) {
  ClientOptions o;
  o.servers = c.server_addresses();
  o.rank = rank;
  o.shared_memory = shared_memory;
  o.connect_timeout = absl::Seconds(30);
  o.rpc_timeout = absl::Seconds(60);
  return Client::Create(o);
}

// Every shard's GetStatus, through a Client of rank 0 that declares
// TestLayout with SGD (as the jobs here do).
absl::StatusOr<std::vector<v1::GetStatusResponse>> ShardStatus(
    TestCluster& cluster) {
  SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(cluster, 0));
  SHARDPS_RETURN_IF_ERROR(client->Declare(TestLayout(), Sgd()));
  return client->ShardStatus();
}

// Trains `steps` sync steps with one Client thread per worker; returns each
// worker's final weights.
std::vector<Model> Train(TestCluster& cluster, uint32_t workers,
                         const v1::OptimizerSpec& spec, int64_t steps,
                         std::atomic<int64_t>* retries = nullptr,
                         bool shared_memory = true) {
  const v1::Layout layout = TestLayout();
  std::vector<Model> finals(workers, Model(layout));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Client>> client =
          Connect(cluster, r, shared_memory);
      ASSERT_TRUE(client.ok()) << client.status();
      SHARDPS_ASSERT_OK((*client)->Declare(layout, spec));
      for (int64_t step = 0; step < steps; ++step) {
        Model g = Gradient(layout, r, step);
        SHARDPS_ASSERT_OK(
            (*client)->PushPull(step, g.ConstViews(), finals[r].Views()));
      }
      if (retries != nullptr) *retries += (*client)->retries();
    });
  }
  for (std::thread& t : threads) t.join();
  return finals;
}

struct SyncCase {
  uint32_t shards;
  uint32_t workers;
  bool adam;
};

class SyncEquivalenceTest : public ::testing::TestWithParam<SyncCase> {};

TEST_P(SyncEquivalenceTest, WeightsEqualTheOptimizerOnTheRankOrderedMean) {
  const SyncCase& p = GetParam();
  const v1::OptimizerSpec spec = p.adam ? Adam() : Sgd();
  std::unique_ptr<TestCluster> cluster =
      StartCluster(p.shards, p.workers, "sync");
  ASSERT_NE(cluster, nullptr);
  constexpr int64_t kSteps = 6;
  std::vector<Model> got = Train(*cluster, p.workers, spec, kSteps);
  Model want = Reference(TestLayout(), spec, p.workers, kSteps);
  for (uint32_t r = 0; r < p.workers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    for (size_t t = 0; t < want.tensors.size(); ++t) {
      ASSERT_EQ(got[r].tensors[t], want.tensors[t]) << "tensor " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Clusters, SyncEquivalenceTest,
    ::testing::Values(SyncCase{1, 1, false}, SyncCase{2, 2, false},
                      SyncCase{3, 4, false}, SyncCase{2, 3, true}),
    [](const ::testing::TestParamInfo<SyncCase>& info) {
      return absl::StrCat(info.param.shards, "shards_", info.param.workers,
                          "workers_", info.param.adam ? "adam" : "sgd");
    });

TEST(ParameterServerE2ETest, DroppedRepliesAreRetriedAndAppliedOnce) {
  // Every 3rd reply is lost; the clients retry, the servers de-duplicate.
  std::unique_ptr<TestCluster> cluster =
      StartCluster(2, 2, "sync", {"--fault_drop_reply_every=3"});
  ASSERT_NE(cluster, nullptr);
  constexpr int64_t kSteps = 5;
  std::atomic<int64_t> retries{0};
  std::vector<Model> got = Train(*cluster, 2, Sgd(), kSteps, &retries);
  EXPECT_GT(retries.load(), 0);
  Model want = Reference(TestLayout(), Sgd(), 2, kSteps);
  for (size_t t = 0; t < want.tensors.size(); ++t) {
    EXPECT_EQ(got[0].tensors[t], want.tensors[t]);
    EXPECT_EQ(got[1].tensors[t], want.tensors[t]);
  }
  // Each chunk was updated exactly kSteps times despite the retries.
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      ShardStatus(*cluster);
  SHARDPS_ASSERT_OK(status);
  for (const v1::GetStatusResponse& s : *status) {
    EXPECT_EQ(s.min_version(), kSteps);
    EXPECT_EQ(s.max_version(), kSteps);
    EXPECT_EQ(s.updates_total(), s.num_chunks() * kSteps);
  }
}

// A receive budget of two chunks at 32 workers over gRPC: the streams wait
// for it (each read takes a chunk's bytes), the weights are still the
// rank-ordered mean's bitwise, and what the shard held passed the budget
// only by the read of the rank a sum needed next and, for a moment, reads
// whose pushes gRPC's threads were still taking: a few chunks, not one per
// worker (server/receive_budget.h).
TEST(ParameterServerE2ETest, AReceiveBudgetBoundsWhatTheShardHolds) {
  constexpr uint32_t kWorkers = 32;
  constexpr int64_t kChunkBytes = 4096;  // TestLayout's chunk size (at most)
  constexpr int64_t kBudget = 2 * kChunkBytes;
  std::unique_ptr<TestCluster> cluster =
      StartCluster(1, kWorkers, "sync",
                   {absl::StrCat("--max_inflight_mib=", kBudget / 1048576.0)});
  ASSERT_NE(cluster, nullptr);
  constexpr int64_t kSteps = 30;
  std::vector<Model> got = Train(*cluster, kWorkers, Sgd(), kSteps,
                                 /*retries=*/nullptr, /*shared_memory=*/false);
  Model want = Reference(TestLayout(), Sgd(), kWorkers, kSteps);
  for (uint32_t r = 0; r < kWorkers; ++r) {
    for (size_t t = 0; t < want.tensors.size(); ++t) {
      ASSERT_EQ(got[r].tensors[t], want.tensors[t])
          << "rank " << r << ", tensor " << t;
    }
  }
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      ShardStatus(*cluster);
  SHARDPS_ASSERT_OK(status);
  ASSERT_EQ(status->size(), 1u);
  const v1::GetStatusResponse& s = (*status)[0];
  EXPECT_EQ(s.receive_budget_bytes(), kBudget);
  EXPECT_GT(s.receive_budget_waits_total(), 0u);
  EXPECT_GE(s.receive_budget_peak_bytes(), kBudget);
  EXPECT_LE(s.receive_budget_peak_bytes(), kBudget + 4 * kChunkBytes);
}

TEST(ParameterServerE2ETest, SameRunTwiceIsBitwiseIdentical) {
  std::vector<Model> runs[2];
  for (int i = 0; i < 2; ++i) {
    std::unique_ptr<TestCluster> cluster = StartCluster(2, 3, "sync");
    ASSERT_NE(cluster, nullptr);
    runs[i] = Train(*cluster, 3, Adam(), 4);
  }
  for (size_t t = 0; t < runs[0][0].tensors.size(); ++t) {
    EXPECT_EQ(runs[0][0].tensors[t], runs[1][0].tensors[t]);
  }
}

TEST(ParameterServerE2ETest, AsyncAppliesEveryPushOnArrival) {
  // Plain SGD with lr 1 and small integer gradients: every order of
  // application gives exactly w0 - sum of all gradients.
  std::unique_ptr<TestCluster> cluster = StartCluster(2, 3, "async");
  ASSERT_NE(cluster, nullptr);
  v1::Layout layout = TestLayout();
  for (auto& t : *layout.mutable_tensors()) t.mutable_init()->Clear();
  v1::OptimizerSpec spec;
  spec.set_kind(v1::OptimizerSpec::KIND_SGD);
  spec.set_learning_rate(1.0f);
  constexpr int64_t kSteps = 4;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Client>> client = Connect(*cluster, r);
      ASSERT_TRUE(client.ok());
      SHARDPS_ASSERT_OK((*client)->Declare(layout, spec));
      Model w(layout), g(layout);
      for (auto& t : g.tensors) std::fill(t.begin(), t.end(), float(r + 1));
      for (int64_t step = 0; step < kSteps; ++step) {
        SHARDPS_ASSERT_OK((*client)->PushPull(step, g.ConstViews(), w.Views()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(*cluster, 0);
  ASSERT_TRUE(client.ok());
  SHARDPS_ASSERT_OK((*client)->Declare(layout, spec));
  Model w(layout);
  SHARDPS_ASSERT_OK((*client)->Pull(w.Views()));
  // sum over ranks of (r + 1) * kSteps = (1 + 2 + 3) * 4 = 24.
  for (const auto& t : w.tensors) {
    for (float v : t) ASSERT_EQ(v, -24.0f);
  }
}

TEST(ParameterServerE2ETest, SspNeverLetsAWorkerRunMoreThanKStepsAhead) {
  constexpr int64_t kStaleness = 2;
  constexpr int64_t kSteps = 12;
  std::unique_ptr<TestCluster> cluster =
      StartCluster(2, 2, absl::StrCat("ssp:", kStaleness));
  ASSERT_NE(cluster, nullptr);
  const v1::Layout layout = TestLayout();
  std::atomic<int64_t> completed[2] = {0, 0};
  std::atomic<int64_t> max_gap{0};
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Client>> client = Connect(*cluster, r);
      ASSERT_TRUE(client.ok());
      SHARDPS_ASSERT_OK((*client)->Declare(layout, Sgd()));
      Model w(layout);
      for (int64_t step = 0; step < kSteps; ++step) {
        // Rank 1 is artificially slow.
        if (r == 1) absl::SleepFor(absl::Milliseconds(20));
        Model g = Gradient(layout, r, step);
        SHARDPS_ASSERT_OK((*client)->PushPull(step, g.ConstViews(), w.Views()));
        const int64_t mine = ++completed[r];
        const int64_t gap = mine - completed[1 - r].load();
        int64_t seen = max_gap.load();
        while (gap > seen && !max_gap.compare_exchange_weak(seen, gap)) {
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(completed[0].load(), kSteps);
  EXPECT_EQ(completed[1].load(), kSteps);
  // A reply for step t needs the slowest worker to have pushed t - K; the
  // other worker has completed at most that many steps plus the one in
  // flight when this worker counts.
  EXPECT_LE(max_gap.load(), kStaleness + 1);
  EXPECT_GE(max_gap.load(), 1);  // the fast worker did run ahead
}

TEST(ParameterServerE2ETest, AStalledSyncStepLogsWhatItWaitsFor) {
  std::unique_ptr<TestCluster> cluster =
      StartCluster(1, 2, "sync", {"--step_timeout_s=1"});
  ASSERT_NE(cluster, nullptr);
  ClientOptions o;
  o.servers = cluster->server_addresses();
  o.rank = 0;
  o.rpc_timeout = absl::Seconds(3);
  o.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(o);
  ASSERT_TRUE(client.ok());
  SHARDPS_ASSERT_OK((*client)->Declare(TestLayout(), Sgd()));
  Model g = Gradient(TestLayout(), 0, 0), w(TestLayout());
  // Rank 1 never pushes: the step times out on the client after 3 s, and
  // the server has said what it waits for.
  absl::Status s = (*client)->PushPull(0, g.ConstViews(), w.Views());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  const std::string log = cluster->server(0).ReadLog();
  EXPECT_NE(log.find("step 0 has waited"), std::string::npos) << log;
  EXPECT_NE(log.find("for rank(s) 1;"), std::string::npos) << log;
  EXPECT_NE(log.find("5 chunk(s) pending"), std::string::npos) << log;
}

TEST(ParameterServerE2ETest, ServesHealthAndStopsCleanlyOnSigterm) {
  std::unique_ptr<TestCluster> cluster = StartCluster(1, 1, "sync");
  ASSERT_NE(cluster, nullptr);
  auto channel = grpc::CreateChannel(cluster->server(0).address(),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  // The standard health service answers SERVING for the empty service name.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer request, response;
  {
    // grpc.health.v1.HealthCheckRequest{service: ""} encodes to no bytes.
    grpc::Slice empty("");
    request = grpc::ByteBuffer(&empty, 1);
  }
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request, &response, [&](grpc::Status s) {
                   status = s;
                   done.Notify();
                 });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse{status: SERVING (1)} is field 1, varint 1.
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
  absl::StatusOr<int> code =
      cluster->server(0).Stop(SIGTERM, absl::Seconds(10));
  SHARDPS_ASSERT_OK(code);
  EXPECT_EQ(*code, 0) << cluster->server(0).ReadLog();
}

TEST(ParameterServerE2ETest, BadFlagsExitNonZeroWithAMessage) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  std::vector<Case> cases = {
      {{"--num_shards=2", "--shard_index=2"}, "must be below --num_shards"},
      {{"--mode=eventual"}, "--mode=eventual"},
      {{"--num_workers=0"}, "--num_workers=0"},
      {{"--no_such_flag"}, "no_such_flag"},
      {{"--checkpoint_dir=/proc/shardps/ckpt"}, "/proc/shardps/ckpt"},
      {{"--checkpoint_every_steps=5"}, "needs --checkpoint_dir"},
      {{"--encodings=fp32,zstd"}, "unknown gradient encoding \"zstd\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const CommandResult r =
        MustRun(SHARDPS_SERVER_BIN, c.args, absl::Seconds(10));
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace shardps
