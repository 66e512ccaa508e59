#include "worker/reply_reader.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "common/status.h"

namespace shardps {

void ReplyReader::Declare(absl::Span<const ChunkSpec> chunks) {
  if (asked_ != v1::ENCODING_TOPK) return;
  bool same_chunks = copies_.size() == chunks.size();
  for (size_t i = 0; same_chunks && i < chunks.size(); ++i) {
    same_chunks =
        copies_[i].size() == static_cast<size_t>(chunks[i].num_elements);
  }
  if (same_chunks) return;
  copies_.clear();
  for (const ChunkSpec& c : chunks) copies_.emplace_back(c.num_elements);
  copy_version_.assign(chunks.size(), -1);
}

absl::Status ReplyReader::Read(Reply* r, const ChunkSpec& c, float* out,
                               const SharedRegion* region, uint64_t at) {
  const v1::Encoding got = EffectiveEncoding(r->response.encoding());
  const bool sparse = asked_ == v1::ENCODING_TOPK;
  // The payload: in the message, or where this chunk's weights lie in the
  // call's region.
  const uint64_t in_shm = r->response.shm_bytes();
  if (in_shm > 0 && (region == nullptr || sparse || r->payload.size() != 0 ||
                     in_shm > static_cast<uint64_t>(c.bytes()) ||
                     !region->Contains(at, in_shm))) {
    return absl::InternalError(absl::StrCat(
        "bad reply: weights of chunk ", c.id, " said to be ", in_shm,
        " bytes of shared memory, which this call did not ask for"));
  }
  StringByteSource shared(in_shm > 0
                              ? absl::string_view(region->data() + at, in_shm)
                              : absl::string_view());
  const ByteSource& payload =
      in_shm > 0 ? static_cast<const ByteSource&>(shared) : r->payload;
  absl::Status s;
  if (got == v1::ENCODING_TOPK && sparse) {
    // k = 0 is fine here: an update that changed nothing.
    if (payload.size() < 4 || (payload.size() - 4) % 8 != 0 ||
        (payload.size() - 4) / 8 > static_cast<uint64_t>(c.num_elements)) {
      s = absl::InvalidArgumentError(absl::StrCat("sparse weights of chunk ",
                                                  c.id, " have ",
                                                  payload.size(), " bytes"));
    }
  } else {
    s = CheckPayload(got, payload.size(), c.num_elements);
    // Sparse weights come whole as FP32 when a reply has no changes.
    if (s.ok() && got != asked_ && !(sparse && got == v1::ENCODING_FP32)) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "weights of chunk ", c.id, " came as ", EncodingName(got),
          ", not the ", EncodingName(asked_), " asked for"));
    }
  }
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("bad reply: ", s.message()));
  }
  float* whole = sparse ? copies_[c.id].data() : out;
  if (got == v1::ENCODING_FP32) {
    // Written in place by the shard (the weight region): nothing to copy.
    if (in_shm == 0 ||
        region->data() + at != reinterpret_cast<const char*>(whole)) {
      payload.CopyTo(reinterpret_cast<char*>(whole));
    }
  } else {
    if (got == v1::ENCODING_BF16) {
      // Widened from the received slices where they lie (weights may be
      // anything: nothing is refused).
      SHARDPS_RETURN_IF_ERROR(DecodePayload(got, payload, c.num_elements,
                                            /*allow_nonfinite=*/true, whole));
    } else {
      r->scratch.resize(payload.size());
      payload.CopyTo(r->scratch.data());
      SHARDPS_RETURN_IF_ERROR(ApplyChanges(r, c, r->response.version()));
    }
  }
  if (sparse) {
    copy_version_[c.id] = r->response.version();
    std::memcpy(out, whole, c.bytes());
  }
  return absl::OkStatus();
}

absl::Status ReplyReader::ApplyChanges(Reply* r, const ChunkSpec& c,
                                       int64_t version) {
  // The changes of the update to `version`: this worker must hold the copy
  // before it (or already this one: a step redone after a lost reply).
  if (copy_version_[c.id] == version) return absl::OkStatus();
  if (copy_version_[c.id] != version - 1) {
    return absl::InternalError(absl::StrCat(
        "bad reply: the changes of chunk ", c.id, " to version ", version,
        " need its weights of version ", version - 1, "; this worker holds ",
        copy_version_[c.id] < 0 ? std::string("none")
                                : absl::StrCat("version ", copy_version_[c.id]),
        " (Pull first)"));
  }
  const char* p = r->scratch.data();
  uint32_t k;
  std::memcpy(&k, p, 4);
  if (r->scratch.size() != 4 + 8 * static_cast<size_t>(k)) {
    return absl::InternalError(
        absl::StrCat("bad reply: sparse weights of chunk ", c.id, " list ", k,
                     " elements in ", r->scratch.size(), " bytes"));
  }
  // Checked whole before the copy changes.
  int64_t last = -1;
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t i;
    std::memcpy(&i, p + 4 + 4 * static_cast<size_t>(j), 4);
    if (static_cast<int64_t>(i) <= last || i >= c.num_elements) {
      return absl::InternalError(
          absl::StrCat("bad reply: sparse weights of chunk ", c.id,
                       " list element ", i, " out of order or range"));
    }
    last = i;
  }
  float* copy = copies_[c.id].data();
  for (uint32_t j = 0; j < k; ++j) {
    uint32_t i;
    std::memcpy(&i, p + 4 + 4 * static_cast<size_t>(j), 4);
    std::memcpy(copy + i, p + 4 + 4 * static_cast<size_t>(k) + 4 * j, 4);
  }
  return absl::OkStatus();
}

}  // namespace shardps
