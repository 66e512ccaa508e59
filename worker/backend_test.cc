#include "worker/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "worker/backend_testing.h"
#include "worker/cuda/bias_relu_cpu.h"
#include "worker/cuda/softmax_xent_cpu.h"
#include "worker/model.h"

namespace shardps::worker {
namespace {

using ::shardps::worker::testing::MakeProblem;
using ::shardps::worker::testing::Problem;

// scale * (sum of the rows' cross-entropy), in double: the independent
// reference the backend's float gradients are checked against.
double ReferenceLoss(const Problem& p,
                     const std::vector<std::vector<double>>& w, double scale) {
  const std::vector<int64_t>& sizes = p.spec.layer_sizes();
  const int b = static_cast<int>(p.labels.size());
  double total = 0.0;
  for (int r = 0; r < b; ++r) {
    std::vector<double> a(p.x.begin() + r * sizes[0],
                          p.x.begin() + (r + 1) * sizes[0]);
    for (int l = 0; l + 1 < static_cast<int>(sizes.size()); ++l) {
      std::vector<double> z(sizes[l + 1]);
      for (int64_t o = 0; o < sizes[l + 1]; ++o) {
        z[o] = w[2 * l + 1][o];
        for (int64_t i = 0; i < sizes[l]; ++i) {
          z[o] += w[2 * l][o * sizes[l] + i] * a[i];
        }
        if (l + 2 < static_cast<int>(sizes.size())) z[o] = std::max(z[o], 0.0);
      }
      a = z;
    }
    double sum = 0.0;
    for (const double v : a) sum += std::exp(v);
    total += std::log(sum) - a[p.labels[r]];
  }
  return scale * total;
}

std::vector<std::vector<float>> ZeroGrads(const ModelSpec& spec) {
  std::vector<std::vector<float>> grads;
  for (const ParamSpec& s : spec.Params(0)) {
    grads.emplace_back(s.num_elements(), 0.0f);
  }
  return grads;
}

std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& v) {
  return {v.begin(), v.end()};
}

std::unique_ptr<Backend> ReadyCpuBackend(const Problem& p, int max_batch) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = NewCpuBackend(1);
  EXPECT_TRUE(backend.ok()) << backend.status();
  EXPECT_TRUE((*backend)->Init(p.spec, max_batch).ok());
  EXPECT_TRUE((*backend)->SetParams(p.param_spans()).ok());
  return std::move(*backend);
}

TEST(CpuBackendTest, GradientsMatchFiniteDifferences) {
  for (const std::vector<int64_t>& sizes :
       std::vector<std::vector<int64_t>>{{6, 5, 4, 3}, {7, 4}}) {
    SCOPED_TRACE(ModelSpec(sizes).ToString());
    const int b = 5;
    const Problem p = MakeProblem(sizes, b, /*seed=*/11);
    std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 8);
    std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
    const float scale = 1.0f / b;
    absl::StatusOr<double> mean_loss =
        backend->Gradients(p.x, p.labels, scale, Spans(grads));
    SHARDPS_ASSERT_OK(mean_loss);

    std::vector<std::vector<double>> w;
    for (const std::vector<float>& v : p.params)
      w.emplace_back(v.begin(), v.end());
    EXPECT_NEAR(*mean_loss, ReferenceLoss(p, w, 1.0 / b), 1e-5);
    // Central differences in double; eps 1e-6 keeps truncation error near
    // 1e-12 and is far too small to cross a ReLU kink for these seeds.
    const double eps = 1e-6;
    for (size_t t = 0; t < w.size(); ++t) {
      for (size_t i = 0; i < w[t].size(); ++i) {
        const double saved = w[t][i];
        w[t][i] = saved + eps;
        const double up = ReferenceLoss(p, w, scale);
        w[t][i] = saved - eps;
        const double down = ReferenceLoss(p, w, scale);
        w[t][i] = saved;
        const double want = (up - down) / (2 * eps);
        ASSERT_NEAR(grads[t][i], want, 1e-5 + 1e-4 * std::abs(want))
            << "param " << t << " element " << i;
      }
    }
  }
}

