// The Client with compression against real in-process shards: error feedback
// gets every coordinate of a top-k gradient applied over time (and without it
// the dropped ones never move), BF16 weights are the rounding of the shards'
// fp32 weights, sparse weights are the copy the shards move, a gradient the
// encoding cannot carry sends nothing, and a rollback drops the residuals.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/shard_server_testing.h"
#include "worker/client.h"

namespace shardps {
namespace {

constexpr int64_t kElements = 64;

// Two shards of a one-worker job holding "a" (40) and "b" (24) in chunks of
// at most 16 floats, SGD lr 1 without momentum: each step w -= decoded
// gradient.
class CompressedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shards_ = std::make_unique<server::TestShards>(2, 1);
    SHARDPS_ASSERT_OK(shards_->status());
    addresses_ = shards_->addresses();
    layout_.set_chunk_bytes(64);
    for (const auto& [name, size] :
         std::vector<std::pair<std::string, int64_t>>{{"a", 40}, {"b", 24}}) {
      v1::TensorSpec* t = layout_.add_tensors();
      t->set_name(name);
      t->add_shape(size);
      t->mutable_init()->set_kind(v1::InitSpec::KIND_CONSTANT);
      t->mutable_init()->set_value(1.0f);
    }
    sgd_.set_kind(v1::OptimizerSpec::KIND_SGD);
    sgd_.set_learning_rate(1.0f);
    // Distinct magnitudes, so the top-k of a chunk is clear.
    for (int64_t i = 0; i < kElements; ++i) {
      grad_.push_back((i % 2 == 0 ? 1.0f : -1.0f) * 0.001f *
                      static_cast<float>(1 + (i * 7) % 16));
    }
  }
  std::unique_ptr<Client> NewClient(const Compression& c) {
    ClientOptions co;
    co.servers = addresses_;
    co.connect_timeout = absl::Seconds(30);
    co.compression = c;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
    EXPECT_TRUE(client.ok()) << client.status();
    EXPECT_TRUE((*client)->Declare(layout_, sgd_).ok());
    return *std::move(client);
  }
  // One step of the constant gradient; the weights the client got.
  absl::Status Step(Client* client, int64_t step, std::vector<float>* w) {
    w->assign(kElements, 0.0f);
    return client->PushPull(
        step,
        {absl::MakeConstSpan(grad_).subspan(0, 40),
         absl::MakeConstSpan(grad_).subspan(40)},
        {absl::MakeSpan(*w).subspan(0, 40), absl::MakeSpan(*w).subspan(40)});
  }
  // The shards' fp32 weights.
  std::vector<float> ShardWeights() {
    std::unique_ptr<Client> reader = NewClient(Compression());
    std::vector<float> w(kElements);
    EXPECT_TRUE(reader
                    ->Pull({absl::MakeSpan(w).subspan(0, 40),
                            absl::MakeSpan(w).subspan(40)})
                    .ok());
    return w;
  }

  std::unique_ptr<server::TestShards> shards_;
  std::vector<std::string> addresses_;
  v1::Layout layout_;
  v1::OptimizerSpec sgd_;
  std::vector<float> grad_;
};

Compression Topk(double ratio, bool error_feedback) {
  Compression c;
  c.gradients = v1::ENCODING_TOPK;
  c.topk_ratio = ratio;
  c.error_feedback = error_feedback;
  return c;
}

TEST_F(CompressedClientTest, ErrorFeedbackAppliesEveryCoordinateOverTime) {
  std::unique_ptr<Client> client = NewClient(Topk(0.25, true));
  constexpr int kSteps = 200;
  std::vector<float> w;
  for (int s = 0; s < kSteps; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &w));
  EXPECT_EQ(w, ShardWeights());
  // What was not applied yet is the residual: less than a few steps' worth
  // of each coordinate, while every one of them moved a lot.
  for (int64_t i = 0; i < kElements; ++i) {
    const float full = 1.0f - kSteps * grad_[i];
    EXPECT_LE(std::fabs(w[i] - full), 5 * 0.016f) << i;
    EXPECT_GT(std::fabs(w[i] - 1.0f), 0.5f * kSteps * std::fabs(grad_[i])) << i;
  }
}

