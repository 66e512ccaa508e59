#include "server/aggregator.h"

#include <utility>

#include "server/async_aggregator.h"
#include "server/sync_aggregator.h"

namespace shardps::server {

v1::Consistency ConsistencyOf(Mode mode) {
  switch (mode) {
    case Mode::kSync:
      return v1::CONSISTENCY_SYNC;
    case Mode::kAsync:
      return v1::CONSISTENCY_ASYNC;
    case Mode::kSsp:
      return v1::CONSISTENCY_SSP;
  }
  return v1::CONSISTENCY_UNSPECIFIED;
}

std::unique_ptr<Aggregator> Aggregator::Create(const AggregatorOptions& options,
                                               std::vector<Chunk*> chunks,
                                               const ChunkUpdater* updater,
                                               const RankTracker* ranks,
                                               ThreadPool* pool) {
  if (options.mode == Mode::kSync) {
    return std::make_unique<SyncAggregator>(options, std::move(chunks), updater,
                                            ranks, pool);
  }
  return std::make_unique<AsyncAggregator>(options, std::move(chunks), updater,
                                           ranks);
}

}  // namespace shardps::server
