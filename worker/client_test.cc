#include "worker/client.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/shard_server.h"
#include "server/shard_server_testing.h"

namespace shardps {
namespace {

// Two in-process shards of a static job with `num_workers` ranks, and
// clients (one per rank) of a three-tensor model whose tensors span several
// chunks, so that every lane of every shard carries some.
class ClientStepTest : public ::testing::Test {
 protected:
  void Start(uint32_t num_workers, v1::InitSpec::Kind init,
             bool shared_memory = true) {
    shards_ = std::make_unique<server::TestShards>(2, num_workers);
    SHARDPS_ASSERT_OK(shards_->status());
    addresses_ = shards_->addresses();
    layout_.set_chunk_bytes(64);  // 16 floats a chunk
    const std::vector<std::pair<std::string, int64_t>> tensors = {
        {"embed", 70}, {"fc.weight", 33}, {"fc.bias", 5}};
    for (const auto& [name, size] : tensors) {
      v1::TensorSpec* t = layout_.add_tensors();
      t->set_name(name);
      t->add_shape(size);
      t->mutable_init()->set_kind(init);
      t->mutable_init()->set_value(0.25f);
      t->mutable_init()->set_seed(7);
      weights_.emplace_back(size, 0.0f);
      grads_.emplace_back(size, 0.0f);
      for (int64_t i = 0; i < size; ++i) {
        grads_.back()[i] = 0.01f * static_cast<float>(i + 1);
      }
    }
    sgd_.set_kind(v1::OptimizerSpec::KIND_SGD);
    sgd_.set_learning_rate(0.5f);
    sgd_.set_momentum(0.9f);
    for (uint32_t r = 0; r < num_workers; ++r) {
      ClientOptions co;
      co.servers = addresses_;
      co.rank = r;
      co.connect_timeout = absl::Seconds(30);
      co.shared_memory = shared_memory;
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
      SHARDPS_ASSERT_OK(client);
      SHARDPS_ASSERT_OK((*client)->Declare(layout_, sgd_));
      clients_.push_back(*std::move(client));
    }
  }
  void TearDown() override {
    clients_.clear();
    shards_.reset();
  }
  Tensors Weights() {
    Tensors v;
    for (auto& w : weights_) v.emplace_back(absl::MakeSpan(w));
    return v;
  }
  ConstTensors Grads() const {
    ConstTensors v;
    for (const auto& g : grads_) v.emplace_back(g);
    return v;
  }