TEST_F(CompressedClientTest, WithoutErrorFeedbackTheDroppedCoordinatesStay) {
  std::unique_ptr<Client> client = NewClient(Topk(0.25, false));
  std::vector<float> w;
  for (int s = 0; s < 10; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &w));
  // Each chunk sends its largest quarter every time; the rest never move.
  int64_t want_moved = 0;
  for (const ChunkSpec& chunk : client->chunks()) {
    want_moved += TopkCount(chunk.num_elements, 0.25);
  }
  int64_t moved = 0;
  for (int64_t i = 0; i < kElements; ++i) {
    if (w[i] != 1.0f) {
      ++moved;
      float want = 1.0f;  // ten exact steps of this coordinate
      for (int s = 0; s < 10; ++s) want -= grad_[i];
      EXPECT_EQ(w[i], want) << i;
    }
  }
  EXPECT_EQ(moved, want_moved);
}

TEST_F(CompressedClientTest, ChunksBelowTheSmallestToCompressGoAsFp32) {
  Compression c = Topk(0.25, false);
  c.min_elements = 14;  // "a"'s first chunk only (chunks of 14, 13, 13, 12, 12)
  std::unique_ptr<Client> client = NewClient(c);
  std::vector<float> w;
  for (int s = 0; s < 4; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &w));
  int64_t moved_in_first = 0;
  for (const ChunkSpec& chunk : client->chunks()) {
    const int64_t base = chunk.tensor == 0 ? chunk.offset : 40 + chunk.offset;
    for (int64_t i = base; i < base + chunk.num_elements; ++i) {
      if (chunk.id == 0) {
        moved_in_first += w[i] != 1.0f;
        continue;
      }
      float want = 1.0f;
      for (int s = 0; s < 4; ++s) want -= grad_[i];
      EXPECT_EQ(w[i], want) << i;  // sent whole every step
    }
  }
  EXPECT_EQ(moved_in_first, TopkCount(14, 0.25));
}

TEST_F(CompressedClientTest, Bf16WeightsAreTheRoundedShardWeights) {
  Compression c;
  c.gradients = v1::ENCODING_INT8;
  c.weights = v1::ENCODING_BF16;
  std::unique_ptr<Client> client = NewClient(c);
  std::vector<float> w;
  for (int s = 0; s < 3; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &w));
  const std::vector<float> exact = ShardWeights();
  std::vector<uint16_t> bf16(kElements);
  EncodeBf16(exact.data(), kElements, bf16.data());
  std::vector<float> rounded(kElements);
  DecodeBf16(bf16.data(), kElements, rounded.data());
  EXPECT_EQ(w, rounded);
  EXPECT_NE(w, exact);  // the shards kept what bf16 cannot hold
}

TEST_F(CompressedClientTest, AGradientTheEncodingCannotCarrySendsNothing) {
  Compression c;
  c.gradients = v1::ENCODING_FP16;
  std::unique_ptr<Client> client = NewClient(c);
  grad_[45] = 1e6f;  // tensor "b", element 5
  std::vector<float> w;
  const absl::Status s = Step(client.get(), 0, &w);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor b"), std::string::npos) << s;
  EXPECT_NE(s.message().find("65504"), std::string::npos) << s;
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      client->ShardStatus();
  SHARDPS_ASSERT_OK(status);
  for (const v1::GetStatusResponse& shard : *status) {
    EXPECT_EQ(shard.updates_total(), 0u);
  }
}

