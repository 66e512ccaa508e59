#include "common/status.h"

#include "gtest/gtest.h"

namespace shardps {
namespace {

TEST(StatusTest, WithPrefixKeepsTheCodeAndPrependsTheContext) {
  const absl::Status s =
      WithPrefix("shard 1", absl::UnavailableError("draining"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "shard 1: draining");
}

TEST(StatusTest, WithPrefixLeavesOkAlone) {
  EXPECT_TRUE(WithPrefix("shard 1", absl::OkStatus()).ok());
}

absl::StatusOr<int> Half(int n) {
  if (n % 2 != 0) return absl::InvalidArgumentError("odd");
  return n / 2;
}

absl::Status Quarter(int n, int* out) {
  SHARDPS_ASSIGN_OR_RETURN(const int half, Half(n));
  SHARDPS_ASSIGN_OR_RETURN(*out, Half(half));
  SHARDPS_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusTest, MacrosReturnTheFirstError) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  EXPECT_EQ(Quarter(6, &out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardps
