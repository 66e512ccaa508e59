// RegionCache: a shard's mappings of the regions workers name for their
// Pulls, kept from call to call. Mapping a region costs a page-table entry
// per page each time (MAP_POPULATE; on a virtual machine each is a trap),
// which for a 64 MiB model costs more than copying the weights; a worker
// names the same Pull region call after call, so the shard maps it once.
//
// A cached mapping is reused only while the path still names the same memfd
// (SharedRegion::Identity, which no other file can take while the mapping
// lives). At most kEntries mappings are kept, least recently used first out,
// and one unused for kIdle is dropped at the next lookup: a worker that left
// keeps its pages alive on this machine for that long at most. Thread-safe.
#ifndef SHARDPS_SERVER_REGION_CACHE_H_
#define SHARDPS_SERVER_REGION_CACHE_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/shared_memory.h"

namespace shardps::server {

class RegionCache {
 public:
  static constexpr size_t kEntries = 16;
  static constexpr absl::Duration kIdle = absl::Seconds(60);

  // The region at `path` of `bytes`, mapped read-write with every page
  // mapped at once: the cached mapping when the path still names the same
  // memfd, else a new one (cached). Errors as SharedRegion::Open's.
  absl::StatusOr<std::shared_ptr<SharedRegion>> Open(absl::string_view path,
                                                     uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Mappings made and mappings reused, since creation.
  int64_t mapped() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t reused() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::string path;
    std::shared_ptr<SharedRegion> region;
    absl::Time used;
  };
  mutable absl::Mutex mu_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mu_);  // most recent first
  int64_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_REGION_CACHE_H_
