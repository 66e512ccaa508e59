// A region of shared memory between a worker and a shard on the same
// machine: an anonymous memfd, sealed at its size, that the worker creates
// and names by /proc/<pid>/fd/<fd>, and the shard maps by that name. A
// worker makes one stream region per PushPull stream (its chunks'
// gradients and weights, and its message rings) and one per shard for its
// Pulls, plus one gradient and one weight region holding the whole model,
// which a shard maps lazily (it touches only its own chunks' pages). What
// lies where, and how a call names a region, is the protocol in
// common/shm_protocol.h. A shard that cannot open the path is not
// co-located, and the payloads travel in the messages.
//
// Trust: the shard opens only /proc/<pid>/fd/<n> paths, only sealed memfds
// (so the worker cannot shrink one under the shard's mapping), and copies
// every gradient out of the region before checking it, so a worker that
// scribbles on its region harms only its own contribution.
#ifndef SHARDPS_COMMON_SHARED_MEMORY_H_
#define SHARDPS_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardps {

class SharedRegion {
 public:
  // A new region of `bytes` (> 0), zero-filled, that other processes of
  // this machine can open by path() while this object lives.
  // ResourceExhausted or Internal naming the failed call.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(uint64_t bytes);
  // How Open maps a region: read-write with every page mapped at once
  // (the stream's own regions); read-only with pages mapped as they are
  // first read (a worker's gradient region, of which a shard reads only
  // its own chunks; writing into such a mapping faults); read-write with
  // pages mapped as they are first touched (a worker's weight region, of
  // which a shard writes only its own chunks).
  enum class Mapping { kReadWrite, kReadOnly, kReadWriteLazy };
  // Maps the region at `path` (as path() names it) that must be `bytes`
  // long. FailedPrecondition naming the path and the reason: not a
  // /proc/<pid>/fd/<n> path, cannot be opened (another machine or pid
  // namespace, another user), not a sealed memfd, another size.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Open(
      absl::string_view path, uint64_t bytes,
      Mapping mapping = Mapping::kReadWrite);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  // The memfd behind a region (its device and inode): two paths name the
  // same region when their identities are equal. While a mapping of a
  // region lives, no other file can take its identity.
  struct Identity {
    uint64_t device = 0;
    uint64_t inode = 0;
    bool operator==(const Identity& o) const {
      return device == o.device && inode == o.inode;
    }
  };
  // The identity of the file at `path` now (FailedPrecondition naming the
  // path when it cannot be opened or stat'ed). Cheap: no mapping.
  static absl::StatusOr<Identity> Identify(absl::string_view path);

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  const Identity& identity() const { return identity_; }
  // The path that opens this region from another process (empty for an
  // opened one: it keeps no descriptor).
  const std::string& path() const { return path_; }
  // True when [offset, offset + bytes) lies inside the region.
  bool Contains(uint64_t offset, uint64_t bytes) const {
    return offset <= size_ && bytes <= size_ - offset;
  }

 private:
  SharedRegion(char* data, uint64_t size, int fd, std::string path,
               Identity identity)
      : data_(data),
        size_(size),
        fd_(fd),
        path_(std::move(path)),
        identity_(identity) {}
  char* const data_;
  const uint64_t size_;
  const int fd_;  // -1 for an opened region
  const std::string path_;
  const Identity identity_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_SHARED_MEMORY_H_
