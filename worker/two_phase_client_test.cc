// Two-phase steps (StepOptions::second_phase) against in-process shards:
// global-norm clipping as torch's clip_grad_norm_ computes it, the same
// weights on any number of shards, loss-scale skips on every shard, and the
// refusals. Each test runs over shared memory (message rings) and over gRPC.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "server/shard_server_testing.h"
#include "worker/client.h"

namespace shardps {
namespace {

// For the fixture's constructor, where gtest cannot ASSERT.
void CheckOk(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "two_phase_client_test: %s\n", s.ToString().c_str());
    std::abort();
  }
}

using Grads = std::vector<std::vector<float>>;  // by tensor

// A three-tensor model in 16-float chunks over `num_shards` shards, trained
// by `num_ranks` clients of a static job.
class TwoPhase {
 public:
  TwoPhase(uint32_t num_shards, uint32_t num_ranks, bool shared_memory,
           v1::OptimizerSpec optimizer, bool speculative_weights = true)
      : shards_(num_shards, num_ranks) {
    CheckOk(shards_.status());
    layout_.set_chunk_bytes(64);
    for (const auto& [name, size] :
         std::vector<std::pair<std::string, int64_t>>{
             {"embed", 70}, {"fc.weight", 33}, {"fc.bias", 5}}) {
      v1::TensorSpec* t = layout_.add_tensors();
      t->set_name(name);
      t->add_shape(size);
      t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
      t->mutable_init()->set_value(0.5f);
      t->mutable_init()->set_seed(11);
    }
    for (uint32_t r = 0; r < num_ranks; ++r) {
      ClientOptions co;
      co.servers = shards_.addresses();
      co.rank = r;
      co.shared_memory = shared_memory;
      co.speculative_weights = speculative_weights;
      co.connect_timeout = absl::Seconds(30);
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(co);
      CheckOk(client.status());
      CheckOk((*client)->Declare(layout_, optimizer));
      clients_.push_back(*std::move(client));
      weights_.emplace_back();
      for (const auto& t : layout_.tensors()) {
        weights_.back().emplace_back(t.shape(0), 0.0f);
      }
      CheckOk(clients_.back()->Pull(Views(r)));
    }
  }

  Tensors Views(uint32_t r) {
    Tensors v;
    for (auto& w : weights_[r]) v.emplace_back(absl::MakeSpan(w));
    return v;
  }

  // One step of every rank at once (`grads` by rank), each asking the norm
  // first; returns each rank's status, and its norm in *norms.
  std::vector<absl::Status> Step(int64_t step, const std::vector<Grads>& grads,
                                 const StepOptions& options,
                                 std::vector<double>* norms = nullptr) {
    const size_t n = clients_.size();
    std::vector<absl::Status> status(n);
    std::vector<double> got(n, 0);
    std::vector<std::thread> threads;
    for (size_t r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Client& c = *clients_[r];
        absl::Status s = c.BeginStep(step, Views(r), options);
        for (int t = 0; s.ok() && t < 3; ++t) {
          s = c.PushTensor(t, grads[r][t]);
        }
        if (s.ok() && options.second_phase) {
          absl::StatusOr<double> norm = c.GradNorm();
          s = norm.status();
          if (s.ok()) got[r] = *norm;
        }
        if (s.ok()) s = c.FinishStep();
        status[r] = s;
      });
    }
    for (auto& t : threads) t.join();
    if (norms != nullptr) *norms = got;
    return status;
  }

  Client& client(uint32_t r) { return *clients_[r]; }
  const Grads& weights(uint32_t r) const { return weights_[r]; }

 private:
  server::TestShards shards_;
  v1::Layout layout_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<Grads> weights_;  // by rank, by tensor
};

// Gradients of rank `r` at `step`, of norm around 1 to 3 per rank.
Grads GradsOf(uint32_t r, int64_t step) {
  Grads g;
  for (int64_t size : {70, 33, 5}) {
    g.emplace_back(size);
    for (int64_t i = 0; i < size; ++i) {
      g.back()[i] = 0.05f * std::sin(0.37f * (i + 1) * (r + 1) + step) +
                    0.01f * static_cast<float>(r);
    }
  }
  return g;
}

v1::OptimizerSpec Sgd() {
  v1::OptimizerSpec o;
  o.set_kind(v1::OptimizerSpec::KIND_SGD);
  o.set_learning_rate(0.5f);
  return o;
}

