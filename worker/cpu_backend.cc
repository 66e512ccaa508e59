// The reference backend: cblas_sgemm for the linear layers and the plain-loop
// CPU twins of the CUDA kernels for everything else. All buffers are sized in
// Init, so a step allocates nothing.
#include <cblas.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/backend.h"
#include "worker/cuda/bias_relu_cpu.h"
#include "worker/cuda/softmax_xent_cpu.h"

namespace shardps::worker {
namespace {

// The rows of a weight's gradient computed (and reported) at a time: about
// 256 KiB, a few chunks' worth at the default chunk sizes.
constexpr int kGradientBlockBytes = 256 << 10;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads) {}
  std::string name() const override { return "cpu"; }

 protected:
  absl::Status DoInit(const ModelSpec& spec, int max_batch) override;
  absl::Status DoSetParams(absl::Span<const absl::Span<const float>> params,
                           bool first_layer) override;
  absl::StatusOr<double> DoGradients(const float* x, const int32_t* labels,
                                     int b, float scale,
                                     absl::Span<const absl::Span<float>> grads,
                                     const GradientReady& ready,
                                     const GradientPartReady& part,
                                     bool first_layer_ahead) override;
  int DoFirstLayerBlock() const override {
    return std::max(1, kGradientBlockBytes / (width(0) * 4));
  }
  void DoForwardFirstLayer(const float* x, int b, int begin, int end,
                           const float* weight, const float* bias) override;
  absl::StatusOr<EvalResult> DoEvaluate(const float* x, const int32_t* labels,
                                        int b) override;

 private:
  int width(int i) const { return sizes_[i]; }  // layer i's width; 0 = input
  int num_layers() const { return static_cast<int>(sizes_.size()) - 1; }
  const float* weight(int l) const { return params_[2 * l].data(); }
  const float* bias(int l) const { return params_[2 * l + 1].data(); }
  // Input of layer l (0-based): x for the first layer, else a hidden output.
  const float* input(int l, const float* x) const {
    return l == 0 ? x : acts_[l - 1].data();
  }
  // Computes acts_[l] = layer l's output for every layer (but the first
  // when `first_layer_ahead`: computed already); the last holds the logits.
  void Forward(const float* x, int b, bool first_layer_ahead = false);
  // Sums the per-row results of the softmax-xent twin.
  double SumLoss(int b) const;

  const int threads_;
  std::vector<int> sizes_;                  // layer widths, input first
  std::vector<std::vector<float>> params_;  // Params() order
  std::vector<std::vector<float>> acts_;    // acts_[l]: (max_batch, width l+1)
  std::vector<float> delta_[2];             // ping-pong (max_batch, max width)
  std::vector<float> row_loss_;
  std::vector<int32_t> row_correct_;
};

absl::Status CpuBackend::DoInit(const ModelSpec& spec, int max_batch) {
#ifdef OPENBLAS_VERSION
  openblas_set_num_threads(threads_);
#endif
  sizes_.assign(spec.layer_sizes().begin(), spec.layer_sizes().end());
  params_.clear();
  acts_.clear();
  for (int l = 0; l < num_layers(); ++l) {
    params_.emplace_back(static_cast<size_t>(width(l)) * width(l + 1));
    params_.emplace_back(width(l + 1));
    acts_.emplace_back(static_cast<size_t>(max_batch) * width(l + 1));
  }
  for (std::vector<float>& d : delta_) {
    d.assign(static_cast<size_t>(max_batch) * spec.max_width(), 0.0f);
  }
  row_loss_.assign(max_batch, 0.0f);
  row_correct_.assign(max_batch, 0);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSetParams(
    absl::Span<const absl::Span<const float>> params, bool first_layer) {
  for (size_t i = first_layer ? 0 : 2; i < params.size(); ++i) {
    std::copy(params[i].begin(), params[i].end(), params_[i].begin());
  }
  return absl::OkStatus();
}

void CpuBackend::DoForwardFirstLayer(const float* x, int b, int begin, int end,
                                     const float* weight, const float* bias) {
  const int in = width(0);
  const int out = width(1);
  float* y = acts_[0].data();
  // y[:, begin..end] (b, end - begin) = x (b, in) * W[begin..end]^T.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, end - begin, in, 1.0f,
              x, in, weight + static_cast<int64_t>(begin) * in, in, 0.0f,
              y + begin, out);
  for (int r = 0; r < b; ++r) {
    BiasActivationCpu(y + static_cast<int64_t>(r) * out + begin, bias + begin,
                      1, end - begin, /*relu=*/num_layers() > 1);
  }
}

