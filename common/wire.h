// Zero-copy framing of the data-path messages (PushPullRequest and
// PushPullResponse). On the wire they are ordinary protobuf: the small fields
// first, then the payload as field 15. Encoding references the payload memory
// instead of copying it; decoding leaves the payload in gRPC's slices and
// copies it once, straight to where it is needed.
#ifndef SHARDPS_COMMON_WIRE_H_
#define SHARDPS_COMMON_WIRE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/encoding.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace shardps {

// Metadata of a PushPull call: the pusher's rank (decimal), so that the
// shard's receive budget knows the stream's rank before its first push.
inline constexpr char kRankMetadataKey[] = "shardps-rank";

// Field number of `payload` in PushPullRequest and PushPullResponse.
inline constexpr int kPayloadField = 15;

// Returns `header` (whose payload field must be empty) followed by `payload`
// as field kPayloadField. The payload slice is referenced, not copied.
grpc::ByteBuffer EncodeWithPayload(const google::protobuf::MessageLite& header,
                                   grpc::Slice payload);

// The payload bytes of a decoded message, still in the received slices.
class PayloadView final : public ByteSource {
 public:
  uint64_t size() const override { return size_; }
  // The payload's part of each received slice, in order.
  void ForEachPiece(
      absl::FunctionRef<void(absl::string_view)> piece) const override;
  // A copy referencing the same slices.
  std::unique_ptr<ByteSource> Retain() const override {
    return std::make_unique<PayloadView>(*this);
  }
  // Releases the referenced slices.
  void Clear() {
    slices_.clear();
    size_ = 0;
  }

 private:
  friend absl::Status DecodeWithPayload(const grpc::ByteBuffer&,
                                        google::protobuf::MessageLite*,
                                        PayloadView*);
  std::vector<grpc::Slice> slices_;
  size_t first_slice_ = 0;
  size_t first_offset_ = 0;
  uint64_t size_ = 0;
};

// Parses every field but the payload into `header` and points `payload` at
// the payload bytes (size 0 when absent). InvalidArgument for malformed
// protobuf.
absl::Status DecodeWithPayload(const grpc::ByteBuffer& buffer,
                               google::protobuf::MessageLite* header,
                               PayloadView* payload);

// A slice that references `data` and calls release(user) when gRPC is done
// with it.
grpc::Slice ReferenceSlice(const void* data, size_t size,
                           void (*release)(void*), void* user);

}  // namespace shardps

#endif  // SHARDPS_COMMON_WIRE_H_
