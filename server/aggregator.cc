#include "server/aggregator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/async_aggregator.h"
#include "server/sync_aggregator.h"

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

std::unique_ptr<Aggregator> Aggregator::Create(const AggregatorOptions& options,
                                               std::vector<Chunk*> chunks,
                                               const ChunkUpdater* updater,
                                               const RankTracker* ranks,
                                               ThreadPool* pool) {
  if (options.mode == v1::CONSISTENCY_ASYNC ||
      options.mode == v1::CONSISTENCY_SSP) {
    return std::make_unique<AsyncAggregator>(options, std::move(chunks),
                                             updater, ranks);
  }
  return std::make_unique<SyncAggregator>(options, std::move(chunks), updater,
                                          ranks, pool);
}

}  // namespace shardps::server
