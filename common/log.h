// One-line-per-event logging for the daemons: time, level, daemon and rank,
// then the message; plain text or JSON. Libraries return Statuses and do not
// log. Thread-safe: each line is written with a single write(2).
#ifndef SHARDPS_COMMON_LOG_H_
#define SHARDPS_COMMON_LOG_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace shardps {

enum class LogLevel { kInfo, kWarning, kError };

// Sets the daemon name ("server", "worker", ...), its rank or shard index
// (-1: none) and the format. Call once in main before other threads start.
void InitLog(absl::string_view daemon, int rank, bool json);

void Log(LogLevel level, absl::string_view message);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& format, const Args&... args) {
  Log(LogLevel::kInfo, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& format, const Args&... args) {
  Log(LogLevel::kWarning, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  Log(LogLevel::kError, absl::StrFormat(format, args...));
}

}  // namespace shardps

#endif  // SHARDPS_COMMON_LOG_H_