void CpuBackend::Forward(const float* x, int b, bool first_layer_ahead) {
  // The first layer in the blocks ForwardFirstLayer computes ahead: the
  // same bits either way.
  if (!first_layer_ahead) {
    const int block = DoFirstLayerBlock();
    for (int u = 0; u < width(1); u += block) {
      DoForwardFirstLayer(x, b, u, std::min(u + block, width(1)), weight(0),
                          bias(0));
    }
  }
  for (int l = 1; l < num_layers(); ++l) {
    const int in = width(l);
    const int out = width(l + 1);
    float* y = acts_[l].data();
    // y (b, out) = input (b, in) * W^T, W being (out, in) row-major.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, out, in, 1.0f,
                input(l, x), in, weight(l), in, 0.0f, y, out);
    BiasActivationCpu(y, bias(l), b, out, /*relu=*/l + 1 < num_layers());
  }
}

double CpuBackend::SumLoss(int b) const {
  // Summed in double, in row order, like the CUDA backend.
  double sum = 0.0;
  for (int r = 0; r < b; ++r) sum += row_loss_[r];
  return sum;
}

absl::StatusOr<double> CpuBackend::DoGradients(
    const float* x, const int32_t* labels, int b, float scale,
    absl::Span<const absl::Span<float>> grads, const GradientReady& ready,
    const GradientPartReady& part, bool first_layer_ahead) {
  Forward(x, b, first_layer_ahead);
  const int last = num_layers() - 1;
  float* dz = delta_[0].data();  // d(loss)/d(pre-activation) of layer l
  float* da = delta_[1].data();  // d(loss)/d(input) of layer l
  SoftmaxXentCpu(acts_[last].data(), labels, b, width(last + 1), scale, dz,
                 row_loss_.data(), row_correct_.data());
  for (int l = last; l >= 0; --l) {
    const int in = width(l);
    const int out = width(l + 1);
    BiasGradCpu(dz, b, out, grads[2 * l + 1].data());
    SHARDPS_RETURN_IF_ERROR(ready(2 * l + 1));
    // dW (out, in) = dz^T (out, b) * input (b, in), by blocks of rows (of
    // output units): each block is final at once and on its way while the
    // next is computed, so a large weight's first bytes leave before its
    // last are computed. Always in the same blocks: the same bits whether
    // or not a caller listens.
    const int rows = std::max(1, kGradientBlockBytes / (in * 4));
    float* dw = grads[2 * l].data();
    for (int o = 0; o < out; o += rows) {
      const int m = std::min(rows, out - o);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, in, b, 1.0f,
                  dz + o, out, input(l, x), in, 0.0f,
                  dw + static_cast<int64_t>(o) * in, in);
      if (o + m < out) {
        SHARDPS_RETURN_IF_ERROR(part(2 * l, static_cast<int64_t>(o + m) * in));
      }
    }
    // Layer l's gradients are final: on their way while layers below run.
    SHARDPS_RETURN_IF_ERROR(ready(2 * l));
    if (l == 0) break;
    // da (b, in) = dz (b, out) * W (out, in); then through the ReLU that
    // produced this layer's input.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, b, in, out, 1.0f, dz,
                out, weight(l), in, 0.0f, da, in);
    ReluBackwardCpu(da, acts_[l - 1].data(), static_cast<int64_t>(b) * in);
    std::swap(dz, da);
  }
  return SumLoss(b) / b;
}

absl::StatusOr<EvalResult> CpuBackend::DoEvaluate(const float* x,
                                                  const int32_t* labels,
                                                  int b) {
  Forward(x, b);
  const int last = num_layers() - 1;
  SoftmaxXentCpu(acts_[last].data(), labels, b, width(last + 1), 1.0f,
                 /*dlogits=*/nullptr, row_loss_.data(), row_correct_.data());
  EvalResult result;
  result.mean_loss = SumLoss(b) / b;
  for (int r = 0; r < b; ++r) result.correct += row_correct_[r];
  return result;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(int threads) {
  if (threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be >= 1, got ", threads));
  }
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace shardps::worker
