#include "tests/bench/run_command.h"

#include <sys/resource.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "deploy/local/link_shaping.h"

namespace shardps::bench {

absl::StatusOr<std::string> RunCommand(const std::string& command) {
  return local::RunShellCommand(command);
}

absl::StatusOr<std::string> RunCommand(const std::string& command,
                                       CommandUsage* usage) {
  // Children's usage accumulates as each is waited for: the shell, and
  // whatever it waited for in turn.
  rusage before, after;
  getrusage(RUSAGE_CHILDREN, &before);
  absl::StatusOr<std::string> out = RunCommand(command);
  getrusage(RUSAGE_CHILDREN, &after);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  usage->cpu_s = seconds(after.ru_utime) + seconds(after.ru_stime) -
                 seconds(before.ru_utime) - seconds(before.ru_stime);
  usage->voluntary_switches = after.ru_nvcsw - before.ru_nvcsw;
  usage->involuntary_switches = after.ru_nivcsw - before.ru_nivcsw;
  return out;
}

double JsonNumber(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return -1;
  double v = -1;
  const size_t begin = at + key.size() + 4;
  const size_t end = json.find_first_of(",}", begin);
  return absl::SimpleAtod(json.substr(begin, end - begin), &v) ? v : -1;
}

std::string JsonField(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return "?";
  const size_t begin = at + key.size() + 4;
  const size_t end = json[begin] == '[' ? json.find(']', begin) + 1
                                        : json.find_first_of(",}", begin);
  return json.substr(begin, end - begin);
}

std::vector<double> JsonList(const std::string& json, const std::string& key) {
  const std::string text = JsonField(json, key);
  absl::string_view list = text;
  std::vector<double> values;
  if (!absl::ConsumePrefix(&list, "[") || !absl::ConsumeSuffix(&list, "]")) {
    return values;
  }
  for (absl::string_view part :
       absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    double v = 0;
    if (absl::SimpleAtod(part, &v)) values.push_back(v);
  }
  return values;
}

bool ProgressField(absl::string_view line, absl::string_view key, double* v) {
  std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
  for (size_t i = 0; i + 1 < f.size(); ++i) {
    if (f[i] == key) return absl::SimpleAtod(f[i + 1], v);
  }
  return false;
}

std::string Tail(absl::string_view text, size_t n) {
  std::vector<absl::string_view> lines =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(text), '\n');
  if (lines.size() > n) lines.erase(lines.begin(), lines.end() - n);
  return absl::StrCat("    ", absl::StrJoin(lines, "\n    "));
}

}  // namespace shardps::bench