TEST(CpuBackendTest, GradientsScaleLinearlyAndEmptyBatchIsZero) {
  const Problem p = MakeProblem({4, 3, 2}, 3, /*seed=*/5);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 4);
  std::vector<std::vector<float>> one = ZeroGrads(p.spec);
  std::vector<std::vector<float>> two = ZeroGrads(p.spec);
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 1.0f, Spans(one)));
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 2.0f, Spans(two)));
  for (size_t t = 0; t < one.size(); ++t) {
    for (size_t i = 0; i < one[t].size(); ++i) {
      EXPECT_FLOAT_EQ(two[t][i], 2.0f * one[t][i]);
    }
  }
  absl::StatusOr<double> loss = backend->Gradients({}, {}, 1.0f, Spans(two));
  SHARDPS_ASSERT_OK(loss);
  EXPECT_EQ(*loss, 0.0);
  for (const std::vector<float>& g : two) {
    for (const float v : g) EXPECT_EQ(v, 0.0f);
  }
}

TEST(CpuBackendTest, ReportsEachGradientOnceLastLayerFirstWhenFinal) {
  const Problem p = MakeProblem({6, 5, 4, 3}, 5, /*seed=*/7);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 8);
  std::vector<std::vector<float>> want = ZeroGrads(p.spec);
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 0.2f, Spans(want)));
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  std::vector<int> order;
  std::vector<std::vector<float>> seen(grads.size());
  absl::StatusOr<double> loss =
      backend->Gradients(p.x, p.labels, 0.2f, Spans(grads), [&](int param) {
        order.push_back(param);
        seen[param] = grads[param];  // what a push would send now
        return absl::OkStatus();
      });
  SHARDPS_ASSERT_OK(loss);
  // Layer by layer from the last: bias, then weight.
  EXPECT_EQ(order, (std::vector<int>{5, 4, 3, 2, 1, 0}));
  EXPECT_EQ(seen, want);
  EXPECT_EQ(grads, want);
}

// A weight larger than a block (here 1024 inputs x 256 units, 1 MiB) is
// computed 64 rows (256 KiB) at a time: each block is reported final as
// soon as it is, before the weight is, and none of it changes afterwards.
TEST(CpuBackendTest, ReportsALargeWeightInFinalBlocksOfRows) {
  const Problem p = MakeProblem({1024, 256, 3}, 4, /*seed=*/11);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 4);
  std::vector<std::vector<float>> want = ZeroGrads(p.spec);
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 0.25f, Spans(want)));
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  std::vector<std::string> events;
  const Backend::GradientReady ready = [&](int param) {
    events.push_back(absl::StrCat(param));
    return absl::OkStatus();
  };
  std::vector<std::vector<float>> seen_parts;
  absl::StatusOr<double> loss = backend->Gradients(
      p.x, p.labels, 0.25f, Spans(grads), ready,
      [&](int param, int64_t elements) {
        events.push_back(absl::StrCat(param, ":", elements));
        seen_parts.emplace_back(grads[param].begin(),
                                grads[param].begin() + elements);
        return absl::OkStatus();
      });
  SHARDPS_ASSERT_OK(loss);
  // The last layer (768 floats) is one block; the first in four.
  EXPECT_EQ(events, (std::vector<std::string>{"3", "2", "1", "0:65536",
                                              "0:131072", "0:196608", "0"}));
  ASSERT_EQ(seen_parts.size(), 3u);
  for (const std::vector<float>& part : seen_parts) {
    EXPECT_TRUE(std::equal(part.begin(), part.end(), want[0].begin()));
  }
  // Bit for bit what a caller that does not listen gets.
  EXPECT_EQ(grads, want);
  // An error from a part stops there.
  events.clear();
  const absl::Status stopped =
      backend
          ->Gradients(p.x, p.labels, 0.25f, Spans(grads), ready,
                      [&](int param, int64_t elements) {
                        events.push_back(absl::StrCat(param, ":", elements));
                        return absl::UnavailableError("shard down");
                      })
          .status();
  EXPECT_EQ(stopped, absl::UnavailableError("shard down"));
  EXPECT_EQ(events, (std::vector<std::string>{"3", "2", "1", "0:65536"}));
}

