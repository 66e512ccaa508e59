#include "server/aggregator.h"

#include "absl/strings/str_cat.h"

namespace shardps::server {

std::string ConsistencyName(v1::Consistency mode, int64_t staleness) {
  switch (mode) {
    case v1::CONSISTENCY_ASYNC:
      return "async";
    case v1::CONSISTENCY_SSP:
      return absl::StrCat("ssp:", staleness);
    default:
      return "sync";
  }
}

}  // namespace shardps::server
