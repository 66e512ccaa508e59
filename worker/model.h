// The models a worker trains: a stack of fully connected layers with ReLU
// between them and softmax cross-entropy on top ("softmax" is the one-layer
// case). A ModelSpec only describes the layers and their parameters (names,
// shapes, seeded initialisation); backends compute with it. Immutable value.
#ifndef SHARDPS_WORKER_MODEL_H_
#define SHARDPS_WORKER_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardps::worker {

// How the servers initialise a parameter (they generate the values).
struct ParamSpec {
  enum class Init { kZeros, kNormal };
  std::string name;            // "fc1.weight", "fc1.bias", ...
  std::vector<int64_t> shape;  // weights (out, in) row-major; biases (out)
  Init init = Init::kZeros;
  float std = 0.0f;   // standard deviation for kNormal (mean 0)
  uint64_t seed = 0;  // derived from the model seed and the parameter index
  int64_t num_elements() const;
};

class ModelSpec {
 public:
  // REQUIRES: at least two sizes, each >= 1 (ParseModelSpec checks this).
  explicit ModelSpec(std::vector<int64_t> layer_sizes);

  // Layer widths, input first: {784, 512, 256, 10} has three linear layers.
  const std::vector<int64_t>& layer_sizes() const { return layer_sizes_; }
  int num_layers() const { return static_cast<int>(layer_sizes_.size()) - 1; }
  int64_t num_features() const { return layer_sizes_.front(); }
  int num_classes() const { return static_cast<int>(layer_sizes_.back()); }
  // Width of the widest layer, input included.
  int64_t max_width() const;
  // "mlp:784-512-256-10".
  std::string ToString() const;

  // fc1.weight, fc1.bias, fc2.weight, ... in this order. Weights of layers
  // followed by ReLU are He-normal (std sqrt(2 / fan_in)); the last layer's
  // weights have std sqrt(1 / fan_in); biases are zero. Parameter i gets a
  // seed that depends only on (model_seed, i).
  std::vector<ParamSpec> Params(uint64_t model_seed) const;
  // Total number of floats over Params().
  int64_t num_params() const;

 private:
  std::vector<int64_t> layer_sizes_;
};

// Parses "softmax" (one linear layer num_features -> num_classes) or
// "mlp:784-512-256-10". InvalidArgument for another form, a size below 1, or
// a first size other than num_features or a last size other than num_classes.
absl::StatusOr<ModelSpec> ParseModelSpec(absl::string_view text,
                                         int64_t num_features, int num_classes);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_MODEL_H_
