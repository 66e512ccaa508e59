#include "tests/testing/exposition.h"

#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardps::testing {
namespace {

bool IsNameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         c == ':' || (!first && c >= '0' && c <= '9');
}

bool IsMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsNameChar(name[i], i == 0)) return false;
  }
  return true;
}

// The family a sample belongs to: histogram series carry a suffix.
std::string FamilyOf(absl::string_view name,
                     const std::set<std::string>& typed) {
  for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
    if (absl::EndsWith(name, suffix)) {
      std::string base(name.substr(0, name.size() - suffix.size()));
      if (typed.count(base) > 0) return base;
    }
  }
  return std::string(name);
}

}  // namespace

absl::StatusOr<Samples> ParseExposition(const std::string& text) {
  Samples samples;
  std::set<std::string> typed;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, " (", line, "): ", why));
    };
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() != 2 || !IsMetricName(parts[0])) return bad("bad TYPE");
      static const std::set<std::string> kTypes = {
          "counter", "gauge", "histogram", "summary", "untyped"};
      if (kTypes.count(parts[1]) == 0) return bad("unknown type");
      typed.insert(parts[0]);
      continue;
    }
    if (absl::StartsWith(line, "# HELP ") || absl::StartsWith(line, "#")) {
      continue;
    }
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) return bad("no value");
    const std::string series(line.substr(0, space));
    double value = 0;
    const absl::string_view value_text = line.substr(space + 1);
    if (!absl::SimpleAtod(value_text, &value) && value_text != "+Inf" &&
        value_text != "-Inf" && value_text != "NaN") {
      return bad("value is not a number");
    }
    const size_t brace = series.find('{');
    const absl::string_view name = absl::string_view(series).substr(0, brace);
    if (!IsMetricName(name)) return bad("bad metric name");
    if (brace != std::string::npos && series.back() != '}') {
      return bad("unterminated labels");
    }
    if (typed.count(FamilyOf(name, typed)) == 0) return bad("no # TYPE");
    if (!samples.emplace(series, value).second) return bad("duplicate series");
  }
  return samples;
}

double SampleOr(const Samples& samples, const std::string& series,
                double missing) {
  auto it = samples.find(series);
  return it == samples.end() ? missing : it->second;
}

}  // namespace shardps::testing