  std::unique_ptr<server::TestShards> shards_;
  std::vector<std::string> addresses_;
  v1::Layout layout_;
  v1::OptimizerSpec sgd_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::vector<float>> weights_;
  std::vector<std::vector<float>> grads_;
};

// Each lane's stream stays open from step to step: the shards see one
// PushPull call per lane however many steps run, and a new one only after a
// step failed on it.
TEST_F(ClientStepTest, StreamsStayOpenAcrossStepsAndReopenAfterAFailure) {
  Start(1, v1::InitSpec::KIND_CONSTANT);
  Client& client = *clients_[0];
  auto streams = [&] {
    absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
        client.ShardStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    uint64_t n = 0;
    for (const v1::GetStatusResponse& s : *status) n += s.push_streams_total();
    return n;
  };
  for (int64_t step = 0; step < 5; ++step) {
    SHARDPS_ASSERT_OK(client.PushPull(step, Grads(), Weights()));
  }
  const uint64_t lanes = streams();
  EXPECT_GE(lanes, 2u);  // at least one per shard
  EXPECT_LE(lanes, 4u);  // at most streams_per_shard (2) per shard
  for (int64_t step = 5; step < 10; ++step) {
    SHARDPS_ASSERT_OK(client.PushPull(step, Grads(), Weights()));
  }
  EXPECT_EQ(streams(), lanes);
  // A step from the future is refused, which ends the streams it used; the
  // next step opens them again and goes on where the shards are.
  const absl::Status refused = client.PushPull(42, Grads(), Weights());
  EXPECT_TRUE(absl::IsOutOfRange(refused)) << refused;
  SHARDPS_ASSERT_OK(client.PushPull(10, Grads(), Weights()));
  EXPECT_GT(streams(), lanes);
  const uint64_t reopened = streams();
  SHARDPS_ASSERT_OK(client.PushPull(11, Grads(), Weights()));
  EXPECT_EQ(streams(), reopened);
}

TEST_F(ClientStepTest, TensorsPushedOneByOneInAnyOrderEqualAWholeStep) {
  Start(1, v1::InitSpec::KIND_UNIFORM);
  Client& client = *clients_[0];
  // Checked against the optimizer by hand: the first step of SGD with
  // momentum is w -= lr * g.
  SHARDPS_ASSERT_OK(client.Pull(Weights()));
  const std::vector<std::vector<float>> initial = weights_;
  SHARDPS_ASSERT_OK(client.BeginStep(0, Weights()));
  EXPECT_TRUE(client.step_open());
  for (int t = 2; t >= 0; --t) {  // last layer first, as backward goes
    SHARDPS_ASSERT_OK(client.PushTensor(t, grads_[t]));
  }
  SHARDPS_ASSERT_OK(client.FinishStep());
  EXPECT_FALSE(client.step_open());
  for (size_t t = 0; t < weights_.size(); ++t) {
    for (size_t i = 0; i < weights_[t].size(); ++i) {
      ASSERT_EQ(weights_[t][i], initial[t][i] - 0.5f * grads_[t][i])
          << layout_.tensors(t).name() << "[" << i << "]";
    }
  }
  // The next step as a whole, then the servers agree with what came back.
  SHARDPS_ASSERT_OK(client.PushPull(1, Grads(), Weights()));
  std::vector<std::vector<float>> pulled = weights_;
  for (auto& w : pulled) std::fill(w.begin(), w.end(), -1.0f);
  Tensors views;
  for (auto& w : pulled) views.emplace_back(absl::MakeSpan(w));
  SHARDPS_ASSERT_OK(client.Pull(views));
  EXPECT_EQ(pulled, weights_);
}

TEST_F(ClientStepTest, BadPushesAreRefusedAndSendNothing) {
  Start(1, v1::InitSpec::KIND_ZEROS);
  Client& client = *clients_[0];
  EXPECT_TRUE(absl::IsFailedPrecondition(client.PushTensor(0, grads_[0])));
  EXPECT_TRUE(absl::IsFailedPrecondition(client.FinishStep()));
  SHARDPS_ASSERT_OK(client.BeginStep(0, Weights()));
  EXPECT_TRUE(absl::IsFailedPrecondition(client.BeginStep(0, Weights())));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensor(3, grads_[0])));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensor(-1, grads_[0])));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensor(0, grads_[1])));
  EXPECT_TRUE(
      absl::IsInvalidArgument(client.PushTensor(0, grads_[0], {-0.1f})));
  const absl::Status momentum =
      client.PushTensor(0, grads_[0], {std::nullopt, 1.5f});
  EXPECT_TRUE(absl::IsInvalidArgument(momentum));
  EXPECT_NE(momentum.message().find("momentum must be in [0, 1)"),
            std::string::npos)
      << momentum;
  SHARDPS_ASSERT_OK(client.PushTensor(1, grads_[1]));
  const absl::Status twice = client.PushTensor(1, grads_[1]);
  EXPECT_TRUE(absl::IsInvalidArgument(twice));
  EXPECT_NE(twice.message().find("fc.weight"), std::string::npos) << twice;
  // Ending the step without the other tensors names them and cancels it.
  const absl::Status missing = client.FinishStep();
  EXPECT_TRUE(absl::IsFailedPrecondition(missing)) << missing;
  EXPECT_NE(missing.message().find("embed, fc.bias"), std::string::npos)
      << missing;
  EXPECT_FALSE(client.step_open());
  // The step can be pushed again, whole: nothing was applied.
  SHARDPS_ASSERT_OK(client.PushPull(0, Grads(), Weights()));
  EXPECT_EQ(weights_[0][0], -0.5f * grads_[0][0]);
}

// The gradient bytes the shards have received.
uint64_t BytesIn(Client& client) {
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      client.ShardStatus();
  EXPECT_TRUE(status.ok()) << status.status();
  uint64_t n = 0;
  if (status.ok()) {
    for (const v1::GetStatusResponse& s : *status) n += s.bytes_in_total();
  }
  return n;
}

