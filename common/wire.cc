#include "common/wire.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardps {
namespace {

// Reads bytes across a list of slices.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    SkipEmpty();
  }
  bool done() const { return slice_ == slices_.size(); }
  size_t slice() const { return slice_; }
  size_t offset() const { return offset_; }

  bool ReadByte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[slice_].begin()[offset_];
    Advance(1);
    return true;
  }
  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // Skips n bytes, appending them to *out when out is not null.
  bool Skip(uint64_t n, std::string* out) {
    while (n > 0) {
      if (done()) return false;
      const size_t avail = slices_[slice_].size() - offset_;
      const size_t k = n < avail ? n : avail;
      if (out != nullptr) {
        out->append(
            reinterpret_cast<const char*>(slices_[slice_].begin()) + offset_,
            k);
      }
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    if (offset_ == slices_[slice_].size()) {
      offset_ = 0;
      ++slice_;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

grpc::ByteBuffer EncodeWithPayload(const google::protobuf::MessageLite& header,
                                   grpc::Slice payload) {
  std::string head;
  header.SerializeToString(&head);
  AppendVarint((kPayloadField << 3) | 2, &head);  // wire type 2: bytes
  AppendVarint(payload.size(), &head);
  grpc::Slice slices[2] = {grpc::Slice(head), std::move(payload)};
  return grpc::ByteBuffer(slices, slices[1].size() == 0 ? 1 : 2);
}

absl::Status DecodeWithPayload(const grpc::ByteBuffer& buffer,
                               google::protobuf::MessageLite* header,
                               PayloadView* payload) {
  payload->slices_.clear();
  payload->size_ = 0;
  grpc::Status dumped = buffer.Dump(&payload->slices_);
  if (!dumped.ok()) {
    return absl::InvalidArgumentError("cannot read the message bytes");
  }
  Cursor cur(payload->slices_);
  std::string head;  // every field but the payload, re-parsed by protobuf
  while (!cur.done()) {
    uint64_t tag;
    std::string field;
    if (!cur.ReadVarint(&tag)) {
      return absl::InvalidArgumentError("malformed message: truncated tag");
    }
    AppendVarint(tag, &field);
    // Protobuf field numbers are 1 .. 2^29 - 1.
    if ((tag >> 3) == 0 || (tag >> 3) > 0x1fffffff) {
      return absl::InvalidArgumentError(
          "malformed message: field number out of range");
    }
    const uint32_t number = static_cast<uint32_t>(tag >> 3);
    const int wire_type = static_cast<int>(tag & 7);
    bool ok = true;
    if (wire_type == 0) {
      uint64_t v;
      ok = cur.ReadVarint(&v);
      AppendVarint(v, &field);
    } else if (wire_type == 1 || wire_type == 5) {
      ok = cur.Skip(wire_type == 1 ? 8 : 4, &field);
    } else if (wire_type == 2) {
      uint64_t len;
      ok = cur.ReadVarint(&len);
      if (ok && number == kPayloadField) {
        payload->first_slice_ = cur.slice();
        payload->first_offset_ = cur.offset();
        payload->size_ = len;
        ok = cur.Skip(len, nullptr);
        field.clear();
      } else if (ok) {
        AppendVarint(len, &field);
        ok = cur.Skip(len, &field);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed message: field ", number,
                       " is truncated or of an "
                       "unknown wire type"));
    }
    head += field;
  }
  if (!header->ParseFromString(head)) {
    return absl::InvalidArgumentError("malformed message header");
  }
  return absl::OkStatus();
}

void PayloadView::ForEachPiece(
    absl::FunctionRef<void(absl::string_view)> piece) const {
  uint64_t left = size_;
  size_t s = first_slice_;
  size_t off = first_offset_;
  while (left > 0 && s < slices_.size()) {
    const size_t avail = slices_[s].size() - off;
    const size_t k = left < avail ? left : avail;
    piece(absl::string_view(
        reinterpret_cast<const char*>(slices_[s].begin()) + off, k));
    left -= k;
    ++s;
    off = 0;
  }
}

grpc::Slice ReferenceSlice(const void* data, size_t size,
                           void (*release)(void*), void* user) {
  return grpc::Slice(const_cast<void*>(data), size, release, user);
}

}  // namespace shardps