v1::OptimizerSpec Adam() {
  v1::OptimizerSpec o;
  o.set_kind(v1::OptimizerSpec::KIND_ADAM);
  o.set_learning_rate(0.01f);
  return o;
}

void ExpectAllOk(const std::vector<absl::Status>& status) {
  for (size_t r = 0; r < status.size(); ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  }
}

class TwoPhaseTest : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(Transport, TwoPhaseTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "SharedMemory" : "Grpc";
                         });

// SGD with clipping: the weights are w - lr * (mean * coef) with the norm
// and coefficient computed as torch computes them, bitwise; every rank
// reads the same norm.
TEST_P(TwoPhaseTest, ClipsByTheGlobalNormOfTheAveragedGradient) {
  TwoPhase job(2, 2, GetParam(), Sgd());
  Grads w = job.weights(0);
  StepOptions options;
  options.second_phase = true;
  options.max_grad_norm = 0.1f;
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<Grads> grads = {GradsOf(0, step), GradsOf(1, step)};
    // The reference: the mean as the shards take it, its norm in double.
    Grads mean = grads[0];
    double squares = 0;
    for (size_t t = 0; t < mean.size(); ++t) {
      for (size_t i = 0; i < mean[t].size(); ++i) {
        mean[t][i] = (grads[0][t][i] + grads[1][t][i]) * 0.5f;
        squares += double{mean[t][i]} * mean[t][i];
      }
    }
    const double norm = std::sqrt(squares);
    const StepDecision decision = DecideStep(norm, options.max_grad_norm);
    ASSERT_LT(decision.clip_coefficient, 1.0f) << "clipping must be active";
    std::vector<double> norms;
    ExpectAllOk(job.Step(step, grads, options, &norms));
    EXPECT_NEAR(norms[0], norm, 1e-12 * norm);
    EXPECT_EQ(norms[0], norms[1]);
    EXPECT_EQ(job.client(0).last_grad_norm(), norms[0]);
    EXPECT_FALSE(job.client(0).last_step_skipped());
    for (size_t t = 0; t < w.size(); ++t) {
      for (size_t i = 0; i < w[t].size(); ++i) {
        w[t][i] -= 0.5f * (mean[t][i] * decision.clip_coefficient);
      }
    }
    ASSERT_EQ(job.weights(0), w) << "step " << step;
    ASSERT_EQ(job.weights(1), w) << "step " << step;
  }
}

// The norm and the weights do not depend on how many shards hold the
// chunks: per-chunk sums of squares added in chunk order.
TEST_P(TwoPhaseTest, OneAndThreeShardsGiveTheSameWeightsBitwise) {
  StepOptions options;
  options.second_phase = true;
  options.max_grad_norm = 0.2f;
  std::vector<Grads> final_weights;
  std::vector<std::vector<double>> all_norms;
  for (uint32_t shards : {1u, 3u}) {
    TwoPhase job(shards, 2, GetParam(), Adam());
    std::vector<double> norms;
    for (int64_t step = 0; step < 5; ++step) {
      std::vector<double> n;
      ExpectAllOk(
          job.Step(step, {GradsOf(0, step), GradsOf(1, step)}, options, &n));
      norms.push_back(n[0]);
    }
    final_weights.push_back(job.weights(0));
    all_norms.push_back(norms);
  }
  EXPECT_EQ(all_norms[0], all_norms[1]);
  EXPECT_EQ(final_weights[0], final_weights[1]);
}