// A tensor pushed in parts (a large weight's gradient computed in blocks):
// each part's whole chunks reach the shards at once, before the tensor is
// complete, and the step equals one with whole pushes.
TEST_F(ClientStepTest, PartsOfATensorGoAtOnceAndEqualAWholePush) {
  Start(1, v1::InitSpec::KIND_ZEROS);
  Client& client = *clients_[0];
  SHARDPS_ASSERT_OK(client.BeginStep(0, Weights()));
  SHARDPS_ASSERT_OK(client.PushTensor(2, grads_[2]));
  SHARDPS_ASSERT_OK(client.PushTensor(1, grads_[1]));
  const uint64_t before = 4 * (33 + 5);
  // 20 of embed's 70 elements: its first chunk (14 of them; the tensor
  // is cut into 5 equal chunks of at most 16) goes, and nothing else.
  SHARDPS_ASSERT_OK(client.PushTensorPart(0, grads_[0], 20));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (BytesIn(client) <= before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(BytesIn(client), before + 4 * 14);
  EXPECT_EQ(client.tensors_left(), 1);
  // Fewer final elements than before send nothing more; the rest, from
  // the same buffer, completes the tensor.
  SHARDPS_ASSERT_OK(client.PushTensorPart(0, grads_[0], 10));
  SHARDPS_ASSERT_OK(client.PushTensorPart(0, grads_[0], 64));
  SHARDPS_ASSERT_OK(client.PushTensor(0, grads_[0]));
  EXPECT_EQ(client.tensors_left(), 0);
  SHARDPS_ASSERT_OK(client.FinishStep());
  EXPECT_EQ(BytesIn(client), 4u * (70 + 33 + 5));
  for (size_t t = 0; t < weights_.size(); ++t) {
    for (size_t i = 0; i < weights_[t].size(); ++i) {
      ASSERT_EQ(weights_[t][i], -0.5f * grads_[t][i])
          << layout_.tensors(t).name() << "[" << i << "]";
    }
  }
}

TEST_F(ClientStepTest, PartsMustComeFromOneBufferWithTheSameSettings) {
  Start(1, v1::InitSpec::KIND_ZEROS);
  Client& client = *clients_[0];
  EXPECT_TRUE(
      absl::IsFailedPrecondition(client.PushTensorPart(0, grads_[0], 16)));
  SHARDPS_ASSERT_OK(client.BeginStep(0, Weights()));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensorPart(0, grads_[0], 71)));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensorPart(0, grads_[0], -1)));
  EXPECT_TRUE(absl::IsInvalidArgument(client.PushTensorPart(0, grads_[1], 16)));
  SHARDPS_ASSERT_OK(client.PushTensorPart(0, grads_[0], 16));
  const std::vector<float> copy = grads_[0];
  const absl::Status other = client.PushTensorPart(0, copy, 40);
  EXPECT_TRUE(absl::IsInvalidArgument(other)) << other;
  EXPECT_NE(other.message().find("embed: part of its gradient went from "
                                 "another buffer"),
            std::string::npos)
      << other;
  const absl::Status rate = client.PushTensor(0, grads_[0], {0.125f});
  EXPECT_TRUE(absl::IsInvalidArgument(rate)) << rate;
  EXPECT_NE(rate.message().find("learning rate"), std::string::npos) << rate;
  SHARDPS_ASSERT_OK(client.PushTensorPart(2, grads_[2], 4));
  // A tensor of which only parts went is not pushed: the step ends naming
  // it, and nothing was applied.
  SHARDPS_ASSERT_OK(client.PushTensor(1, grads_[1]));
  const absl::Status missing = client.FinishStep();
  EXPECT_TRUE(absl::IsFailedPrecondition(missing)) << missing;
  EXPECT_NE(missing.message().find("embed, fc.bias"), std::string::npos)
      << missing;
  SHARDPS_ASSERT_OK(client.PushPull(0, Grads(), Weights()));
  EXPECT_EQ(weights_[0][0], -0.5f * grads_[0][0]);
}

// The weights of a tensor's first elements can be awaited before the
// step ends (the next step's first layer is computed from them while the
// rest arrives): they are final when AwaitWeights says so.
TEST_F(ClientStepTest, AwaitedWeightsAreFinalBeforeTheStepEnds) {
  Start(2, v1::InitSpec::KIND_ZEROS, /*shared_memory=*/false);
  std::vector<std::vector<float>> other = weights_;
  Tensors other_views;
  for (auto& w : other) other_views.emplace_back(absl::MakeSpan(w));
  Client& client = *clients_[0];
  // No step, or a tensor not pushed yet, or out of range: nothing to wait
  // for.
  EXPECT_FALSE(client.AwaitWeights(0, 70));
  SHARDPS_ASSERT_OK(client.BeginStep(0, Weights()));
  EXPECT_FALSE(client.AwaitWeights(0, 70));
  EXPECT_FALSE(client.AwaitWeights(3, 1));
  for (int t = 2; t >= 0; --t)
    SHARDPS_ASSERT_OK(client.PushTensor(t, grads_[t]));
  // Rank 1 pushes only embed: its weights come; fc's cannot yet.
  SHARDPS_ASSERT_OK(clients_[1]->BeginStep(0, other_views));
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(0, grads_[0]));
  ASSERT_TRUE(client.AwaitWeights(0, 70));
  for (int i = 0; i < 70; ++i) {
    ASSERT_EQ(weights_[0][i], -0.5f * grads_[0][i]) << i;
  }
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(1, grads_[1]));
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(2, grads_[2]));
  ASSERT_TRUE(client.AwaitWeights(1, 20));
  for (int i = 0; i < 20; ++i) {
    ASSERT_EQ(weights_[1][i], -0.5f * grads_[1][i]) << i;
  }
  SHARDPS_ASSERT_OK(client.FinishStep());
  SHARDPS_ASSERT_OK(clients_[1]->FinishStep());
  EXPECT_EQ(weights_, other);
  // A two-phase step's first replies carry no weights.
  StepOptions two_phase;
  two_phase.second_phase = true;
  two_phase.max_grad_norm = 1.0f;
  SHARDPS_ASSERT_OK(client.BeginStep(1, Weights(), two_phase));
  for (int t = 2; t >= 0; --t)
    SHARDPS_ASSERT_OK(client.PushTensor(t, grads_[t]));
  EXPECT_FALSE(client.AwaitWeights(0, 70));
  client.AbortStep();
}