// The first layer computed ahead, a block of 64 units at a time (1024
// inputs: 256 KiB of weight rows), gives Gradients the same bits as
// computing it there; what was computed serves one Gradients call.
TEST(CpuBackendTest, AFirstLayerComputedAheadGivesTheSameGradients) {
  const Problem p = MakeProblem({1024, 200, 3}, 4, /*seed=*/5);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 4);
  ASSERT_EQ(backend->first_layer_block(), 64);
  std::vector<std::vector<float>> want = ZeroGrads(p.spec);
  absl::StatusOr<double> want_loss =
      backend->Gradients(p.x, p.labels, 0.25f, Spans(want));
  SHARDPS_ASSERT_OK(want_loss);
  const std::vector<float>& w = p.params[0];
  const std::vector<float>& bias = p.params[1];
  auto ahead = [&](const std::vector<std::pair<int, int>>& blocks) {
    for (const auto& [begin, end] : blocks) {
      SHARDPS_ASSERT_OK(backend->ForwardFirstLayer(p.x, begin, end, w, bias));
    }
  };
  // Out of order is fine; the last block is short (200 = 3 x 64 + 8).
  ahead({{128, 192}, {0, 64}, {192, 200}, {64, 128}});
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  absl::StatusOr<double> loss =
      backend->Gradients(p.x, p.labels, 0.25f, Spans(grads), nullptr, nullptr,
                         /*first_layer_ahead=*/true);
  SHARDPS_ASSERT_OK(loss);
  EXPECT_EQ(*loss, *want_loss);
  EXPECT_EQ(grads, want);
  // Used up; and a missing block, or an Evaluate in between, is refused.
  const auto refused = [&] {
    return backend
        ->Gradients(p.x, p.labels, 0.25f, Spans(grads), nullptr, nullptr, true)
        .status();
  };
  EXPECT_TRUE(absl::IsFailedPrecondition(refused()));
  ahead({{0, 64}, {64, 128}, {192, 200}});
  EXPECT_TRUE(absl::IsFailedPrecondition(refused()));
  ahead({{0, 64}, {64, 128}, {128, 192}, {192, 200}});
  SHARDPS_ASSERT_OK(backend->Evaluate(p.x, p.labels));
  EXPECT_TRUE(absl::IsFailedPrecondition(refused()));
  // Blocks that are not blocks, and wrong sizes.
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend->ForwardFirstLayer(p.x, 32, 96, w, bias)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend->ForwardFirstLayer(p.x, 192, 256, w, bias)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend->ForwardFirstLayer(p.x, 0, 64, bias, bias)));
  EXPECT_TRUE(absl::IsInvalidArgument(backend->ForwardFirstLayer(
      absl::MakeConstSpan(p.x).subspan(1), 0, 64, w, bias)));
}

// A step whose first layer was computed ahead does not read the backend's
// copy of that layer: SetParams may leave it out (here zeros stand for
// stale weights), and the gradients are the same bits. Until the layer is
// set again, nothing else that would read it runs.
TEST(CpuBackendTest, SetParamsMayLeaveOutAFirstLayerComputedAhead) {
  const Problem p = MakeProblem({1024, 200, 3}, 4, /*seed=*/9);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 4);
  std::vector<std::vector<float>> want = ZeroGrads(p.spec);
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 0.25f, Spans(want)));
  const std::vector<float> zeros_w(p.params[0].size(), 0.0f);
  const std::vector<float> zeros_b(p.params[1].size(), 0.0f);
  std::vector<absl::Span<const float>> stale = p.param_spans();
  stale[0] = zeros_w;
  stale[1] = zeros_b;
  SHARDPS_ASSERT_OK(backend->SetParams(stale));  // the copy is now zeros
  std::vector<absl::Span<const float>> params = p.param_spans();
  SHARDPS_ASSERT_OK(backend->SetParams(params, /*first_layer=*/false));
  for (int u = 0; u < 200; u += 64) {
    SHARDPS_ASSERT_OK(backend->ForwardFirstLayer(p.x, u, std::min(u + 64, 200),
                                                 p.params[0], p.params[1]));
  }
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 0.25f, Spans(grads),
                                       nullptr, nullptr,
                                       /*first_layer_ahead=*/true));
  EXPECT_EQ(grads, want);
  // Not ahead, or Evaluate: refused until SetParams gives the layer.
  EXPECT_TRUE(absl::IsFailedPrecondition(
      backend->Gradients(p.x, p.labels, 0.25f, Spans(grads)).status()));
  EXPECT_TRUE(
      absl::IsFailedPrecondition(backend->Evaluate(p.x, p.labels).status()));
  // Sizes are checked all the same.
  std::vector<absl::Span<const float>> short_first = params;
  short_first[0] = short_first[0].subspan(1);
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend->SetParams(short_first, /*first_layer=*/false)));
  SHARDPS_ASSERT_OK(backend->SetParams(params));
  SHARDPS_ASSERT_OK(backend->Gradients(p.x, p.labels, 0.25f, Spans(grads)));
  EXPECT_EQ(grads, want);
}

