#include "server/region_cache.h"

#include <utility>

#include "absl/time/clock.h"

namespace shardps::server {

absl::StatusOr<std::shared_ptr<SharedRegion>> RegionCache::Open(
    absl::string_view path, uint64_t bytes) {
  absl::StatusOr<SharedRegion::Identity> identity =
      SharedRegion::Identify(path);
  const absl::Time now = absl::Now();
  std::list<Entry> dropped;  // unmapped outside the lock
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      const bool same_path = it->path == path;
      const bool hit = same_path && identity.ok() &&
                       it->region->identity() == *identity &&
                       it->region->size() == bytes;
      if (hit) {
        it->used = now;
        entries_.splice(entries_.begin(), entries_, it);
        ++reused_;
        return entries_.front().region;
      }
      // The path names another memfd now (the worker replaced its
      // region), or the mapping went unused too long.
      auto next = std::next(it);
      if (same_path || now - it->used > kIdle) {
        dropped.splice(dropped.end(), entries_, it);
      }
      it = next;
    }
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> opened =
      SharedRegion::Open(path, bytes, SharedRegion::Mapping::kReadWrite);
  if (!opened.ok()) return opened.status();
  std::shared_ptr<SharedRegion> region = *std::move(opened);
  absl::MutexLock lock(&mu_);
  ++mapped_;
  entries_.push_front(Entry{std::string(path), region, now});
  while (entries_.size() > kEntries) {
    dropped.splice(dropped.end(), entries_, std::prev(entries_.end()));
  }
  return region;
}

int64_t RegionCache::mapped() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}

int64_t RegionCache::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

}  // namespace shardps::server