// Replies through shared memory are taken when the step ends.
TEST_F(ClientStepTest, WeightsThroughSharedMemoryAreNotAwaited) {
  Start(1, v1::InitSpec::KIND_ZEROS, /*shared_memory=*/true);
  ASSERT_TRUE(clients_[0]->replies_through_rings());
  SHARDPS_ASSERT_OK(clients_[0]->BeginStep(0, Weights()));
  for (int t = 2; t >= 0; --t) {
    SHARDPS_ASSERT_OK(clients_[0]->PushTensor(t, grads_[t]));
  }
  EXPECT_FALSE(clients_[0]->AwaitWeights(0, 70));
  SHARDPS_ASSERT_OK(clients_[0]->FinishStep());
}

TEST_F(ClientStepTest, TwoRanksPushingTensorByTensorGetTheMean) {
  Start(2, v1::InitSpec::KIND_ZEROS);
  std::vector<std::vector<float>> other = weights_;
  Tensors other_views;
  for (auto& w : other) other_views.emplace_back(absl::MakeSpan(w));
  SHARDPS_ASSERT_OK(clients_[0]->BeginStep(0, Weights()));
  SHARDPS_ASSERT_OK(clients_[1]->BeginStep(0, other_views));
  // Interleaved: rank 1's pushes arrive while rank 0's step is open.
  const std::vector<float> zeros0(70, 0.0f), zeros1(33, 0.0f), zeros2(5, 0.0f);
  SHARDPS_ASSERT_OK(clients_[0]->PushTensor(0, grads_[0]));
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(2, zeros2));
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(1, zeros1));
  SHARDPS_ASSERT_OK(clients_[0]->PushTensor(1, grads_[1]));
  SHARDPS_ASSERT_OK(clients_[0]->PushTensor(2, grads_[2]));
  SHARDPS_ASSERT_OK(clients_[1]->PushTensor(0, zeros0));
  SHARDPS_ASSERT_OK(clients_[0]->FinishStep());
  SHARDPS_ASSERT_OK(clients_[1]->FinishStep());
  EXPECT_EQ(weights_, other);
  for (size_t t = 0; t < weights_.size(); ++t) {
    for (size_t i = 0; i < weights_[t].size(); ++i) {
      ASSERT_EQ(weights_[t][i], -0.5f * (grads_[t][i] / 2.0f));
    }
  }
}

// A model of one zero-initialised tensor "w" of `elements` floats in
// chunks of `chunk_bytes`, and plain SGD at `lr`.
v1::Layout OneTensor(int64_t elements, uint64_t chunk_bytes) {
  v1::Layout layout;
  layout.set_chunk_bytes(chunk_bytes);
  v1::TensorSpec* t = layout.add_tensors();
  t->set_name("w");
  t->add_shape(elements);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_ZEROS);
  return layout;
}
v1::OptimizerSpec Sgd(float lr) {
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OptimizerSpec::KIND_SGD);
  sgd.set_learning_rate(lr);
  return sgd;
}

