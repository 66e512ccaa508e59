// One Pull call of a shard: streams the weights of the chunks it reads, one
// message at a time, each into the call's shared-memory region where the
// request gave an offset for it. Driven by gRPC's reactions one at a time.
#ifndef SHARDPS_SERVER_PULL_REACTOR_H_
#define SHARDPS_SERVER_PULL_REACTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "common/shared_memory.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// The offsets of `req` by position in `ids` (the chunks the Pull reads);
// InvalidArgument naming the chunk for an offset of a chunk not read, one
// outside `region`, or any without a region.
absl::Status ReplyOffsets(const v1::PullRequest& req,
                          const std::vector<uint32_t>& ids,
                          const SharedRegion* region,
                          std::vector<std::optional<uint64_t>>* reply_at);

// Streams `chunk_ids` of `store` in `encoding` (checked by
// CheckReplyEncoding); with `region`, the weights of each chunk that has an
// offset in `reply_at` (by position in `chunk_ids`) go there instead of
// into the message. `store` and `metrics` (null: none) must outlive the
// call; the reactor deletes itself when gRPC is done with it.
class PullReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  PullReactor(ParameterStore* store, std::vector<uint32_t> chunk_ids,
              v1::Encoding encoding, ServerMetrics* metrics,
              std::shared_ptr<SharedRegion> region,
              std::vector<std::optional<uint64_t>> reply_at);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void WriteNext();

  ParameterStore* const store_;
  const std::vector<uint32_t> chunk_ids_;
  const v1::Encoding encoding_;
  ServerMetrics* const metrics_;
  // Null: none. Shared with the shard's RegionCache, which keeps it mapped
  // for the worker's next Pull.
  const std::shared_ptr<SharedRegion> region_;
  const std::vector<std::optional<uint64_t>> reply_at_;
  size_t next_ = 0;
  grpc::ByteBuffer response_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_PULL_REACTOR_H_