// Speculative weights (ClientOptions::speculative_weights) change nothing:
// with Adam, through steps that clip and steps that do not, the weights
// equal a run without them at every step, bitwise. The shards keep the
// speculation of every step that does not clip and recompute it where a
// step clips; after two clips in a row the client does not ask until a
// step that does not clip. Through shared memory it never asks.
TEST_P(TwoPhaseTest, SpeculativeWeightsAreKeptWhenAStepDoesNotClip) {
  TwoPhase speculating(2, 2, GetParam(), Adam());
  TwoPhase plain(2, 2, GetParam(), Adam(), /*speculative_weights=*/false);
  // GradsOf's norm is about 0.15: bounds above it do not clip.
  const float bounds[] = {10, 10, 0.01f, 0.01f, 10, 10, 0.01f};
  for (int64_t step = 0; step < 7; ++step) {
    StepOptions options;
    options.second_phase = true;
    options.max_grad_norm = bounds[step];
    const std::vector<Grads> grads = {GradsOf(0, step), GradsOf(1, step)};
    std::vector<double> a, b;
    ExpectAllOk(speculating.Step(step, grads, options, &a));
    ExpectAllOk(plain.Step(step, grads, options, &b));
    EXPECT_EQ(a, b) << "step " << step;
    EXPECT_EQ(DecideStep(a[0], bounds[step]).clip_coefficient == 1.0f,
              bounds[step] == 10)
        << "step " << step << ": norm " << a[0];
    ASSERT_EQ(speculating.weights(0), plain.weights(0)) << "step " << step;
    ASSERT_EQ(speculating.weights(1), plain.weights(0)) << "step " << step;
  }
  // Asked at steps 0 to 3 (3 follows one clip), 5 and 6, not at 4 (after
  // two clips): kept at 0, 1, 5; recomputed at 2, 3 and 6. Every chunk
  // counts once per step.
  struct Counts {
    uint64_t kept = 0, recomputed = 0, bytes_out = 0;
    uint32_t chunks = 0;
  };
  auto counts = [](Client& c) {
    absl::StatusOr<std::vector<v1::GetStatusResponse>> st = c.ShardStatus();
    EXPECT_TRUE(st.ok()) << st.status();
    Counts n;
    for (const v1::GetStatusResponse& s : *st) {
      n.kept += s.speculative_updates_kept_total();
      n.recomputed += s.speculative_updates_recomputed_total();
      n.bytes_out += s.bytes_out_total();
      n.chunks += s.num_chunks();
    }
    return n;
  };
  const Counts spec = counts(speculating.client(0));
  const Counts none = counts(plain.client(0));
  EXPECT_EQ(none.kept, 0u);
  EXPECT_EQ(none.recomputed, 0u);
  if (GetParam()) {
    EXPECT_EQ(spec.kept, 0u);
    EXPECT_EQ(spec.recomputed, 0u);
    EXPECT_EQ(spec.bytes_out, none.bytes_out);
    return;
  }
  EXPECT_EQ(spec.kept, 3u * spec.chunks);
  EXPECT_EQ(spec.recomputed, 3u * spec.chunks);
  // The weights crossed once a rank and step, as without speculation, but
  // twice at the three steps recomputed: a decision behind the first one
  // that holds the kept weights gets none again.
  constexpr uint64_t kModelBytes = (70 + 33 + 5) * 4;
  EXPECT_EQ(spec.bytes_out, none.bytes_out + 3 * 2 * kModelBytes);
}

// Under loss scaling an inf in one rank's gradient skips the step on every
// shard, for every rank, with Adam's step count left behind: the run equals
// one without that step, bitwise. Without loss scaling it is bad input.
TEST_P(TwoPhaseTest, ANonFiniteScaledStepIsSkippedOnEveryShard) {
  const float scale = 1024.0f;
  auto scaled = [&](uint32_t r, int64_t step) {
    Grads g = GradsOf(r, step);
    for (auto& t : g) {
      for (float& v : t) v *= scale;
    }
    return g;
  };
  StepOptions options;
  options.second_phase = true;
  options.loss_scale = scale;
  options.max_grad_norm = 0.5f;
  TwoPhase skipped(2, 2, GetParam(), Adam());
  ExpectAllOk(skipped.Step(0, {scaled(0, 0), scaled(1, 0)}, options));
  const Grads before = skipped.weights(0);
  std::vector<Grads> overflow = {scaled(0, 1), scaled(1, 1)};
  overflow[1][1][3] = INFINITY;  // one element of one rank
  std::vector<double> norms;
  ExpectAllOk(skipped.Step(1, overflow, options, &norms));
  EXPECT_TRUE(std::isinf(norms[0]) && std::isinf(norms[1]));
  EXPECT_TRUE(skipped.client(0).last_step_skipped());
  EXPECT_TRUE(skipped.client(1).last_step_skipped());
  EXPECT_EQ(skipped.weights(0), before);
  EXPECT_EQ(skipped.weights(1), before);
  ExpectAllOk(skipped.Step(2, {scaled(0, 2), scaled(1, 2)}, options));
  EXPECT_FALSE(skipped.client(0).last_step_skipped());

  TwoPhase plain(2, 2, GetParam(), Adam());
  ExpectAllOk(plain.Step(0, {scaled(0, 0), scaled(1, 0)}, options));
  ExpectAllOk(plain.Step(1, {scaled(0, 2), scaled(1, 2)}, options));
  EXPECT_EQ(skipped.weights(0), plain.weights(0));

  // The same inf in a one-phase step: refused, nothing applied; pushed
  // again finite, the step completes for both ranks.
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Client& client = plain.client(r);
      auto run = [&](bool with_inf) {
        Grads g = GradsOf(r, 3);
        if (with_inf) g[0][0] = INFINITY;
        absl::Status s = client.BeginStep(2, plain.Views(r));
        for (int t = 0; s.ok() && t < 3; ++t) s = client.PushTensor(t, g[t]);
        return s.ok() ? client.FinishStep() : s;
      };
      if (r == 1) {
        status[1] = run(false);
        return;
      }
      status[0] = run(true);
      if (status[0].code() == absl::StatusCode::kInvalidArgument) {
        status[0] = run(false);
      } else {
        status[0] = absl::InternalError(
            absl::StrCat("the inf was not refused: ", status[0].ToString()));
      }
    });
  }
  for (auto& t : threads) t.join();
  SHARDPS_EXPECT_OK(status[0]);
  SHARDPS_EXPECT_OK(status[1]);
}