// A shard that loses every 37th reply ends that stream with UNAVAILABLE, as
// a lost connection would, while the client is still writing the lane's
// chunks and reading the replies sent before the fault. Each step retries
// what was not answered and succeeds, and every chunk is updated once a
// step: the failed write neither turns the replies still being read into
// "bad replies" (INTERNAL) nor cancels the call before the shard's status
// is in (CANCELLED); neither is retried. `streams` per shard; `in_buffers`:
// the gradients are written into the client's GradientBuffers() each step.
void RunThroughDroppedReplies(int streams, bool in_buffers) {
  server::ShardServerOptions so;
  so.store.num_workers = 1;
  so.service.drop_reply_every = 37;
  absl::StatusOr<std::unique_ptr<server::ShardServer>> shard =
      server::ShardServer::Start(so);
  SHARDPS_ASSERT_OK(shard);
  ClientOptions co;
  co.servers = {absl::StrCat("127.0.0.1:", (*shard)->port())};
  co.streams_per_shard = streams;
  co.rpc_timeout = absl::Seconds(20);
  co.connect_timeout = absl::Seconds(10);
  co.max_attempts = 100;
  co.initial_backoff = absl::Milliseconds(1);
  co.max_backoff = absl::Milliseconds(1);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
  SHARDPS_ASSERT_OK(client);
  // 16 Ki floats a chunk: 64 chunks.
  const v1::Layout layout = OneTensor(1 << 20, 64 << 10);
  const v1::OptimizerSpec sgd = Sgd(0.5f);
  SHARDPS_ASSERT_OK((*client)->Declare(layout, sgd));
  std::vector<float> weights(1 << 20), own(1 << 20), want(1 << 20, 0.0f);
  constexpr int64_t kSteps = 30;
  for (int64_t step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    absl::Span<float> grad = absl::MakeSpan(own);
    absl::Span<float> w = absl::MakeSpan(weights);
    if (in_buffers) {
      // Taken again every step: they move (with the weights) after a step
      // with a failed stream.
      const Tensors buffers = (*client)->GradientBuffers();
      const Tensors weight_buffers = (*client)->WeightBuffers();
      ASSERT_EQ(buffers.size(), 1u);
      ASSERT_EQ(weight_buffers.size(), 1u);
      grad = buffers[0];
      w = weight_buffers[0];
    }
    for (size_t i = 0; i < grad.size(); ++i) {
      grad[i] = 0.25f * (i % 7 + 1);
      want[i] -= 0.5f * grad[i];
    }
    SHARDPS_ASSERT_OK((*client)->PushPull(step, {grad}, {w}));
    ASSERT_TRUE(std::equal(w.begin(), w.end(), want.begin()));
    if (in_buffers) {
      const Tensors now = (*client)->WeightBuffers();
      ASSERT_TRUE(std::equal(now[0].begin(), now[0].end(), want.begin()));
    }
  }
  EXPECT_GT((*client)->retries(), 0);
  if (!in_buffers) return;
  // Steps with a failed stream moved them to fresh regions, and the
  // streams named the new ones: the last step's pushes (those not retried
  // over plain gRPC) were still read from there.
  EXPECT_GT((*client)->buffer_regions(), 2);
  auto read_in_place = [&] {
    absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
        (*client)->ShardStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? (*status)[0].shared_memory_gradient_pushes_total() : 0;
  };
  const uint64_t before = read_in_place();
  const Tensors buffers = (*client)->GradientBuffers();
  ASSERT_EQ(buffers.size(), 1u);
  std::fill(buffers[0].begin(), buffers[0].end(), 0.5f);
  SHARDPS_ASSERT_OK((*client)->PushPull(kSteps, {buffers[0]},
                                        {(*client)->WeightBuffers()[0]}));
  EXPECT_GT(read_in_place(), before);
}

TEST(ClientFaultTest, StepsSurviveStreamsThatEndWithUnavailableMidStep) {
  RunThroughDroppedReplies(1, false);
}

TEST(ClientFaultTest, GradientBuffersMoveAfterAStepWithAFailedStream) {
  RunThroughDroppedReplies(2, true);
}

// A shard that restarts between steps ended the streams kept open to it:
// the next step opens new ones, which the steps after it keep.
TEST(ClientFaultTest, AShardRestartedBetweenStepsGetsNewStreams) {
  server::ShardServerOptions so;
  so.store.num_workers = 1;
  absl::StatusOr<std::unique_ptr<server::ShardServer>> shard =
      server::ShardServer::Start(so);
  SHARDPS_ASSERT_OK(shard);
  so.port = (*shard)->port();
  ClientOptions co;
  co.servers = {absl::StrCat("127.0.0.1:", so.port)};
  co.rpc_timeout = absl::Seconds(20);
  co.connect_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
  SHARDPS_ASSERT_OK(client);
  // 8 chunks, on both lanes.
  const v1::Layout layout = OneTensor(int64_t{2} << 20, 1 << 20);
  const v1::OptimizerSpec sgd = Sgd(0.5f);
  SHARDPS_ASSERT_OK((*client)->Declare(layout, sgd));
  std::vector<float> weights(int64_t{2} << 20), grad(weights.size(), 0.5f);
  for (int64_t step = 0; step < 3; ++step) {
    SHARDPS_ASSERT_OK(
        (*client)->PushPull(step, {grad}, {absl::MakeSpan(weights)}));
  }
  (*shard)->Shutdown(absl::ZeroDuration());
  shard->reset();
  shard = server::ShardServer::Start(so);  // the same port, empty
  SHARDPS_ASSERT_OK(shard);
  SHARDPS_ASSERT_OK((*client)->Declare(layout, sgd));
  ASSERT_EQ((*client)->start_step(), 0);
  auto streams = [&] {
    absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
        (*client)->ShardStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? (*status)[0].push_streams_total() : 0;
  };
  SHARDPS_ASSERT_OK((*client)->PushPull(0, {grad}, {absl::MakeSpan(weights)}));
  EXPECT_EQ(weights[0], -0.25f);
  EXPECT_EQ(weights.back(), -0.25f);
  const uint64_t opened = streams();
  EXPECT_GE(opened, 2u);  // one per lane, plus any retry's
  SHARDPS_ASSERT_OK((*client)->PushPull(1, {grad}, {absl::MakeSpan(weights)}));
  EXPECT_EQ(weights[0], -0.5f);
  EXPECT_EQ(streams(), opened);
}

