#include "common/log.h"

#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardps {
namespace {

// Set once by InitLog before other threads exist, then only read.
struct LogIdentity {
  std::string daemon = "shardps";
  int rank = -1;
  bool json = false;
};
LogIdentity& Identity() {
  static LogIdentity* identity = new LogIdentity();
  return *identity;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARN";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

std::string JsonEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(&out, absl::StrFormat("\\u%04x", c));
        } else {
          out.push_back(c);
        }
    }
  }
  return out;
}

}  // namespace

void InitLog(absl::string_view daemon, int rank, bool json) {
  LogIdentity& id = Identity();
  id.daemon = std::string(daemon);
  id.rank = rank;
  id.json = json;
}

void Log(LogLevel level, absl::string_view message) {
  const LogIdentity& id = Identity();
  std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(),
                                      absl::UTCTimeZone());
  std::string line;
  if (id.json) {
    line = absl::StrCat("{\"time\":\"", time, "\",\"level\":\"",
                        LevelName(level), "\",\"daemon\":\"", id.daemon, "\"");
    if (id.rank >= 0) absl::StrAppend(&line, ",\"rank\":", id.rank);
    absl::StrAppend(&line, ",\"msg\":\"", JsonEscape(message), "\"}\n");
  } else {
    std::string who =
        id.rank >= 0 ? absl::StrCat(id.daemon, "[", id.rank, "]") : id.daemon;
    line =
        absl::StrCat(time, " ", LevelName(level), " ", who, " ", message, "\n");
  }
  // One write per line keeps lines whole when threads log at once.
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace shardps
