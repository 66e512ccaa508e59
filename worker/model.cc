#include "worker/model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/splitmix64.h"

namespace shardps::worker {
namespace {

// Layer widths stay within int range for BLAS, with room to spare.
constexpr int64_t kMaxLayerSize = int64_t{1} << 24;

}  // namespace

int64_t ParamSpec::num_elements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

ModelSpec::ModelSpec(std::vector<int64_t> layer_sizes)
    : layer_sizes_(std::move(layer_sizes)) {
  assert(layer_sizes_.size() >= 2);
}

int64_t ModelSpec::max_width() const {
  return *std::max_element(layer_sizes_.begin(), layer_sizes_.end());
}

std::string ModelSpec::ToString() const {
  return absl::StrCat("mlp:", absl::StrJoin(layer_sizes_, "-"));
}

std::vector<ParamSpec> ModelSpec::Params(uint64_t model_seed) const {
  std::vector<ParamSpec> params;
  for (int l = 0; l < num_layers(); ++l) {
    const int64_t in = layer_sizes_[l];
    const int64_t out = layer_sizes_[l + 1];
    const bool last = l + 1 == num_layers();
    ParamSpec weight;
    weight.name = absl::StrCat("fc", l + 1, ".weight");
    weight.shape = {out, in};
    weight.init = ParamSpec::Init::kNormal;
    // He initialisation keeps activations' variance through ReLU layers; the
    // last layer feeds softmax directly, so it uses the variance-1 scale.
    weight.std = static_cast<float>(std::sqrt((last ? 1.0 : 2.0) / in));
    ParamSpec bias;
    bias.name = absl::StrCat("fc", l + 1, ".bias");
    bias.shape = {out};
    params.push_back(std::move(weight));
    params.push_back(std::move(bias));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].seed = SplitMix64(model_seed ^ SplitMix64(i + 1));
  }
  return params;
}

int64_t ModelSpec::num_params() const {
  int64_t n = 0;
  for (int l = 0; l < num_layers(); ++l) {
    n += (layer_sizes_[l] + 1) * layer_sizes_[l + 1];
  }
  return n;
}

absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view text,
                                         int64_t num_features,
                                         int num_classes) {
  std::vector<int64_t> sizes;
  if (text == "softmax") {
    sizes = {num_features, num_classes};
  } else if (absl::ConsumePrefix(&text, "mlp:")) {
    for (const absl::string_view part : absl::StrSplit(text, '-')) {
      int64_t size = 0;
      if (!absl::SimpleAtoi(part, &size) || size < 1 || size > kMaxLayerSize) {
        return absl::InvalidArgumentError(
            absl::StrCat("model \"mlp:", text, "\": layer size \"", part,
                         "\" is not an integer in [1, ", kMaxLayerSize, "]"));
      }
      sizes.push_back(size);
    }
    if (sizes.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model \"mlp:", text, "\" needs at least an input and output size"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown model \"", text, "\": want softmax or mlp:IN-...-OUT"));
  }
  if (sizes.front() != num_features || sizes.back() != num_classes ||
      num_features < 1 || num_classes < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", ModelSpec(sizes).ToString(), " does not fit data with ",
        num_features, " features and ", num_classes, " classes"));
  }
  return ModelSpec(std::move(sizes));
}

}  // namespace shardps::worker
