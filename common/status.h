// Status helpers shared by every library: early-return macros for
// absl::Status and absl::StatusOr, and the test assertions that print the
// status on failure.
#ifndef SHARDPS_COMMON_STATUS_H_
#define SHARDPS_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDPS_STATUS_CONCAT_INNER_(a, b) a##b
#define SHARDPS_STATUS_CONCAT_(a, b) SHARDPS_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define SHARDPS_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status shardps_status_ = (expr);           \
    if (!shardps_status_.ok()) return shardps_status_; \
  } while (false)

// `lhs` = value of the StatusOr `rexpr`, or returns its status.
#define SHARDPS_ASSIGN_OR_RETURN(lhs, rexpr) \
  SHARDPS_ASSIGN_OR_RETURN_IMPL_(            \
      SHARDPS_STATUS_CONCAT_(shardps_statusor_, __LINE__), lhs, rexpr)
#define SHARDPS_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // SHARDPS_COMMON_STATUS_H_