TEST_P(TwoPhaseTest, BadOptionsAndDisagreementsAreRefused) {
  TwoPhase job(2, 2, GetParam(), Sgd());
  Client& c = job.client(0);
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    StepOptions o;
    o.second_phase = true;
    o.loss_scale = bad;
    EXPECT_EQ(c.BeginStep(0, job.Views(0), o).code(),
              absl::StatusCode::kInvalidArgument);
    o.loss_scale.reset();
    o.max_grad_norm = bad;
    EXPECT_EQ(c.BeginStep(0, job.Views(0), o).code(),
              absl::StatusCode::kInvalidArgument);
  }
  StepOptions no_phase;
  no_phase.max_grad_norm = 1.0f;
  EXPECT_EQ(c.BeginStep(0, job.Views(0), no_phase).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.GradNorm().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.SetMaxGradNorm(1.0f).code(),
            absl::StatusCode::kFailedPrecondition);
  // Nothing was sent: a clean step goes through.
  StepOptions clip;
  clip.second_phase = true;
  clip.max_grad_norm = 0.1f;
  ExpectAllOk(job.Step(0, {GradsOf(0, 0), GradsOf(1, 0)}, clip));

  // Ranks clipping with different bounds: the later decision is refused.
  const std::vector<Grads> grads = {GradsOf(0, 1), GradsOf(1, 1)};
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Client& client = job.client(r);
      StepOptions o = clip;
      absl::Status s = client.BeginStep(1, job.Views(r), o);
      for (int t = 0; s.ok() && t < 3; ++t) {
        s = client.PushTensor(t, grads[r][t]);
      }
      if (s.ok()) s = client.GradNorm().status();
      // After every chunk's sum is in: rank 1 decides later, differently.
      if (s.ok() && r == 1) {
        absl::SleepFor(absl::Milliseconds(300));
        s = client.SetMaxGradNorm(0.01f);
      }
      if (s.ok()) s = client.FinishStep();
      status[r] = s;
    });
  }
  for (auto& t : threads) t.join();
  SHARDPS_EXPECT_OK(status[0]);
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument) << status[1];
  EXPECT_NE(status[1].message().find("max_grad_norm"), std::string::npos)
      << status[1];

  // A step rank 0 pushes as two-phase and rank 1 then as one-phase: rank
  // 1 is refused and changes nothing; pushed again as two-phase, the step
  // completes for both.
  threads.clear();
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Client& client = job.client(r);
      auto run = [&](bool second_phase) {
        StepOptions o;
        o.second_phase = second_phase;
        // Read by the client until FinishStep returns.
        const Grads g = GradsOf(r, 2);
        absl::Status s = client.BeginStep(2, job.Views(r), o);
        for (int t = 0; s.ok() && t < 3; ++t) s = client.PushTensor(t, g[t]);
        return s.ok() ? client.FinishStep() : s;
      };
      if (r == 0) {
        status[0] = run(true);
        return;
      }
      absl::SleepFor(absl::Milliseconds(300));  // after rank 0's pushes
      status[1] = run(false);
      if (status[1].code() == absl::StatusCode::kInvalidArgument) {
        status[1] = run(true);
      } else {
        status[1] = absl::InternalError(absl::StrCat(
            "the one-phase push was not refused: ", status[1].ToString()));
      }
    });
  }
  for (auto& t : threads) t.join();
  SHARDPS_EXPECT_OK(status[0]);
  SHARDPS_EXPECT_OK(status[1]);
  EXPECT_EQ(job.weights(0), job.weights(1));
}

}  // namespace
}  // namespace shardps
