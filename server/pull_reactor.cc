#include "server/pull_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/shm_protocol.h"
#include "server/reply_encoding.h"

namespace shardps::server {

PullReactor::PullReactor(ParameterStore* store, std::vector<uint32_t> chunk_ids,
                         v1::Encoding encoding, ServerMetrics* metrics,
                         std::shared_ptr<SharedRegion> region,
                         std::vector<std::optional<uint64_t>> reply_at)
    : store_(store),
      chunk_ids_(std::move(chunk_ids)),
      encoding_(encoding),
      metrics_(metrics),
      region_(std::move(region)),
      reply_at_(std::move(reply_at)) {
  WriteNext();
}

void PullReactor::OnWriteDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
    return;
  }
  WriteNext();
}

void PullReactor::WriteNext() {
  if (next_ == chunk_ids_.size()) {
    Finish(grpc::Status::OK);
    return;
  }
  const size_t i = next_++;
  absl::StatusOr<ChunkReply> reply = store_->Read(chunk_ids_[i]);
  if (!reply.ok()) {
    if (metrics_ != nullptr) metrics_->Rejected(reply.status());
    Finish(ToGrpcStatus(reply.status()));
    return;
  }
  if (metrics_ != nullptr) metrics_->Pulled();
  response_ =
      EncodeReply(*std::move(reply), encoding_, store_, metrics_, region_.get(),
                  i < reply_at_.size() ? reply_at_[i] : std::nullopt);
  StartWrite(&response_);
}

absl::Status ReplyOffsets(const v1::PullRequest& req,
                          const std::vector<uint32_t>& ids,
                          const SharedRegion* region,
                          std::vector<std::optional<uint64_t>>* reply_at) {
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Pull gives reply_shm_offsets, but its call names no region (",
        shm::kStreamRegionKey, " metadata)"));
  }
  reply_at->assign(ids.size(), std::nullopt);
  size_t found = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = req.reply_shm_offsets().find(ids[i]);
    if (it == req.reply_shm_offsets().end()) continue;
    if (it->second >= region->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Pull: reply_shm_offsets of chunk ", ids[i], " (", it->second,
          ") lies outside the call's region of ", region->size(), " bytes"));
    }
    (*reply_at)[i] = it->second;
    ++found;
  }
  if (found != static_cast<size_t>(req.reply_shm_offsets().size())) {
    for (const auto& [id, at] : req.reply_shm_offsets()) {
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Pull: reply_shm_offsets names chunk ", id,
                         ", which this Pull does not read"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardps::server
