// Each CUDA kernel against its CPU twin on the same seeded inputs. Label gpu:
// skips with the reason where no GPU is usable.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/backend_testing.h"
#include "worker/cuda/bias_relu.cuh"
#include "worker/cuda/bias_relu_cpu.h"
#include "worker/cuda/softmax_xent.cuh"
#include "worker/cuda/softmax_xent_cpu.h"

namespace shardps::worker {
namespace {

#define SKIP_WITHOUT_GPU()                                      \
  do {                                                          \
    int count = 0;                                              \
    const cudaError_t e = cudaGetDeviceCount(&count);           \
    if (e != cudaSuccess || count == 0) {                       \
      GTEST_SKIP() << "no GPU: "                                \
                   << (e != cudaSuccess ? cudaGetErrorString(e) \
                                        : "0 devices");         \
    }                                                           \
  } while (false)

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

// A device copy of a host vector, copied back by Download.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : size_(host.size()) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes()), cudaSuccess);
    ptr_.reset(static_cast<T*>(p));
    EXPECT_EQ(cudaMemcpy(p, host.data(), bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  T* get() { return ptr_.get(); }
  std::vector<T> Download() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(
        cudaMemcpy(host.data(), ptr_.get(), bytes(), cudaMemcpyDeviceToHost),
        cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return size_ * sizeof(T); }
  size_t size_;
  std::unique_ptr<T[], DeviceFree> ptr_;
};

using ::shardps::worker::testing::RandomFloats;

// Float results of different summation orders: tolerance scales with the
// expected value, 1e-5 relative (well above float rounding over <= 1000 terms
// of like magnitude, well below any real bug).
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 float tolerance = 1e-5f) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance * (1.0f + std::abs(want[i]))) << i;
  }
}

TEST(SoftmaxXentKernelTest, MatchesCpuTwin) {
  SKIP_WITHOUT_GPU();
  for (const int cols : {1, 10, 33, 100, 1000}) {
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(
          absl::StrCat(cols, " classes", in_place ? ", in place" : ""));
      const int rows = 37;
      std::vector<float> logits = RandomFloats(rows * cols, cols, 5.0f);
      for (int j = 0; j < cols; ++j) logits[j] += 1000.0f;     // overflow check
      for (int j = 0; j < cols; ++j) logits[cols + j] = 1.0f;  // all tied
      std::vector<int32_t> labels(rows);
      for (int r = 0; r < rows; ++r) labels[r] = (r * 7) % cols;
      std::vector<float> want_grad(rows * cols), want_loss(rows);
      std::vector<int32_t> want_correct(rows);
      SoftmaxXentCpu(logits.data(), labels.data(), rows, cols, 0.25f,
                     want_grad.data(), want_loss.data(), want_correct.data());

      DeviceVector<float> d_logits(logits);
      DeviceVector<int32_t> d_labels(labels);
      DeviceVector<float> d_grad{std::vector<float>(rows * cols)};
      DeviceVector<float> d_loss{std::vector<float>(rows)};
      DeviceVector<int32_t> d_correct{std::vector<int32_t>(rows)};
      float* grad_out = in_place ? d_logits.get() : d_grad.get();
      ASSERT_EQ(
          LaunchSoftmaxXent(d_logits.get(), d_labels.get(), rows, cols, 0.25f,
                            grad_out, d_loss.get(), d_correct.get(), nullptr),
          cudaSuccess);
      ExpectClose(d_loss.Download(), want_loss);
      ExpectClose(in_place ? d_logits.Download() : d_grad.Download(),
                  want_grad);
      EXPECT_EQ(d_correct.Download(), want_correct);
    }
  }
}

TEST(BiasReluKernelTest, BiasActivationMatchesCpuTwin) {
  SKIP_WITHOUT_GPU();
  for (const bool relu : {false, true}) {
    SCOPED_TRACE(relu);
    const int rows = 300, cols = 77;
    const std::vector<float> y = RandomFloats(rows * cols, 1, 1.0f);
    const std::vector<float> bias = RandomFloats(cols, 2, 1.0f);
    std::vector<float> want = y;
    BiasActivationCpu(want.data(), bias.data(), rows, cols, relu);
    DeviceVector<float> d_y(y);
    DeviceVector<float> d_bias(bias);
    ASSERT_EQ(LaunchBiasActivation(d_y.get(), d_bias.get(), rows, cols, relu,
                                   nullptr),
              cudaSuccess);
    EXPECT_EQ(d_y.Download(), want);  // one add per element: exact
  }
}

TEST(BiasReluKernelTest, ReluBackwardMatchesCpuTwin) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  std::vector<float> y = RandomFloats(n, 3, 1.0f);
  for (float& v : y) v = v < 0 ? 0 : v;
  const std::vector<float> dy = RandomFloats(n, 4, 1.0f);
  std::vector<float> want = dy;
  ReluBackwardCpu(want.data(), y.data(), n);
  DeviceVector<float> d_dy(dy);
  DeviceVector<float> d_y(y);
  ASSERT_EQ(LaunchReluBackward(d_dy.get(), d_y.get(), n, nullptr), cudaSuccess);
  EXPECT_EQ(d_dy.Download(), want);
}

TEST(BiasReluKernelTest, BiasGradMatchesCpuTwinAndIsReproducible) {
  SKIP_WITHOUT_GPU();
  for (const int rows : {1, 7, 1000}) {
    for (const int cols : {1, 10, 33, 512}) {
      SCOPED_TRACE(absl::StrCat(rows, "x", cols));
      const std::vector<float> dy =
          RandomFloats(rows * cols, rows + cols, 1.0f);
      std::vector<float> want(cols);
      BiasGradCpu(dy.data(), rows, cols, want.data());
      DeviceVector<float> d_dy(dy);
      DeviceVector<float> d_db{std::vector<float>(cols, 99.0f)};
      ASSERT_EQ(LaunchBiasGrad(d_dy.get(), rows, cols, d_db.get(), nullptr),
                cudaSuccess);
      const std::vector<float> first = d_db.Download();
      // Sums of 1000 terms in [-1, 1]: absolute error bound ~1000 * 2^-24 * 30.
      ExpectClose(first, want, 2e-4f);
      ASSERT_EQ(LaunchBiasGrad(d_dy.get(), rows, cols, d_db.get(), nullptr),
                cudaSuccess);
      EXPECT_EQ(d_db.Download(), first);
    }
  }
}

}  // namespace
}  // namespace shardps::worker
