#include "common/tensor_init.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(InitTest, ValuesDoNotDependOnChunking) {
  v1::InitSpec init;
  init.set_kind(v1::InitSpec::KIND_NORMAL);
  init.set_value(0.5f);
  init.set_seed(7);
  std::vector<float> whole(1000), parts(1000);
  FillInit(init, 2, 0, whole.data(), 1000);
  FillInit(init, 2, 0, parts.data(), 333);
  FillInit(init, 2, 333, parts.data() + 333, 667);
  EXPECT_EQ(whole, parts);
}

TEST(InitTest, NormalHasTheRequestedMoments) {
  v1::InitSpec init;
  init.set_kind(v1::InitSpec::KIND_NORMAL);
  init.set_value(2.0f);
  init.set_seed(1);
  std::vector<float> x(200000);
  FillInit(init, 0, 0, x.data(), x.size());
  double sum = 0, sq = 0;
  for (float v : x) {
    sum += v;
    sq += double{v} * v;
  }
  const double mean = sum / x.size();
  const double std = std::sqrt(sq / x.size() - mean * mean);
  // Standard error of the mean is 2/sqrt(2e5) ~ 0.0045: 0.03 is ~7 sigma.
  EXPECT_NEAR(mean, 0.0, 0.03);
  EXPECT_NEAR(std, 2.0, 0.03);
}

TEST(InitTest, SeedsAndTensorsGiveDifferentStreams) {
  v1::InitSpec a;
  a.set_kind(v1::InitSpec::KIND_UNIFORM);
  a.set_value(1.0f);
  a.set_seed(1);
  v1::InitSpec b = a;
  b.set_seed(2);
  std::vector<float> x(16), y(16), z(16);
  FillInit(a, 0, 0, x.data(), 16);
  FillInit(b, 0, 0, y.data(), 16);
  FillInit(a, 1, 0, z.data(), 16);
  EXPECT_NE(x, y);
  EXPECT_NE(x, z);
  for (float v : x) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
}

TEST(InitTest, ZerosAndConstant) {
  v1::InitSpec init;
  std::vector<float> x(4, 9.0f);
  FillInit(init, 0, 0, x.data(), 4);
  EXPECT_EQ(x, std::vector<float>(4, 0.0f));
  init.set_kind(v1::InitSpec::KIND_CONSTANT);
  init.set_value(0.25f);
  FillInit(init, 0, 0, x.data(), 4);
  EXPECT_EQ(x, std::vector<float>(4, 0.25f));
}

}  // namespace
}  // namespace shardps
