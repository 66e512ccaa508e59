// ReplyReader: decodes the weights a shard sends back (a PushPull reply or a
// Pull message) into the caller's buffers, in the encoding the client asked
// for, and owns the sparse (TOPK) weight copies this worker holds with their
// versions. Thread-compatible per chunk: each chunk is read by one thread at
// a time (its lane's reactions, or its shard's Pull thread).
#ifndef SHARDPS_WORKER_REPLY_READER_H_
#define SHARDPS_WORKER_REPLY_READER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "common/shared_memory.h"
#include "common/wire.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

// A reply being read: its header fields, its payload, and a compressed one
// gathered.
struct Reply {
  v1::PushPullResponse response;
  PayloadView payload;
  std::string scratch;
};

class ReplyReader {
 public:
  // Weights asked as `asked` (ClientOptions.compression.weights).
  explicit ReplyReader(v1::Encoding asked) : asked_(asked) {}

  // After a Declare of `chunks`: with sparse weights, fresh copies (none
  // held) unless the chunks are the same as before.
  void Declare(absl::Span<const ChunkSpec> chunks);

  // Decodes the weights of reply `r` (chunk `c`) into out[0,
  // c.num_elements). A reply with shm_bytes left its payload in `region`
  // (borrowed; null: none) at `at`. InternalError ("bad reply: ...") for a
  // malformed one, another encoding than asked, or shared memory the call
  // did not ask for; on error `out` and the copy may be partly written.
  absl::Status Read(Reply* r, const ChunkSpec& c, float* out,
                    const SharedRegion* region, uint64_t at);

  // The shard moved its copy of chunk `id` without telling this worker (a
  // push-only step): a Pull must fetch it whole before sparse replies can
  // follow. No-op without sparse weights.
  void Forget(uint32_t id) {
    if (!copy_version_.empty()) copy_version_[id] = -1;
  }

 private:
  // Sparse weights: applies the changes in `r` (chunk `c`, to `version`) to
  // the chunk's copy.
  absl::Status ApplyChanges(Reply* r, const ChunkSpec& c, int64_t version);

  v1::Encoding asked_;
  // Sparse weights: by chunk id, the copy the shards keep of what this
  // worker holds, and its version (-1: not received yet). Empty otherwise.
  std::vector<std::vector<float>> copies_;
  std::vector<int64_t> copy_version_;
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_REPLY_READER_H_