// A backend that computes its first layer in the step (first_layer_block()
// 0, as the CUDA one) always reads it: SetParams may not leave it out.
class InStepBackend final : public Backend {
 public:
  std::string name() const override { return "in-step"; }
  int sets() const { return sets_; }

 protected:
  absl::Status DoInit(const ModelSpec&, int) override {
    return absl::OkStatus();
  }
  absl::Status DoSetParams(absl::Span<const absl::Span<const float>>,
                           bool) override {
    ++sets_;
    return absl::OkStatus();
  }
  absl::StatusOr<double> DoGradients(const float*, const int32_t*, int, float,
                                     absl::Span<const absl::Span<float>>,
                                     const GradientReady&,
                                     const GradientPartReady&, bool) override {
    return 0.0;
  }
  absl::StatusOr<EvalResult> DoEvaluate(const float*, const int32_t*,
                                        int) override {
    return EvalResult{};
  }

 private:
  int sets_ = 0;
};

TEST(BackendTest, ABackendWithoutAFirstLayerAheadTakesEveryParameter) {
  const Problem p = MakeProblem({6, 5, 3}, 2, /*seed=*/3);
  InStepBackend backend;
  EXPECT_TRUE(absl::IsFailedPrecondition(
      backend.SetParams(p.param_spans(), /*first_layer=*/false)));
  SHARDPS_ASSERT_OK(backend.Init(p.spec, 2));
  EXPECT_TRUE(absl::IsFailedPrecondition(
      backend.SetParams(p.param_spans(), /*first_layer=*/false)));
  EXPECT_EQ(backend.sets(), 0);
  SHARDPS_ASSERT_OK(backend.SetParams(p.param_spans()));
  EXPECT_EQ(backend.sets(), 1);
}

TEST(CpuBackendTest, AnErrorFromReadyStopsTheComputation) {
  const Problem p = MakeProblem({6, 5, 4, 3}, 5, /*seed=*/7);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 8);
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  std::vector<int> order;
  const absl::Status s =
      backend
          ->Gradients(p.x, p.labels, 0.2f, Spans(grads),
                      [&](int param) {
                        order.push_back(param);
                        return param == 4 ? absl::UnavailableError("shard down")
                                          : absl::OkStatus();
                      })
          .status();
  EXPECT_EQ(s, absl::UnavailableError("shard down"));
  EXPECT_EQ(order, (std::vector<int>{5, 4}));
  // An empty batch reports every (zero) gradient too.
  order.clear();
  SHARDPS_ASSERT_OK(
      backend->Gradients({}, {}, 1.0f, Spans(grads), [&](int param) {
        order.push_back(param);
        return absl::OkStatus();
      }));
  EXPECT_EQ(order, (std::vector<int>{5, 4, 3, 2, 1, 0}));
}