// A compressed tensor goes whole: a part pushed before a value the
// encoding cannot carry sends nothing, and the whole push is refused.
TEST_F(CompressedClientTest, PartsOfACompressedTensorWaitForTheWhole) {
  Compression c;
  c.gradients = v1::ENCODING_FP16;
  std::unique_ptr<Client> client = NewClient(c);
  grad_[30] = 1e6f;  // tensor "a", element 30
  std::vector<float> w(kElements, 0.0f);
  const Tensors weights = {absl::MakeSpan(w).subspan(0, 40),
                           absl::MakeSpan(w).subspan(40)};
  const absl::Span<const float> a = absl::MakeConstSpan(grad_).subspan(0, 40);
  SHARDPS_ASSERT_OK(client->BeginStep(0, weights));
  SHARDPS_ASSERT_OK(client->PushTensorPart(0, a, 24));
  const absl::Status s = client->PushTensor(0, a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("65504"), std::string::npos) << s;
  client->AbortStep();
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      client->ShardStatus();
  SHARDPS_ASSERT_OK(status);
  for (const v1::GetStatusResponse& shard : *status) {
    EXPECT_EQ(shard.bytes_in_total(), 0u);
  }
  // Carried values: parts, then the whole, equal a whole push.
  grad_[30] = 0.5f;
  SHARDPS_ASSERT_OK(client->BeginStep(0, weights));
  SHARDPS_ASSERT_OK(client->PushTensorPart(0, a, 24));
  SHARDPS_ASSERT_OK(client->PushTensor(0, a));
  SHARDPS_ASSERT_OK(
      client->PushTensor(1, absl::MakeConstSpan(grad_).subspan(40)));
  SHARDPS_ASSERT_OK(client->FinishStep());
  client.reset();
  shards_ = std::make_unique<server::TestShards>(2, 1);
  SHARDPS_ASSERT_OK(shards_->status());
  addresses_ = shards_->addresses();
  std::unique_ptr<Client> whole = NewClient(c);
  std::vector<float> want;
  SHARDPS_ASSERT_OK(Step(whole.get(), 0, &want));
  EXPECT_EQ(w, want);
}

TEST_F(CompressedClientTest, AResidualPushedBeyondFp16FailsTheStep) {
  Compression c;
  c.gradients = v1::ENCODING_FP16;
  std::unique_ptr<Client> client = NewClient(c);
  // 65519 rounds down to 65504 and leaves 15 behind; next time the sum is
  // beyond fp16's range, though the gradient itself is not.
  grad_[3] = 65519.0f;
  std::vector<float> w;
  SHARDPS_ASSERT_OK(Step(client.get(), 0, &w));
  const absl::Status s = Step(client.get(), 1, &w);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("tensor a (chunk 0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("65504"), std::string::npos) << s;
}

TEST_F(CompressedClientTest, AStepPushedAgainResendsItsPayload) {
  // The same job twice; in the second, step 3 is pushed again after it was
  // acknowledged (as after a failure elsewhere in the step): the shards
  // ignore the second push, so its residual must stay the first one's.
  const Compression c = Topk(0.25, true);
  std::vector<float> once, twice;
  {
    std::unique_ptr<Client> client = NewClient(c);
    for (int s = 0; s < 8; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &once));
  }
  server::TestShards again(2, 1);
  SHARDPS_ASSERT_OK(again.status());
  addresses_ = again.addresses();
  std::unique_ptr<Client> client = NewClient(c);
  for (int s = 0; s < 8; ++s) {
    SHARDPS_ASSERT_OK(Step(client.get(), s, &twice));
    if (s == 3) SHARDPS_ASSERT_OK(Step(client.get(), s, &twice));
  }
  EXPECT_EQ(twice, once);
}

TEST_F(CompressedClientTest, APushOnlyStepNeedsAPullBeforeSparseWeights) {
  Compression c;
  c.weights = v1::ENCODING_TOPK;
  c.weights_topk_ratio = 0.25;
  std::unique_ptr<Client> client = NewClient(c);
  std::vector<float> w(kElements);
  const Tensors views = {absl::MakeSpan(w).subspan(0, 40),
                         absl::MakeSpan(w).subspan(40)};
  SHARDPS_ASSERT_OK(client->Pull(views));
  SHARDPS_ASSERT_OK(client->Push(0, {absl::MakeConstSpan(grad_).subspan(0, 40),
                                     absl::MakeConstSpan(grad_).subspan(40)}));
  const absl::Status s = Step(client.get(), 1, &w);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("Pull first"), std::string::npos) << s;
  SHARDPS_ASSERT_OK(client->Pull(views));
  SHARDPS_ASSERT_OK(Step(client.get(), 1, &w));
}

TEST_F(CompressedClientTest, ARollbackDropsTheResiduals) {
  std::unique_ptr<Client> client = NewClient(Topk(0.25, true));
  std::vector<float> w0, w1, w2, w3;
  SHARDPS_ASSERT_OK(Step(client.get(), 0, &w0));
  SHARDPS_ASSERT_OK(Step(client.get(), 1, &w1));
  // Step 1 sent other coordinates than step 0 (the residual grew them).
  std::vector<float> d0(kElements), d1(kElements);
  for (int64_t i = 0; i < kElements; ++i) {
    d0[i] = 1.0f - w0[i];
    d1[i] = w0[i] - w1[i];
  }
  EXPECT_NE(d0, d1);
  client->set_rollback_id(1);
  SHARDPS_ASSERT_OK(Step(client.get(), 2, &w2));
  std::vector<float> d2(kElements);
  for (int64_t i = 0; i < kElements; ++i) d2[i] = w1[i] - w2[i];
  // From zero residuals again: the same coordinates as step 0.
  for (int64_t i = 0; i < kElements; ++i) {
    EXPECT_EQ(d2[i] != 0.0f, d0[i] != 0.0f) << i;
  }
}

