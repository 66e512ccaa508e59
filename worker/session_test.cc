#include "worker/session.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/shard_server_testing.h"

namespace shardps::worker {
namespace {

// A static job of two in-process shards and two ranks whose model's
// initial values come from rank 0 (InitSpec KIND_PROVIDED).
class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shards_ = std::make_unique<server::TestShards>(2, 2);
    SHARDPS_ASSERT_OK(shards_->status());
    servers_ = shards_->addresses();
    layout_.set_chunk_bytes(32);
    for (const auto& [name, size] :
         std::vector<std::pair<std::string, int64_t>>{{"w", 20}, {"b", 3}}) {
      v1::TensorSpec* t = layout_.add_tensors();
      t->set_name(name);
      t->add_shape(size);
      t->mutable_init()->set_kind(v1::InitSpec::KIND_PROVIDED);
    }
    sgd_.set_kind(v1::OptimizerSpec::KIND_SGD);
    sgd_.set_learning_rate(0.5f);
  }
  void TearDown() override { shards_.reset(); }
  std::unique_ptr<Session> Start(int rank) {
    SessionOptions o;
    o.servers = servers_;
    o.rank = rank;
    o.num_workers = 2;
    o.connect_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Session>> s = Session::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  std::unique_ptr<server::TestShards> shards_;
  std::vector<std::string> servers_;
  v1::Layout layout_;
  v1::OptimizerSpec sgd_;
};

TEST_F(SessionTest, RankZerosValuesAreEveryRanksStartAndStepsUseThem) {
  std::vector<float> w0(20), b0(3);
  for (int i = 0; i < 20; ++i) w0[i] = 0.1f * i;
  for (int i = 0; i < 3; ++i) b0[i] = -1.0f - i;
  std::vector<std::vector<float>> weights(2, std::vector<float>(23, 0.0f));
  auto views = [&](int r) {
    return Tensors{absl::MakeSpan(weights[r]).subspan(0, 20),
                   absl::MakeSpan(weights[r]).subspan(20, 3)};
  };
  std::unique_ptr<Session> rank0 = Start(0);
  std::unique_ptr<Session> rank1 = Start(1);
  ASSERT_NE(rank0, nullptr);
  ASSERT_NE(rank1, nullptr);
  // Rank 1 declares first and waits for the values rank 0 sends.
  absl::Status declared1;
  std::thread waiter(
      [&] { declared1 = rank1->Declare(layout_, sgd_, {}, views(1)); });
  absl::SleepFor(absl::Milliseconds(200));
  SHARDPS_ASSERT_OK(rank0->Declare(
      layout_, sgd_, {absl::MakeConstSpan(w0), absl::MakeConstSpan(b0)},
      views(0)));
  waiter.join();
  SHARDPS_ASSERT_OK(declared1);
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 20; ++i) ASSERT_EQ(weights[r][i], w0[i]);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(weights[r][20 + i], b0[i]);
  }
  SHARDPS_ASSERT_OK_AND_ASSIGN(const int64_t start, rank0->StartEpochs(5));
  EXPECT_EQ(start, 0);
  EXPECT_EQ(rank0->ActiveRanks(), (std::vector<uint32_t>{0, 1}));
  // A step with a worker-side learning rate on w; b gets no gradient from
  // either rank, so the servers skip its update.
  const std::vector<float> g0(20, 1.0f), g1(20, 3.0f);
  SHARDPS_ASSERT_OK(rank0->BeginStep());
  SHARDPS_ASSERT_OK(rank1->BeginStep());
  SHARDPS_ASSERT_OK(rank0->PushNoGradient(1, {0.25f}));
  SHARDPS_ASSERT_OK(rank1->PushTensor(0, g1, {0.25f}));
  SHARDPS_ASSERT_OK(rank1->PushNoGradient(1, {0.25f}));
  SHARDPS_ASSERT_OK(rank0->PushTensor(0, g0, {0.25f}));
  absl::StatusOr<bool> done1;
  std::thread finisher([&] { done1 = rank1->FinishStep(); });
  SHARDPS_ASSERT_OK_AND_ASSIGN(const bool done0, rank0->FinishStep());
  finisher.join();
  SHARDPS_ASSERT_OK(done1);
  EXPECT_TRUE(done0);
  EXPECT_TRUE(*done1);
  EXPECT_EQ(rank0->step(), 1);
  EXPECT_EQ(weights[0], weights[1]);
  for (int i = 0; i < 20; ++i) {
    ASSERT_EQ(weights[0][i], w0[i] - 0.25f * ((1.0f + 3.0f) / 2.0f));
  }
  for (int i = 0; i < 3; ++i) ASSERT_EQ(weights[0][20 + i], b0[i]);
  // A step that forgets a tensor is the caller's error, named.
  SHARDPS_ASSERT_OK(rank0->BeginStep());
  SHARDPS_ASSERT_OK(rank0->PushTensor(0, g0, {0.25f}));
  absl::StatusOr<bool> forgot = rank0->FinishStep();
  EXPECT_TRUE(absl::IsFailedPrecondition(forgot.status())) << forgot.status();
  EXPECT_NE(forgot.status().message().find("b"), std::string::npos);
  EXPECT_EQ(rank0->step(), 1);
}

TEST_F(SessionTest, BadOptionsAreRefused) {
  SessionOptions o;
  EXPECT_TRUE(absl::IsInvalidArgument(Session::Start(o).status()));
  o.servers = servers_;
  o.coordinator = "127.0.0.1:1";
  EXPECT_TRUE(absl::IsInvalidArgument(Session::Start(o).status()));
  o.coordinator.clear();
  o.rank = 2;
  o.num_workers = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(Session::Start(o).status()));
}

TEST_F(SessionTest, UnreachableServersFailWithinTheTimeout) {
  SessionOptions o;
  o.servers = {"127.0.0.1:1"};  // nothing listens there
  o.connect_timeout = absl::Seconds(1);
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> s, Session::Start(o));
  std::vector<float> w(20), b(3);
  const absl::Time start = absl::Now();
  const absl::Status declared =
      s->Declare(layout_, sgd_, {w, b}, {absl::MakeSpan(w), absl::MakeSpan(b)});
  EXPECT_TRUE(absl::IsDeadlineExceeded(declared) ||
              absl::IsUnavailable(declared))
      << declared;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

}  // namespace
}  // namespace shardps::worker