TEST(CpuBackendTest, SgdStepLowersTheLoss) {
  Problem p = MakeProblem({6, 8, 3}, 16, /*seed=*/3);
  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 16);
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  absl::StatusOr<double> before =
      backend->Gradients(p.x, p.labels, 1.0f / 16, Spans(grads));
  SHARDPS_ASSERT_OK(before);
  for (size_t t = 0; t < grads.size(); ++t) {
    for (size_t i = 0; i < grads[t].size(); ++i) {
      p.params[t][i] -= 0.1f * grads[t][i];
    }
  }
  SHARDPS_ASSERT_OK(backend->SetParams(p.param_spans()));
  absl::StatusOr<EvalResult> after = backend->Evaluate(p.x, p.labels);
  SHARDPS_ASSERT_OK(after);
  EXPECT_LT(after->mean_loss, *before);
}

TEST(CpuBackendTest, EvaluateCountsCorrectRowsAcrossChunks) {
  // Identity weights: row r's logits are its one-hot input, so the argmax is
  // the hot position. Rows 0, 1, 3 are labelled with it; rows 2, 4 are not.
  const ModelSpec spec({3, 3});
  const std::vector<float> w = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  const std::vector<float> bias = {0, 0, 0};
  const std::vector<float> x = {1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0};
  const std::vector<int32_t> labels = {0, 1, 0, 2, 1};
  const double hit = std::log(std::exp(1.0) + 2.0) - 1.0;
  const double miss = std::log(std::exp(1.0) + 2.0);
  for (const int max_batch : {5, 2, 1}) {
    SCOPED_TRACE(max_batch);
    absl::StatusOr<std::unique_ptr<Backend>> backend = NewCpuBackend(1);
    SHARDPS_ASSERT_OK(backend);
    SHARDPS_ASSERT_OK((*backend)->Init(spec, max_batch));
    SHARDPS_ASSERT_OK((*backend)->SetParams({w, bias}));
    absl::StatusOr<EvalResult> r = (*backend)->Evaluate(x, labels);
    SHARDPS_ASSERT_OK(r);
    EXPECT_EQ(r->correct, 3);
    EXPECT_NEAR(r->mean_loss, (3 * hit + 2 * miss) / 5, 1e-6);
  }
}

TEST(CpuBackendTest, RejectsBadCallsWithoutChangingState) {
  const Problem p = MakeProblem({4, 3}, 2, /*seed=*/9);
  absl::StatusOr<std::unique_ptr<Backend>> fresh = NewCpuBackend(1);
  SHARDPS_ASSERT_OK(fresh);
  EXPECT_EQ((*fresh)->name(), "cpu");
  EXPECT_EQ((*fresh)->SetParams(p.param_spans()).code(),
            absl::StatusCode::kFailedPrecondition);
  SHARDPS_ASSERT_OK((*fresh)->Init(p.spec, 2));
  EXPECT_EQ((*fresh)->Evaluate(p.x, p.labels).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NewCpuBackend(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*fresh)->Init(p.spec, 0).code(),
            absl::StatusCode::kInvalidArgument);

  std::unique_ptr<Backend> backend = ReadyCpuBackend(p, 2);
  std::vector<std::vector<float>> grads = ZeroGrads(p.spec);
  const std::vector<int32_t> bad_label = {0, 3};
  const std::vector<float> long_x(3 * 4, 0.0f);
  const std::vector<int32_t> three = {0, 1, 2};
  const std::vector<float> short_bias = {0, 0};
  struct Case {
    std::string name;
    absl::Status status;
  };
  const std::vector<Case> cases = {
      {"label", backend->Gradients(p.x, bad_label, 1, Spans(grads)).status()},
      {"x_size",
       backend->Gradients(long_x, p.labels, 1, Spans(grads)).status()},
      {"batch", backend->Gradients(long_x, three, 1, Spans(grads)).status()},
      {"scale", backend->Gradients(p.x, p.labels, NAN, Spans(grads)).status()},
      {"grads", backend->Gradients(p.x, p.labels, 1, {}).status()},
      {"eval_label", backend->Evaluate(p.x, bad_label).status()},
      {"param_size", backend->SetParams({p.params[0], short_bias})},
      {"param_count", backend->SetParams({p.params[0]})},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
  }
  SHARDPS_EXPECT_OK(backend->Gradients(p.x, p.labels, 1, Spans(grads)));
}

