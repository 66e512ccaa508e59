// How a shard's weights go out in a PushPull or Pull reply: the encodings
// a reply may ask for, and the reply's header and payload in one of them,
// the payload referencing the store's buffers where it can (no copy) or
// copied into the worker's shared memory where the request asked for it.
// Stateless; safe from any thread.
#ifndef SHARDPS_SERVER_REPLY_ENCODING_H_
#define SHARDPS_SERVER_REPLY_ENCODING_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "common/shared_memory.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/chunk.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// InvalidArgument unless weights can be sent in `encoding`: FP32 or BF16,
// and for PushPull replies (`sparse`) TOPK.
absl::Status CheckReplyEncoding(v1::Encoding encoding, bool sparse);

// The reply's fields in `header` and its payload in `payload` (empty when
// it has no weights or they went into `region`), in `encoding` (checked by
// CheckReplyEncoding): FP32 references the weights buffer, BF16 is a
// rounded copy, TOPK references the update's changes (or, for a reply
// without them, is the weights as FP32). With `region` and `at` (the
// request asked for its reply in shared memory) the payload is copied
// there instead, when it fits. Counts the bytes sent in `store` and
// `metrics` (null: none).
void EncodeReply(ChunkReply reply, v1::Encoding encoding, ParameterStore* store,
                 ServerMetrics* metrics, SharedRegion* region,
                 std::optional<uint64_t> at, v1::PushPullResponse* header,
                 grpc::Slice* payload);

// The same as one PushPullResponse message (common/wire.h).
grpc::ByteBuffer EncodeReply(ChunkReply reply, v1::Encoding encoding,
                             ParameterStore* store, ServerMetrics* metrics,
                             SharedRegion* region = nullptr,
                             std::optional<uint64_t> at = std::nullopt);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_REPLY_ENCODING_H_
