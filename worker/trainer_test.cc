#include "worker/trainer.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::worker {
namespace {

TEST(TrainerTest, StepsPerEpochDropsTheLastPartialBatch) {
  absl::StatusOr<int64_t> steps = StepsPerEpoch(60000, 256, 2);
  SHARDPS_ASSERT_OK(steps);
  EXPECT_EQ(*steps, 234);  // 60000 / 256 = 234.375
}

TEST(TrainerTest, BadBatchSizesAreClearErrors) {
  struct Case {
    int64_t samples, batch;
    uint32_t workers;
    const char* message;
  };
  for (const Case& c :
       {Case{100, 1, 2, "smaller than the 2 workers"},
        Case{100, 9, 2, "not divisible by the 2 workers"},
        Case{100, 128, 1, "exceeds the 100 training samples"}}) {
    SCOPED_TRACE(c.message);
    absl::StatusOr<int64_t> s = StepsPerEpoch(c.samples, c.batch, c.workers);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(c.message), std::string::npos)
        << s.status();
  }
}

TEST(TrainerTest, OptimizerFlagsBecomeTheServerSpec) {
  OptimizerFlags f;
  absl::StatusOr<v1::OptimizerSpec> spec = MakeOptimizerSpec(f, 2340);
  SHARDPS_ASSERT_OK(spec);
  EXPECT_EQ(spec->kind(), v1::OptimizerSpec::KIND_SGD);
  EXPECT_FLOAT_EQ(spec->learning_rate(), 0.1f);
  EXPECT_FLOAT_EQ(spec->momentum(), 0.9f);
  EXPECT_EQ(spec->schedule().kind(), v1::LrSchedule::KIND_COSINE);
  EXPECT_EQ(spec->schedule().total_steps(), 2340);

  f.name = "adam";
  f.schedule = "step:100:0.5";
  spec = MakeOptimizerSpec(f, 10);
  SHARDPS_ASSERT_OK(spec);
  EXPECT_EQ(spec->kind(), v1::OptimizerSpec::KIND_ADAM);
  EXPECT_EQ(spec->momentum(), 0.0f);  // SGD-only setting is not passed on
  EXPECT_EQ(spec->schedule().step_size(), 100);
  EXPECT_FLOAT_EQ(spec->schedule().gamma(), 0.5f);

  for (const char* bad : {"rmsprop"}) {
    OptimizerFlags g;
    g.name = bad;
    EXPECT_EQ(MakeOptimizerSpec(g, 1).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  for (const char* bad : {"linear", "step:x:0.5", "step:10"}) {
    OptimizerFlags g;
    g.schedule = bad;
    EXPECT_EQ(MakeOptimizerSpec(g, 1).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(TrainerTest, LayoutNamesEveryParameterWithItsInit) {
  absl::StatusOr<ModelSpec> model = ParseModelSpec("mlp:4-3-2", 4, 2);
  SHARDPS_ASSERT_OK(model);
  v1::Layout layout = ModelLayout(*model, 7, 1024);
  ASSERT_EQ(layout.tensors_size(), 4);
  EXPECT_EQ(layout.tensors(0).name(), "fc1.weight");
  EXPECT_EQ(layout.tensors(0).shape_size(), 2);
  EXPECT_EQ(layout.tensors(0).shape(0), 3);
  EXPECT_EQ(layout.tensors(0).shape(1), 4);
  EXPECT_EQ(layout.tensors(0).init().kind(), v1::InitSpec::KIND_NORMAL);
  EXPECT_FLOAT_EQ(layout.tensors(0).init().value(), std::sqrt(2.0f / 4));
  EXPECT_EQ(layout.tensors(1).name(), "fc1.bias");
  EXPECT_EQ(layout.tensors(1).init().kind(), v1::InitSpec::KIND_ZEROS);
  EXPECT_EQ(layout.chunk_bytes(), 1024u);
}

}  // namespace
}  // namespace shardps::worker