TEST(CpuBackendTest, NoCudaDeviceOrBuildIsAnErrorNotACrash) {
  absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend(0);
  if (cuda.ok()) GTEST_SKIP() << "a GPU is present: " << (*cuda)->name();
  EXPECT_TRUE(cuda.status().code() == absl::StatusCode::kUnimplemented ||
              cuda.status().code() == absl::StatusCode::kFailedPrecondition)
      << cuda.status();
}

TEST(SoftmaxXentCpuTest, MatchesHandComputedValues) {
  // Row 0: logits (0, 0), label 0: loss ln 2, softmax (1/2, 1/2).
  // Row 1: logits (1, 3), label 1: loss log(1 + e^-2).
  // Row 2: logits (1000, 0), label 1: loss 1000, without overflow.
  const std::vector<float> logits = {0, 0, 1, 3, 1000, 0};
  const std::vector<int32_t> labels = {0, 1, 1};
  std::vector<float> dlogits(6), loss(3);
  std::vector<int32_t> correct(3);
  SoftmaxXentCpu(logits.data(), labels.data(), 3, 2, 0.5f, dlogits.data(),
                 loss.data(), correct.data());
  const double p1 = 1.0 / (1.0 + std::exp(2.0));  // softmax(1, 3)_0
  EXPECT_NEAR(loss[0], std::log(2.0), 1e-6);
  EXPECT_NEAR(loss[1], std::log(1.0 + std::exp(-2.0)), 1e-6);
  EXPECT_NEAR(loss[2], 1000.0, 1e-3);
  EXPECT_EQ(correct, (std::vector<int32_t>{1, 1, 0}));  // ties: lowest index
  const std::vector<double> want = {0.5 * (0.5 - 1), 0.5 * 0.5,
                                    0.5 * p1,        0.5 * (1 - p1 - 1),
                                    0.5 * 1.0,       0.5 * (0.0 - 1)};
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(dlogits[i], want[i], 1e-6) << i;
}

TEST(SoftmaxXentCpuTest, ThreeClassLossAndInPlaceGradient) {
  std::vector<float> z = {1, 2, 3};
  const int32_t label = 2;
  float loss = 0;
  int32_t correct = 0;
  SoftmaxXentCpu(z.data(), &label, 1, 3, 1.0f, z.data(), &loss, &correct);
  EXPECT_NEAR(loss, 0.40760596, 1e-6);  // log(e + e^2 + e^3) - 3
  EXPECT_EQ(correct, 1);
  EXPECT_NEAR(z[0], 0.09003057, 1e-6);
  EXPECT_NEAR(z[1], 0.24472847, 1e-6);
  EXPECT_NEAR(z[2], 0.66524096 - 1, 1e-6);
}

TEST(BiasReluCpuTest, MatchesHandComputedValues) {
  std::vector<float> y = {1, -2, 3, -4, 0.5f, -0.5f};
  const std::vector<float> bias = {1, 1, -1};
  BiasActivationCpu(y.data(), bias.data(), 2, 3, /*relu=*/true);
  EXPECT_EQ(y, (std::vector<float>{2, 0, 2, 0, 1.5f, 0}));
  std::vector<float> linear = {1, -2, 3};
  BiasActivationCpu(linear.data(), bias.data(), 1, 3, /*relu=*/false);
  EXPECT_EQ(linear, (std::vector<float>{2, -1, 2}));

  std::vector<float> dy = {1, 2, 3, 4, 5, 6};
  ReluBackwardCpu(dy.data(), y.data(), 6);
  EXPECT_EQ(dy, (std::vector<float>{1, 0, 3, 0, 5, 0}));

  std::vector<float> db(3, 99.0f);
  const std::vector<float> g = {1, 2, 3, 10, 20, 30};
  BiasGradCpu(g.data(), 2, 3, db.data());
  EXPECT_EQ(db, (std::vector<float>{11, 22, 33}));
}

}  // namespace
}  // namespace shardps::worker
