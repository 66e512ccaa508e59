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

// Evaluates `expr` once.
#define SHARDPS_ASSERT_OK(expr)                                \
  do {                                                         \
    const auto& shardps_s_ = (expr);                           \
    ASSERT_TRUE(::shardps::testing::ToStatus(shardps_s_).ok()) \
        << ::shardps::testing::ToStatus(shardps_s_);           \
  } while (false)
#define SHARDPS_EXPECT_OK(expr)                                \
  do {                                                         \
    const auto& shardps_s_ = (expr);                           \
    EXPECT_TRUE(::shardps::testing::ToStatus(shardps_s_).ok()) \
        << ::shardps::testing::ToStatus(shardps_s_);           \
  } while (false)

// `lhs` = the value of the StatusOr `rexpr`, or the test fails (fatally)
// printing its status.
#define SHARDPS_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  SHARDPS_ASSERT_OK_AND_ASSIGN_IMPL_(            \
      SHARDPS_MATCHERS_CONCAT_(shardps_statusor_, __LINE__), lhs, rexpr)
#define SHARDPS_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                       \
  ASSERT_TRUE(statusor.ok()) << statusor.status();               \
  lhs = std::move(statusor).value()
#define SHARDPS_MATCHERS_CONCAT_(a, b) SHARDPS_MATCHERS_CONCAT_IMPL_(a, b)
#define SHARDPS_MATCHERS_CONCAT_IMPL_(a, b) a##b

#endif  // SHARDPS_COMMON_STATUS_MATCHERS_H_
