#include "worker/model.h"

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::worker {
namespace {

TEST(ModelTest, ParsesSoftmaxFromDataShape) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec("softmax", 784, 10);
  SHARDPS_ASSERT_OK(spec);
  EXPECT_EQ(spec->layer_sizes(), (std::vector<int64_t>{784, 10}));
  EXPECT_EQ(spec->num_layers(), 1);
  EXPECT_EQ(spec->ToString(), "mlp:784-10");
  const std::vector<ParamSpec> params = spec->Params(1);
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0].name, "fc1.weight");
  EXPECT_EQ(params[0].shape, (std::vector<int64_t>{10, 784}));
  EXPECT_EQ(params[0].init, ParamSpec::Init::kNormal);
  EXPECT_FLOAT_EQ(params[0].std, std::sqrt(1.0f / 784));
  EXPECT_EQ(params[1].name, "fc1.bias");
  EXPECT_EQ(params[1].init, ParamSpec::Init::kZeros);
}

TEST(ModelTest, MlpParamsAreNamedOrderedAndHeInitialised) {
  absl::StatusOr<ModelSpec> spec =
      ParseModelSpec("mlp:784-512-256-10", 784, 10);
  SHARDPS_ASSERT_OK(spec);
  EXPECT_EQ(spec->num_layers(), 3);
  EXPECT_EQ(spec->max_width(), 784);
  const std::vector<ParamSpec> params = spec->Params(/*model_seed=*/7);
  ASSERT_EQ(params.size(), 6u);
  const std::vector<std::string> names = {"fc1.weight", "fc1.bias",
                                          "fc2.weight", "fc2.bias",
                                          "fc3.weight", "fc3.bias"};
  const std::vector<std::vector<int64_t>> shapes = {
      {512, 784}, {512}, {256, 512}, {256}, {10, 256}, {10}};
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(params[i].name, names[i]);
    EXPECT_EQ(params[i].shape, shapes[i]);
    total += params[i].num_elements();
  }
  EXPECT_EQ(total, spec->num_params());
  EXPECT_EQ(total, 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  EXPECT_FLOAT_EQ(params[0].std, std::sqrt(2.0f / 784));
  EXPECT_FLOAT_EQ(params[2].std, std::sqrt(2.0f / 512));
  EXPECT_FLOAT_EQ(params[4].std, std::sqrt(1.0f / 256));
  EXPECT_EQ(params[3].init, ParamSpec::Init::kZeros);
  EXPECT_EQ(params[3].std, 0.0f);
}

TEST(ModelTest, SeedsAreDeterministicAndDistinct) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec("mlp:4-3-2", 4, 2);
  SHARDPS_ASSERT_OK(spec);
  const std::vector<ParamSpec> a = spec->Params(1);
  const std::vector<ParamSpec> b = spec->Params(1);
  const std::vector<ParamSpec> c = spec->Params(2);
  std::set<uint64_t> seeds;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].seed, b[i].seed);
    EXPECT_NE(a[i].seed, c[i].seed);
    seeds.insert(a[i].seed);
  }
  EXPECT_EQ(seeds.size(), a.size());
}

TEST(ModelTest, RejectsBadSpecs) {
  struct Case {
    std::string text;
    int64_t features;
    int classes;
  };
  const std::vector<Case> cases = {
      {"mlp:784-512-10", 780, 10},  // first size != features
      {"mlp:784-512-9", 784, 10},   // last size != classes
      {"mlp:784-0-10", 784, 10},
      {"mlp:784--10", 784, 10},
      {"mlp:784-x-10", 784, 10},
      {"mlp:784", 784, 784},
      {"mlp:", 784, 10},
      {"cnn", 784, 10},
      {"softmax", 0, 10},
      {"softmax", 784, 0},
      {"mlp:784-99999999999-10", 784, 10},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<ModelSpec> spec =
        ParseModelSpec(c.text, c.features, c.classes);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument)
        << spec.status();
  }
}

}  // namespace
}  // namespace shardps::worker
