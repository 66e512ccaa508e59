// Test assertions for absl::Status and absl::StatusOr that print the status
// when they fail. Test-only.
#ifndef SHARDPS_COMMON_STATUS_MATCHERS_H_
#define SHARDPS_COMMON_STATUS_MATCHERS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace shardps::testing {
inline const absl::Status& ToStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace shardps::testing

#define SHARDPS_ASSERT_OK(expr) \
  ASSERT_TRUE(::shardps::testing::ToStatus(expr).ok()) \
      << ::shardps::testing::ToStatus(expr)
#define SHARDPS_EXPECT_OK(expr) \
  EXPECT_TRUE(::shardps::testing::ToStatus(expr).ok()) \
      << ::shardps::testing::ToStatus(expr)

#endif  // SHARDPS_COMMON_STATUS_MATCHERS_H_