TEST(ClientBrokenStreamTest, AStepWhoseStreamBreaksWhileWritesWaitFails) {
  // Rank 1 of two pushes 24 MiB to a shard that holds its first chunk (rank
  // 0 never pushes), so the stream stops being read and later writes wait
  // with their gradient slices inside gRPC. The shard goes away: the step
  // fails with an error, and ending the broken call (which releases those
  // slices) must not deadlock.
  server::ShardServerOptions so;
  so.store.num_workers = 2;
  absl::StatusOr<std::unique_ptr<server::ShardServer>> shard =
      server::ShardServer::Start(so);
  SHARDPS_ASSERT_OK(shard);
  ClientOptions co;
  co.servers = {absl::StrCat("127.0.0.1:", (*shard)->port())};
  co.rank = 1;
  co.streams_per_shard = 1;
  co.rpc_timeout = absl::Seconds(5);
  co.connect_timeout = absl::Seconds(2);
  co.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
  SHARDPS_ASSERT_OK(client);
  SHARDPS_ASSERT_OK(
      (*client)->Declare(OneTensor(int64_t{6} << 20, 1 << 20), Sgd(0.5f)));
  std::vector<float> weights(int64_t{6} << 20), grad(weights.size(), 1e-3f);
  SHARDPS_ASSERT_OK((*client)->BeginStep(0, {absl::MakeSpan(weights)}));
  SHARDPS_ASSERT_OK((*client)->PushTensor(0, grad));
  absl::SleepFor(absl::Milliseconds(500));  // the writes back up
  (*shard)->Shutdown(absl::ZeroDuration());
  const absl::Status finished = (*client)->FinishStep();
  EXPECT_FALSE(finished.ok());
}

}  // namespace
}  // namespace shardps