TEST_F(CompressedClientTest, SparseWeightsAreTheCopyTheShardsMove) {
  Compression c;
  c.weights = v1::ENCODING_TOPK;
  c.weights_topk_ratio = 0.25;
  std::unique_ptr<Client> client = NewClient(c);
  // Replies carry changes to the copy a worker holds: it pulls it first.
  std::vector<float> got(kElements);
  SHARDPS_ASSERT_OK(client->Pull(
      {absl::MakeSpan(got).subspan(0, 40), absl::MakeSpan(got).subspan(40)}));
  // The shards' side, by hand: fp32 weights w (SGD lr 1), and the copy that
  // takes, per chunk, the quarter of elements where it differs most from w
  // (the lower index first among equals).
  std::vector<float> w(kElements, 1.0f), copy(kElements, 1.0f);
  int64_t replies_bytes = 0;
  for (int s = 0; s < 30; ++s) {
    SHARDPS_ASSERT_OK(Step(client.get(), s, &got));
    for (int64_t i = 0; i < kElements; ++i) w[i] -= grad_[i];
    for (const ChunkSpec& chunk : client->chunks()) {
      const int64_t base = chunk.tensor == 0 ? chunk.offset : 40 + chunk.offset;
      std::vector<int64_t> order(chunk.num_elements);
      for (int64_t i = 0; i < chunk.num_elements; ++i) order[i] = base + i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return std::fabs(w[a] - copy[a]) > std::fabs(w[b] - copy[b]);
      });
      const int64_t k = TopkCount(chunk.num_elements, 0.25);
      for (int64_t j = 0; j < k; ++j) copy[order[j]] = w[order[j]];
      replies_bytes += 4 + 8 * k;
    }
    ASSERT_EQ(got, copy) << "step " << s;
  }
  // The copy lags the weights, by at most a few steps of each element.
  EXPECT_NE(copy, w);
  for (int64_t i = 0; i < kElements; ++i) {
    EXPECT_LE(std::fabs(copy[i] - w[i]), 5 * 0.016f) << i;
  }
  // Pull sends the copy whole; the shards sent the sparse replies.
  std::vector<float> pulled(kElements);
  SHARDPS_ASSERT_OK(client->Pull({absl::MakeSpan(pulled).subspan(0, 40),
                                  absl::MakeSpan(pulled).subspan(40)}));
  EXPECT_EQ(pulled, copy);
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status =
      client->ShardStatus();
  SHARDPS_ASSERT_OK(status);
  int64_t sent = 0;
  for (const v1::GetStatusResponse& shard : *status) {
    sent += shard.bytes_out_total();
  }
  // The replies, plus the two Pulls of the copy whole.
  EXPECT_EQ(sent, replies_bytes + 2 * 4 * kElements);
}

TEST_F(CompressedClientTest, SparseWeightsSendChunksBelowTheSmallestWhole) {
  Compression c;
  c.weights = v1::ENCODING_TOPK;
  c.weights_topk_ratio = 0.25;
  c.min_elements = 14;  // only "a"'s first chunk is sparse
  std::unique_ptr<Client> client = NewClient(c);
  std::vector<float> got(kElements);
  SHARDPS_ASSERT_OK(client->Pull(
      {absl::MakeSpan(got).subspan(0, 40), absl::MakeSpan(got).subspan(40)}));
  for (int s = 0; s < 3; ++s) SHARDPS_ASSERT_OK(Step(client.get(), s, &got));
  int64_t lagging = 0;
  for (int64_t i = 0; i < kElements; ++i) {
    float exact = 1.0f;
    for (int s = 0; s < 3; ++s) exact -= grad_[i];
    if (i >= 14) {
      EXPECT_EQ(got[i], exact) << i;  // whole every step
    } else {
      lagging += got[i] != exact;
    }
  }
  EXPECT_GT(lagging, 0);
}

