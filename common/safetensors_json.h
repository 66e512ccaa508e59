// The small JSON reader behind safetensors headers: RFC 8259 documents into
// a tree of values, with a nesting limit so that a hostile header cannot
// exhaust the stack. Internal to safetensors.cc; pure functions.
#ifndef SHARDPS_COMMON_SAFETENSORS_JSON_H_
#define SHARDPS_COMMON_SAFETENSORS_JSON_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardps::safetensors_internal {

// A parsed JSON value. Numbers keep their value only when they are plain
// non-negative integers, which is all a safetensors header needs.
struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool is_uint = false;  // a number with no sign, fraction or exponent
  uint64_t uint_value = 0;
  std::string string_value;
  std::vector<Json> items;                            // kArray
  std::vector<std::pair<std::string, Json>> members;  // kObject, file order
};

// Parses a whole document (surrounding whitespace allowed). InvalidArgument
// "malformed JSON header: <what> at byte N" otherwise.
absl::StatusOr<Json> ParseJson(absl::string_view text);

// The first member of `object` named `key`, or null.
const Json* FindMember(const Json& object, absl::string_view key);

}  // namespace shardps::safetensors_internal

#endif  // SHARDPS_COMMON_SAFETENSORS_JSON_H_
