// Status helpers shared by every library: early-return macros for
// absl::Status and absl::StatusOr, context added to a status's message, and
// an errno's text for one.
// The test assertions that print the status are in status_matchers.h.
#ifndef SHARDPS_COMMON_STATUS_H_
#define SHARDPS_COMMON_STATUS_H_

#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

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

namespace shardps {

// `status` with "<prefix>: " before its message and the same code (what was
// being done, or with whom); OK stays OK.
inline absl::Status WithPrefix(absl::string_view prefix,
                               const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

// The text of the errno value `err` ("No such file or directory").
inline std::string ErrnoText(int err) {
  return std::error_code(err, std::generic_category()).message();
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_STATUS_H_