namespace shardps {
namespace {

// Ten steps of a two-shard job with one worker whose gradients depend on
// its weights; `no_shared_memory`: shards that refuse shared memory;
// `rings`: headers through message rings too. Returns the final weights,
// what a Pull then gives and, by shard, whether the client used shared
// memory (and rings), how many of the shard's calls did (with rings), and
// how many of those were the last Pull. `in_buffers`: the gradients are
// computed in the client's GradientBuffers().
struct SharedMemoryRun {
  std::vector<float> weights;
  std::vector<float> pulled;
  std::vector<bool> used;
  std::vector<bool> used_rings;
  std::vector<uint64_t> shm_streams;
  std::vector<uint64_t> ring_streams;
  std::vector<uint64_t> shm_pulls;
  std::vector<uint64_t> gradient_pushes;  // read from the gradient region
  std::vector<uint64_t> weight_replies;   // written into the weight region
  std::vector<uint64_t> pull_mappings;    // Pull regions the shard mapped
  std::vector<uint64_t> pull_mappings_reused;
  size_t gradient_buffers = 0;  // GradientBuffers().size()
  std::string described;
};
SharedMemoryRun RunTenSteps(bool shared_memory,
                            std::vector<uint32_t> no_shared_memory = {},
                            bool rings = true, bool in_buffers = false) {
  SharedMemoryRun run;
  server::TestShards shards(2, 1, no_shared_memory);
  EXPECT_TRUE(shards.status().ok()) << shards.status();
  ClientOptions co;
  co.servers = shards.addresses();
  co.connect_timeout = absl::Seconds(30);
  co.shared_memory = shared_memory;
  co.shared_memory_rings = rings;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
  EXPECT_TRUE(client.ok()) << client.status();
  v1::Layout layout;
  layout.set_chunk_bytes(256);  // 64 floats a chunk: 16 chunks
  v1::TensorSpec* t = layout.add_tensors();
  t->set_name("w");
  t->add_shape(1000);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
  t->mutable_init()->set_value(0.5f);
  t->mutable_init()->set_seed(11);
  v1::OptimizerSpec adam;
  adam.set_kind(v1::OptimizerSpec::KIND_ADAMW);
  adam.set_learning_rate(0.01f);
  adam.set_weight_decay(0.1f);
  EXPECT_TRUE((*client)->Declare(layout, adam).ok());
  run.weights.assign(1000, 0);
  EXPECT_TRUE((*client)->Pull({absl::MakeSpan(run.weights)}).ok());
  std::vector<float> own(1000);
  const Tensors buffers = (*client)->GradientBuffers();
  run.gradient_buffers = buffers.size();
  const Tensors weight_buffers = (*client)->WeightBuffers();
  EXPECT_EQ(weight_buffers.size(), buffers.size());
  const bool use_buffers = in_buffers && !buffers.empty();
  const absl::Span<float> grad = use_buffers ? buffers[0] : absl::MakeSpan(own);
  // The weights are kept in the weight buffers too, where the shards write
  // them.
  const absl::Span<float> weights =
      use_buffers ? weight_buffers[0] : absl::MakeSpan(run.weights);
  std::copy(run.weights.begin(), run.weights.end(), weights.begin());
  for (int64_t step = 0; step < 10; ++step) {
    for (int i = 0; i < 1000; ++i) {
      grad[i] = weights[i] * weights[i] - 0.1f * (i % 7);
    }
    const absl::Status s = (*client)->PushPull(step, {grad}, {weights});
    EXPECT_TRUE(s.ok()) << s;
  }
  std::copy(weights.begin(), weights.end(), run.weights.begin());
  absl::StatusOr<std::vector<v1::GetStatusResponse>> before =
      (*client)->ShardStatus();
  EXPECT_TRUE(before.ok()) << before.status();
  run.pulled.assign(1000, 0);
  EXPECT_TRUE((*client)->Pull({absl::MakeSpan(run.pulled)}).ok());
  // Pulled again, the same region: the shards map it once.
  for (int again = 0; again < 2; ++again) {
    std::vector<float> repeat(1000, 0);
    EXPECT_TRUE((*client)->Pull({absl::MakeSpan(repeat)}).ok());
    EXPECT_EQ(repeat, run.pulled);
  }
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      (*client)->ShardStatus();
  EXPECT_TRUE(status.ok()) << status.status();
  for (uint32_t s = 0; s < 2; ++s) {
    run.used.push_back((*client)->shared_memory(s));
    run.used_rings.push_back((*client)->rings(s));
    run.shm_streams.push_back((*status)[s].shared_memory_streams_total());
    run.ring_streams.push_back((*status)[s].shared_memory_ring_streams_total());
    run.shm_pulls.push_back((*status)[s].shared_memory_streams_total() -
                            (*before)[s].shared_memory_streams_total());
    run.gradient_pushes.push_back(
        (*status)[s].shared_memory_gradient_pushes_total());
    run.weight_replies.push_back(
        (*status)[s].shared_memory_weight_replies_total());
    run.pull_mappings.push_back(
        (*status)[s].shared_memory_pull_mappings_total());
    run.pull_mappings_reused.push_back(
        (*status)[s].shared_memory_pull_mappings_reused_total());
  }
  run.described = (*client)->DescribeTransport();
  return run;
}

TEST(ClientSharedMemoryTest, GivesTheWeightsOfGrpcBitForBit) {
  const SharedMemoryRun shm = RunTenSteps(true);
  const SharedMemoryRun grpc = RunTenSteps(false);
  EXPECT_EQ(shm.used, std::vector<bool>({true, true}));
  EXPECT_EQ(shm.used_rings, std::vector<bool>({true, true}));
  EXPECT_GE(shm.shm_streams[0], 1u);
  EXPECT_GE(shm.shm_streams[1], 1u);
  // One stream per shard for all ten steps: no step fell back to gRPC.
  EXPECT_EQ(shm.ring_streams, std::vector<uint64_t>({1, 1}));
  EXPECT_EQ(shm.described,
            "payloads and headers through shared memory (message rings) with "
            "every shard");
  EXPECT_EQ(grpc.used, std::vector<bool>({false, false}));
  EXPECT_EQ(grpc.used_rings, std::vector<bool>({false, false}));
  EXPECT_EQ(grpc.shm_streams, std::vector<uint64_t>({0, 0}));
  EXPECT_EQ(grpc.ring_streams, std::vector<uint64_t>({0, 0}));
  // Payloads through shared memory, headers through gRPC.
  const SharedMemoryRun no_rings = RunTenSteps(true, {}, /*rings=*/false);
  EXPECT_EQ(no_rings.used_rings, std::vector<bool>({false, false}));
  EXPECT_EQ(no_rings.ring_streams, std::vector<uint64_t>({0, 0}));
  EXPECT_GE(no_rings.shm_streams[0], 1u);
  EXPECT_EQ(no_rings.described,
            "payloads through shared memory with every shard");
  EXPECT_EQ(no_rings.weights, grpc.weights);
  // Pull through the region too, and it gives the weights of the last step;
  // with the Pull before the first step, four Pulls and one mapping of the
  // region by each shard.
  EXPECT_EQ(shm.shm_pulls, std::vector<uint64_t>({3, 3}));
  EXPECT_EQ(shm.pull_mappings, std::vector<uint64_t>({1, 1}));
  EXPECT_EQ(shm.pull_mappings_reused, std::vector<uint64_t>({3, 3}));
  EXPECT_EQ(grpc.pull_mappings, std::vector<uint64_t>({0, 0}));
  EXPECT_EQ(shm.pulled, shm.weights);
  EXPECT_EQ(grpc.pulled, grpc.weights);
  ASSERT_EQ(shm.weights.size(), grpc.weights.size());
  EXPECT_EQ(std::memcmp(shm.weights.data(), grpc.weights.data(),
                        4 * shm.weights.size()),
            0);
  // The weights moved (the comparison is not of two untouched copies).
  const SharedMemoryRun again = RunTenSteps(true);
  EXPECT_EQ(again.weights, shm.weights);
  float moved = 0;
  for (int i = 0; i < 1000; ++i) moved += std::abs(shm.weights[i]);
  EXPECT_GT(moved, 0);
}

// Gradients computed in GradientBuffers() are read by the shards from
// there instead of being copied into the stream's region, and weights kept
// in WeightBuffers() are written there by the shards, with the same results
// bit for bit; a shard without shared memory gets and sends them over gRPC
// from and into the same buffers.
TEST(ClientSharedMemoryTest, GradientsAndWeightsInItsBuffersGoWithoutACopy) {
  const SharedMemoryRun grpc = RunTenSteps(false);
  EXPECT_EQ(grpc.gradient_buffers, 0u);  // no shard uses shared memory
  const SharedMemoryRun copied = RunTenSteps(true);
  EXPECT_EQ(copied.gradient_buffers, 1u);
  EXPECT_EQ(copied.gradient_pushes, std::vector<uint64_t>({0, 0}));
  EXPECT_EQ(copied.weight_replies, std::vector<uint64_t>({0, 0}));
  const SharedMemoryRun in_place = RunTenSteps(true, {}, true, true);
  EXPECT_EQ(in_place.gradient_buffers, 1u);
  // 10 steps of 16 chunks, 8 on each shard.
  EXPECT_EQ(in_place.gradient_pushes, std::vector<uint64_t>({80, 80}));
  EXPECT_EQ(in_place.weight_replies, std::vector<uint64_t>({80, 80}));
  EXPECT_EQ(in_place.ring_streams, std::vector<uint64_t>({1, 1}));
  ASSERT_EQ(in_place.weights.size(), grpc.weights.size());
  EXPECT_EQ(std::memcmp(in_place.weights.data(), grpc.weights.data(),
                        4 * grpc.weights.size()),
            0);
  EXPECT_EQ(in_place.weights, copied.weights);
  const SharedMemoryRun no_rings = RunTenSteps(true, {}, false, true);
  EXPECT_EQ(no_rings.gradient_pushes, std::vector<uint64_t>({80, 80}));
  EXPECT_EQ(no_rings.weight_replies, std::vector<uint64_t>({80, 80}));
  EXPECT_EQ(no_rings.weights, grpc.weights);
  const SharedMemoryRun mixed = RunTenSteps(true, {1}, true, true);
  EXPECT_EQ(mixed.gradient_pushes, std::vector<uint64_t>({80, 0}));
  EXPECT_EQ(mixed.weight_replies, std::vector<uint64_t>({80, 0}));
  EXPECT_EQ(mixed.weights, grpc.weights);
}

TEST(ClientSharedMemoryTest, AShardThatRefusesItGetsPayloadsOverGrpc) {
  const SharedMemoryRun mixed = RunTenSteps(true, {1});
  const SharedMemoryRun grpc = RunTenSteps(false);
  EXPECT_EQ(mixed.used, std::vector<bool>({true, false}));
  EXPECT_EQ(mixed.used_rings, std::vector<bool>({true, false}));
  EXPECT_GE(mixed.shm_streams[0], 1u);
  EXPECT_EQ(mixed.shm_streams[1], 0u);
  EXPECT_EQ(mixed.ring_streams, std::vector<uint64_t>({1, 0}));
  EXPECT_EQ(mixed.shm_pulls, std::vector<uint64_t>({3, 0}));
  EXPECT_EQ(mixed.pull_mappings, std::vector<uint64_t>({1, 0}));
  EXPECT_EQ(mixed.pull_mappings_reused, std::vector<uint64_t>({3, 0}));
  EXPECT_EQ(mixed.pulled, grpc.weights);
  EXPECT_EQ(mixed.described,
            "payloads through shared memory with shards 0, over gRPC to the "
            "rest (shard 1: this shard was started with "
            "--shared_memory=false)");
  EXPECT_EQ(mixed.weights, grpc.weights);
}

}  // namespace
}  // namespace shardps
