#include "common/link_rate.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardps {
namespace {

constexpr int64_t kMinRate = 1000 * 1000;                        // 1mbit
constexpr int64_t kMaxRate = int64_t{400} * 1000 * 1000 * 1000;  // 400gbit

}  // namespace

absl::StatusOr<int64_t> ParseLinkRate(absl::string_view rate,
                                      absl::string_view flag) {
  const std::string lower = absl::AsciiStrToLower(rate);
  const size_t unit_at = lower.find_first_not_of("0123456789.");
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "=", rate, ": ", why,
        "; want a rate as tc writes it, e.g. 500mbit, 1gbit or 10gbit (a "
        "number and one of bit, kbit, mbit, gbit, tbit)"));
  };
  double value = 0;
  if (unit_at == 0 || unit_at == std::string::npos ||
      !absl::SimpleAtod(lower.substr(0, unit_at), &value)) {
    return bad("not a number and a unit");
  }
  const std::string unit = lower.substr(unit_at);
  double scale = 0;
  if (unit == "bit") scale = 1;
  if (unit == "kbit") scale = 1e3;
  if (unit == "mbit") scale = 1e6;
  if (unit == "gbit") scale = 1e9;
  if (unit == "tbit") scale = 1e12;
  if (scale == 0) {
    return bad(absl::StrCat("unknown unit \"", unit,
                            "\" (tc reads bps, kbps, ... as bytes/s)"));
  }
  const double bits = std::round(value * scale);
  if (!(bits >= kMinRate && bits <= kMaxRate)) {
    return bad("outside 1mbit .. 400gbit");
  }
  return static_cast<int64_t>(bits);
}

std::string FormatLinkRate(int64_t bits_per_second) {
  if (bits_per_second >= 1000 * 1000 * 1000) {
    return absl::StrFormat("%g Gbit/s", bits_per_second / 1e9);
  }
  return absl::StrFormat("%g Mbit/s", bits_per_second / 1e6);
}

}  // namespace shardps
