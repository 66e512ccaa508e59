// The CUDA backend against the CPU reference: gradients, losses, accuracy and
// a training step on the same seeded problems. Label gpu: skips with the
// reason where no GPU is usable (or the build has no CUDA).
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "worker/backend.h"
#include "worker/backend_testing.h"
#include "worker/model.h"

namespace shardps::worker {
namespace {

using ::shardps::worker::testing::MakeProblem;
using ::shardps::worker::testing::Problem;
using ::shardps::worker::testing::ProblemScales;

// Parameters at roughly their initial scale, inputs in [0, 1) like pixels.
constexpr ProblemScales kPixels{/*param=*/0.1f, /*by_init=*/true, /*x=*/0.5f,
                                /*x_center=*/0.5f};

std::vector<absl::Span<const float>> ConstSpans(
    const std::vector<std::vector<float>>& v) {
  return {v.begin(), v.end()};
}
std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& v) {
  return {v.begin(), v.end()};
}

// Relative error <= 1e-4, measured against the tensor's largest magnitude:
// elements that cancel to near zero carry the rounding error of their larger
// terms, whose summation order differs between cuBLAS and OpenBLAS.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float largest = 0.0f;
  for (const float v : want) largest = std::max(largest, std::abs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-4f * largest + 1e-7f)
        << what << "[" << i << "]";
  }
}

// Both backends, initialised for `p` and loaded with its parameters.
struct Pair {
  std::unique_ptr<Backend> cpu;
  std::unique_ptr<Backend> cuda;
};

absl::StatusOr<Pair> MakePair(const Problem& p, int max_batch) {
  Pair pair;
  absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend(0);
  if (!cuda.ok()) return cuda.status();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = NewCpuBackend(1);
  if (!cpu.ok()) return cpu.status();
  pair.cpu = std::move(*cpu);
  pair.cuda = std::move(*cuda);
  for (Backend* b : {pair.cpu.get(), pair.cuda.get()}) {
    if (absl::Status s = b->Init(p.spec, max_batch); !s.ok()) return s;
    if (absl::Status s = b->SetParams(ConstSpans(p.params)); !s.ok()) return s;
  }
  return pair;
}

