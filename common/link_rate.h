// A network link's rate as tc writes it ("100mbit", "1gbit"): parsed for
// shardps-local --link, shardps-bench --link and shardps-worker --link_rate,
// and printed for people. Pure functions; thread-safe.
#ifndef SHARDPS_COMMON_LINK_RATE_H_
#define SHARDPS_COMMON_LINK_RATE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardps {

// Bits per second of a rate written as tc writes it: a decimal number and
// one of bit, kbit, mbit, gbit, tbit (powers of 1000, case-insensitive),
// e.g. "500mbit", "1gbit", "2.5gbit". InvalidArgument naming `flag` and the
// value when it is not one, or is outside [1mbit, 400gbit].
absl::StatusOr<int64_t> ParseLinkRate(absl::string_view rate,
                                      absl::string_view flag = "--link");

// "1 Gbit/s", "500 Mbit/s", "2.5 Gbit/s".
std::string FormatLinkRate(int64_t bits_per_second);

}  // namespace shardps

#endif  // SHARDPS_COMMON_LINK_RATE_H_
