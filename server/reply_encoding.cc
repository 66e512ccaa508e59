#include "server/reply_encoding.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "common/wire.h"

namespace shardps::server {
namespace {

void ReleaseWeights(void* holder) {
  delete static_cast<WeightsBuffer*>(holder);
}

void ReleaseBf16(void* holder) { delete[] static_cast<uint16_t*>(holder); }

void ReleaseSharedBf16(void* holder) {
  delete static_cast<std::shared_ptr<SharedBf16>*>(holder);
}

void ReleaseChanges(void* holder) {
  delete static_cast<std::shared_ptr<const std::string>*>(holder);
}

}  // namespace

absl::Status CheckReplyEncoding(v1::Encoding encoding, bool sparse) {
  encoding = EffectiveEncoding(encoding);
  if (encoding == v1::ENCODING_FP32 || encoding == v1::ENCODING_BF16 ||
      (sparse && encoding == v1::ENCODING_TOPK)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "weights cannot be sent as ", EncodingName(encoding),
      sparse ? ": ask for ENCODING_FP32, ENCODING_BF16 or ENCODING_TOPK"
             : ": ask for ENCODING_FP32 or ENCODING_BF16"));
}

void EncodeReply(ChunkReply reply, v1::Encoding encoding, ParameterStore* store,
                 ServerMetrics* metrics, SharedRegion* region,
                 std::optional<uint64_t> at, v1::PushPullResponse* header,
                 grpc::Slice* payload_out) {
  encoding = EffectiveEncoding(encoding);
  if (encoding == v1::ENCODING_TOPK && reply.changes == nullptr) {
    encoding = v1::ENCODING_FP32;
  }
  header->Clear();
  header->set_chunk_id(reply.chunk_id);
  header->set_version(reply.version);
  header->set_encoding(encoding);
  if (reply.sum_of_squares.has_value()) {
    header->set_sum_of_squares(*reply.sum_of_squares);
  }
  if (reply.decision.has_value()) {
    header->mutable_decision()->set_clip_coefficient(
        reply.decision->clip_coefficient);
    header->mutable_decision()->set_skip(reply.decision->skip);
  }
  header->set_speculative(reply.speculative);
  *payload_out = grpc::Slice();
  if (reply.weights == nullptr) return;
  const std::vector<float>& w = *reply.weights;
  grpc::Slice payload;
  if (encoding == v1::ENCODING_TOPK) {
    const std::string& changes = *reply.changes;
    auto* holder = new std::shared_ptr<const std::string>(reply.changes);
    payload =
        ReferenceSlice(changes.data(), changes.size(), ReleaseChanges, holder);
  } else if (encoding == v1::ENCODING_BF16 && reply.bf16 != nullptr) {
    SharedBf16& shared = *reply.bf16;
    absl::call_once(shared.once, [&] {
      shared.values.resize(w.size());
      EncodeBf16(w.data(), static_cast<int64_t>(w.size()),
                 shared.values.data());
    });
    auto* holder = new std::shared_ptr<SharedBf16>(std::move(reply.bf16));
    payload = ReferenceSlice(shared.values.data(), w.size() * 2,
                             ReleaseSharedBf16, holder);
  } else if (encoding == v1::ENCODING_BF16) {
    auto* bf16 = new uint16_t[w.size()];
    EncodeBf16(w.data(), static_cast<int64_t>(w.size()), bf16);
    payload = ReferenceSlice(bf16, w.size() * 2, ReleaseBf16, bf16);
  } else {
    // The slice keeps the buffer alive until gRPC has sent it.
    auto* holder = new WeightsBuffer(std::move(reply.weights));
    payload = ReferenceSlice(w.data(), w.size() * 4, ReleaseWeights, holder);
  }
  store->CountSent(w.size() * 4, payload.size());
  if (metrics != nullptr) metrics->Sent(payload.size(), w.size() * 4);
  if (region != nullptr && at.has_value() &&
      region->Contains(*at, payload.size())) {
    std::memcpy(region->data() + *at, payload.begin(), payload.size());
    header->set_shm_bytes(payload.size());
    return;
  }
  *payload_out = std::move(payload);
}

grpc::ByteBuffer EncodeReply(ChunkReply reply, v1::Encoding encoding,
                             ParameterStore* store, ServerMetrics* metrics,
                             SharedRegion* region, std::optional<uint64_t> at) {
  v1::PushPullResponse header;
  grpc::Slice payload;
  EncodeReply(std::move(reply), encoding, store, metrics, region, at, &header,
              &payload);
  return EncodeWithPayload(header, std::move(payload));
}

}  // namespace shardps::server