#define MAKE_PAIR_OR_SKIP(pair, problem, max_batch)                         \
  absl::StatusOr<Pair> pair##_or = MakePair(problem, max_batch);            \
  if (pair##_or.status().code() == absl::StatusCode::kUnimplemented ||      \
      pair##_or.status().code() == absl::StatusCode::kFailedPrecondition) { \
    GTEST_SKIP() << "no GPU: " << pair##_or.status();                       \
  }                                                                         \
  SHARDPS_ASSERT_OK(pair##_or);                                             \
  Pair& pair = *pair##_or

#ifdef SHARDPS_HAVE_CUDA
TEST(CudaBackendTest, IsBuiltInCudaBuilds) {
  EXPECT_NE(NewCudaBackend(0).status().code(),
            absl::StatusCode::kUnimplemented);
}
#endif

TEST(CudaBackendTest, GradientsMatchCpuReference) {
  struct Case {
    std::vector<int64_t> sizes;
    int b;
  };
  for (const Case& c : std::vector<Case>{{{784, 64, 32, 10}, 64},
                                         {{784, 10}, 100},
                                         {{6, 5, 4, 3}, 7},
                                         {{50, 300, 20}, 1}}) {
    SCOPED_TRACE(ModelSpec(c.sizes).ToString());
    const Problem p = MakeProblem(c.sizes, c.b, /*seed=*/17, kPixels);
    MAKE_PAIR_OR_SKIP(pair, p, c.b);
    std::vector<std::vector<float>> want, got;
    for (const ParamSpec& s : p.spec.Params(0)) {
      want.emplace_back(s.num_elements(), 0.0f);
      got.emplace_back(s.num_elements(), -1.0f);
    }
    absl::StatusOr<double> want_loss =
        pair.cpu->Gradients(p.x, p.labels, 1.0f / c.b, Spans(want));
    absl::StatusOr<double> got_loss =
        pair.cuda->Gradients(p.x, p.labels, 1.0f / c.b, Spans(got));
    SHARDPS_ASSERT_OK(want_loss);
    SHARDPS_ASSERT_OK(got_loss);
    EXPECT_NEAR(*got_loss, *want_loss, 1e-4 * *want_loss);
    const std::vector<ParamSpec> specs = p.spec.Params(0);
    for (size_t t = 0; t < want.size(); ++t) {
      ExpectClose(got[t], want[t], specs[t].name);
    }
  }
}

TEST(CudaBackendTest, TrainingStepMatchesCpuReference) {
  const int b = 128;
  Problem p = MakeProblem({784, 128, 64, 10}, b, /*seed=*/23, kPixels);
  MAKE_PAIR_OR_SKIP(pair, p, b);
  EXPECT_EQ(pair.cuda->name().rfind("cuda:0 (", 0), 0u) << pair.cuda->name();
  // One SGD step from the same weights on each backend, then compare the
  // second step's gradients and an evaluation.
  std::vector<std::vector<float>> cpu_params = p.params, cuda_params = p.params;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    std::vector<std::vector<float>> cpu_grads, cuda_grads;
    for (const std::vector<float>& v : p.params) {
      cpu_grads.emplace_back(v.size());
      cuda_grads.emplace_back(v.size());
    }
    absl::StatusOr<double> cpu_loss =
        pair.cpu->Gradients(p.x, p.labels, 1.0f / b, Spans(cpu_grads));
    absl::StatusOr<double> cuda_loss =
        pair.cuda->Gradients(p.x, p.labels, 1.0f / b, Spans(cuda_grads));
    SHARDPS_ASSERT_OK(cpu_loss);
    SHARDPS_ASSERT_OK(cuda_loss);
    EXPECT_NEAR(*cuda_loss, *cpu_loss, 1e-4 * *cpu_loss);
    for (size_t t = 0; t < cpu_grads.size(); ++t) {
      ExpectClose(cuda_grads[t], cpu_grads[t], std::to_string(t));
      for (size_t i = 0; i < cpu_grads[t].size(); ++i) {
        cpu_params[t][i] -= 0.5f * cpu_grads[t][i];
        cuda_params[t][i] -= 0.5f * cuda_grads[t][i];
      }
    }
    SHARDPS_ASSERT_OK(pair.cpu->SetParams(ConstSpans(cpu_params)));
    SHARDPS_ASSERT_OK(pair.cuda->SetParams(ConstSpans(cuda_params)));
  }
  absl::StatusOr<EvalResult> cpu_eval = pair.cpu->Evaluate(p.x, p.labels);
  absl::StatusOr<EvalResult> cuda_eval = pair.cuda->Evaluate(p.x, p.labels);
  SHARDPS_ASSERT_OK(cpu_eval);
  SHARDPS_ASSERT_OK(cuda_eval);
  EXPECT_NEAR(cuda_eval->mean_loss, cpu_eval->mean_loss,
              1e-4 * cpu_eval->mean_loss);
  EXPECT_EQ(cuda_eval->correct, cpu_eval->correct);
}

TEST(CudaBackendTest, EvaluateInChunksMatchesCpuAndReinitWorks) {
  const Problem p = MakeProblem({20, 16, 5}, 300, /*seed=*/31, kPixels);
  MAKE_PAIR_OR_SKIP(pair, p, 64);  // 300 rows: five chunks
  absl::StatusOr<EvalResult> want = pair.cpu->Evaluate(p.x, p.labels);
  absl::StatusOr<EvalResult> got = pair.cuda->Evaluate(p.x, p.labels);
  SHARDPS_ASSERT_OK(want);
  SHARDPS_ASSERT_OK(got);
  EXPECT_NEAR(got->mean_loss, want->mean_loss, 1e-5 * want->mean_loss);
  EXPECT_EQ(got->correct, want->correct);

  const Problem q = MakeProblem({20, 5}, 10, /*seed=*/37, kPixels);
  SHARDPS_ASSERT_OK(pair.cuda->Init(q.spec, 10));
  SHARDPS_ASSERT_OK(pair.cuda->SetParams(ConstSpans(q.params)));
  SHARDPS_ASSERT_OK(pair.cpu->Init(q.spec, 10));
  SHARDPS_ASSERT_OK(pair.cpu->SetParams(ConstSpans(q.params)));
  want = pair.cpu->Evaluate(q.x, q.labels);
  got = pair.cuda->Evaluate(q.x, q.labels);
  SHARDPS_ASSERT_OK(want);
  SHARDPS_ASSERT_OK(got);
  EXPECT_NEAR(got->mean_loss, want->mean_loss, 1e-5 * want->mean_loss);
}

TEST(CudaBackendTest, BadLabelIsInvalidArgument) {
  const Problem p = MakeProblem({4, 3}, 2, /*seed=*/41, kPixels);
  MAKE_PAIR_OR_SKIP(pair, p, 2);
  const std::vector<int32_t> bad = {0, 7};
  EXPECT_EQ(pair.cuda->Evaluate(p.x, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardps::worker