TEST_F(CompressedClientTest, SparseWeightsAreTheModelsAllWorkersDeclare) {
  Compression c;
  c.weights = v1::ENCODING_TOPK;
  c.weights_topk_ratio = 0.25;
  std::unique_ptr<Client> client = NewClient(c);
  // A worker with another ratio declares another model.
  c.weights_topk_ratio = 0.5;
  ClientOptions co;
  co.servers = addresses_;
  co.connect_timeout = absl::Seconds(5);
  co.compression = c;
  absl::StatusOr<std::unique_ptr<Client>> other = Client::Create(co);
  SHARDPS_ASSERT_OK(other);
  EXPECT_EQ((*other)->Declare(layout_, sgd_).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A two-worker sync job on `num_shards` shards, 12 steps of gradients that
// differ by rank and step, SGD with momentum; rank 0's final weights.
std::vector<float> RunJob(uint32_t num_shards, const Compression& c) {
  server::TestShards shards(num_shards, 2);
  EXPECT_TRUE(shards.status().ok()) << shards.status();
  const std::vector<std::string>& addresses = shards.addresses();
  v1::Layout layout;
  layout.set_chunk_bytes(256);
  for (const auto& [name, size] :
       std::vector<std::pair<std::string, int64_t>>{{"a", 300}, {"b", 77}}) {
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name(name);
    t->add_shape(size);
    t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
    t->mutable_init()->set_value(0.1f);
    t->mutable_init()->set_seed(3);
  }
  v1::OptimizerSpec sgd;
  sgd.set_kind(v1::OptimizerSpec::KIND_SGD);
  sgd.set_learning_rate(0.1f);
  sgd.set_momentum(0.9f);
  std::vector<std::vector<float>> weights(2);
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ClientOptions co;
      co.servers = addresses;
      co.rank = r;
      co.connect_timeout = absl::Seconds(30);
      co.compression = c;
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
      ASSERT_TRUE(client.ok()) << client.status();
      SHARDPS_ASSERT_OK((*client)->Declare(layout, sgd));
      std::vector<float>& w = weights[r];
      w.assign(377, 0.0f);
      const Tensors views = {absl::MakeSpan(w).subspan(0, 300),
                             absl::MakeSpan(w).subspan(300)};
      SHARDPS_ASSERT_OK((*client)->Pull(views));
      std::vector<float> g(377);
      for (int64_t step = 0; step < 12; ++step) {
        for (int64_t i = 0; i < 377; ++i) {
          g[i] = w[i] * 0.5f +
                 0.01f * std::sin(static_cast<float>(i * (r + 1) + step));
        }
        SHARDPS_ASSERT_OK(
            (*client)->PushPull(step,
                                {absl::MakeConstSpan(g).subspan(0, 300),
                                 absl::MakeConstSpan(g).subspan(300)},
                                views));
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(weights[0], weights[1]);  // every worker holds the same
  return weights[0];
}

TEST(CompressedJobTest, RunsAreBitwiseRepeatableAndIndependentOfShards) {
  Compression int8;
  int8.gradients = v1::ENCODING_INT8;
  int8.weights = v1::ENCODING_BF16;
  Compression sparse = Topk(0.1, true);
  sparse.weights = v1::ENCODING_TOPK;
  sparse.weights_topk_ratio = 0.2;
  for (const Compression& c : {int8, sparse}) {
    SCOPED_TRACE(CompressionName(c));
    const std::vector<float> two = RunJob(2, c);
    EXPECT_EQ(RunJob(2, c), two);
    EXPECT_EQ(RunJob(1, c), two);
    EXPECT_EQ(RunJob(3, c), two);
    EXPECT_NE(RunJob(2, Compression()), two);  // compression made a change
  }
}

TEST(GradientCompressorTest, TopkWarmupFallsFromDenseToTheRatio) {
  Compression c = Topk(0.01, true);
  c.topk_warmup_steps = 100;
  ChunkSpec chunk;
  chunk.num_elements = 1000;
  GradientCompressor compressor(c, {chunk});
  std::vector<float> g(1000);
  for (int i = 0; i < 1000; ++i) g[i] = std::sin(0.1f * i);
  // The count kept, from the payload's header.
  auto kept = [&](int64_t step) {
    absl::StatusOr<absl::string_view> payload =
        compressor.Encode(0, g.data(), step);
    EXPECT_TRUE(payload.ok()) << payload.status();
    uint32_t k = 0;
    std::memcpy(&k, payload->data(), 4);
    return static_cast<int64_t>(k);
  };
  EXPECT_EQ(kept(0), TopkCount(1000, std::pow(0.01, 1.0 / 100)));  // 955
  EXPECT_EQ(kept(49), TopkCount(1000, 0.1));
  EXPECT_EQ(kept(98), TopkCount(1000, std::pow(0.01, 99.0 / 100)));
  EXPECT_EQ(kept(99), 10);
  EXPECT_EQ(kept(5000), 10);
  EXPECT_GT(kept(0), 900);
}

// A refused Encode changes nothing: a retry of the step before gets its
// payload, and the residual Commit makes current is the one from that step.
TEST(GradientCompressorTest, ARefusedEncodeKeepsTheLastPayloadAndResidual) {
  Compression c;
  c.gradients = v1::ENCODING_BF16;
  c.error_feedback = true;
  ChunkSpec chunk;
  chunk.num_elements = 1000;
  GradientCompressor compressor(c, {chunk});
  std::vector<float> g(1000);
  for (int i = 0; i < 1000; ++i) g[i] = 1.0f + 0x1p-12f * (i % 7);
  absl::StatusOr<absl::string_view> first = compressor.Encode(0, g.data(), 5);
  SHARDPS_ASSERT_OK(first.status());
  const std::string sent(*first);
  compressor.Commit(0);
  // Step 6 encodes from step 5's residual: what bf16 dropped of g.
  std::vector<float> bad = g;
  bad[700] = std::numeric_limits<float>::infinity();
  absl::StatusOr<absl::string_view> refused =
      compressor.Encode(0, bad.data(), 6);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("element 700"),
            absl::string_view::npos);
  compressor.Commit(0);  // nothing was encoded: a no-op
  // Step 5 again: the same bytes.
  absl::StatusOr<absl::string_view> again = compressor.Encode(0, g.data(), 5);
  SHARDPS_ASSERT_OK(again.status());
  EXPECT_EQ(*again, sent);
  // Step 6 with a finite gradient of zeros sends step 5's residual, exactly
  // what bf16 dropped of g, rounded to bf16 itself.
  std::vector<float> zeros(1000, 0.0f);
  absl::StatusOr<absl::string_view> next =
      compressor.Encode(0, zeros.data(), 6);
  SHARDPS_ASSERT_OK(next.status());
  std::vector<float> decoded(1000), want(1000);
  SHARDPS_ASSERT_OK(
      DecodePayload(v1::ENCODING_BF16, sent, 1000, false, decoded.data()));
  for (int i = 0; i < 1000; ++i) want[i] = g[i] - decoded[i];
  std::string expected;
  SHARDPS_ASSERT_OK(EncodePayload(v1::ENCODING_BF16, want.data(), 1000, 1.0,
                                  nullptr, &expected));
  EXPECT_EQ(*next, expected);
  EXPECT_NE(want, zeros);  // the residual was not empty
}

TEST_F(CompressedClientTest, BadCompressionOptionsAreRefused) {
  ClientOptions co;
  co.servers = addresses_;
  co.compression = Topk(0, true);
  EXPECT_EQ(Client::Create(co).status().code(),
            absl::StatusCode::kInvalidArgument);
  co.compression = Compression();
  co.compression.weights = v1::ENCODING_INT8;
  EXPECT_EQ(Client::Create(co).status().code(),
            absl::StatusCode::kInvalidArgument);
  co.compression = Topk(0.1, true);
  co.compression.topk_warmup_steps = -1;
  EXPECT_EQ(Client::Create(co).status().code(),
            absl::StatusCode::kInvalidArgument);
  double ratio = 0;
  EXPECT_EQ(ParseGradientCompression("topk:2", &ratio).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseGradientCompression("zstd", &ratio).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<v1::Encoding> topk =
      ParseGradientCompression("topk:0.01", &ratio);
  SHARDPS_ASSERT_OK(topk);
  EXPECT_EQ(*topk, v1::ENCODING_TOPK);
  EXPECT_EQ(ratio, 0.01);
}

}  // namespace
}  // namespace shardps
