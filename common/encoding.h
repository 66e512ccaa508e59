// Tensor payload encodings: checks that a payload's length fits its encoding,
// and finds non-finite values. FP32 is raw little-endian binary32; the
// compressed encodings are converted by common/codec.h. Pure functions;
// thread-safe.
#ifndef SHARDPS_COMMON_ENCODING_H_
#define SHARDPS_COMMON_ENCODING_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "shardps/v1/parameter_server.pb.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "payloads are little-endian and copied as is");

namespace shardps {

// Bytes that can be read out once, wherever they live (a string, or the
// slices a message arrived in).
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Calls piece() with each contiguous piece of the bytes, in order, so that
  // a decoder can read them where they lie instead of gathering them first.
  // Pieces may end anywhere, even inside an element of a payload. A
  // FunctionRef, not a std::function: a decoder's callback captures more
  // than std::function keeps without allocating, once per message.
  virtual void ForEachPiece(
      absl::FunctionRef<void(absl::string_view)> piece) const = 0;
  // Copies all size() bytes to dst, a piece at a time.
  void CopyTo(char* dst) const;
  // The same, calling copied(n) after each piece with the number of bytes
  // copied so far, so the caller can inspect the data while it is still in
  // cache.
  void CopyTo(char* dst, absl::FunctionRef<void(uint64_t)> copied) const;
  // A ByteSource over the same bytes that stays valid after this one is
  // gone, without copying them; null when they cannot be kept that way
  // (the caller then copies what it needs).
  virtual std::unique_ptr<ByteSource> Retain() const { return nullptr; }
};

// A ByteSource over a string_view, in pieces of 64 KiB (that stay in cache
// for a caller to look at, as the slices of a message do); the bytes must
// outlive it.
class StringByteSource final : public ByteSource {
 public:
  explicit StringByteSource(absl::string_view bytes) : bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void ForEachPiece(
      absl::FunctionRef<void(absl::string_view)> piece) const override;

 private:
  absl::string_view bytes_;
};

// Normalises UNSPECIFIED to FP32 for requests where the field is optional.
v1::Encoding EffectiveEncoding(v1::Encoding e);

// FP32 .. TOPK: an encoding this build can read and write.
bool IsKnownEncoding(v1::Encoding e);
// "ENCODING_BF16", or "encoding 9" for a number the protocol does not define.
std::string EncodingName(v1::Encoding e);

// InvalidArgument when `encoding` is unknown or a payload of `payload_bytes`
// cannot hold `num_elements` values of it (see v1::Encoding: FP32 4n bytes,
// BF16 and FP16 2n, INT8 4 + n, TOPK 4 + 8k with 1 <= k <= n). The
// contents are checked when decoded (common/codec.h).
absl::Status CheckPayload(v1::Encoding encoding, uint64_t payload_bytes,
                          int64_t num_elements);

// Index of the first non-finite value in x[0, n), or -1 when all are finite.
int64_t FirstNonFinite(const float* x, int64_t n);

}  // namespace shardps

#endif  // SHARDPS_COMMON_ENCODING_H_
