// What a worker sends on the wire: the gradient encoding of its pushes (with
// error feedback for the lossy ones) and the encoding it asks its weights
// in. GradientCompressor encodes each chunk of a step and keeps the chunk's
// residual, committed once the shard has acknowledged the chunk.
#ifndef SHARDPS_WORKER_COMPRESSION_H_
#define SHARDPS_WORKER_COMPRESSION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/chunking.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

struct Compression {
  // FP32 (exact), BF16, FP16, INT8 or TOPK.
  v1::Encoding gradients = v1::ENCODING_FP32;
  // TOPK: the fraction of each chunk's elements sent, in (0, 1].
  double topk_ratio = 0;
  // TOPK: over the first steps the fraction falls exponentially from 1 to
  // topk_ratio (topk_ratio^((step + 1) / warmup) at step < warmup), as
  // sparse training recipes warm up; 0: topk_ratio from the start.
  int64_t topk_warmup_steps = 0;
  // Chunks of fewer elements go as FP32 (gradients) and whole (sparse
  // weights): small tensors (biases, norms, an output layer) cost little on
  // the wire and matter much to accuracy.
  int64_t min_elements = 0;
  // Lossy encodings: what a chunk's encoding dropped is added to the next
  // step's gradient of that chunk, so nothing is lost over time.
  bool error_feedback = true;
  // The weights in replies: FP32 (exact), BF16 (each worker computes on
  // the bf16 rounding of the shards' fp32 weights) or TOPK (sparse weights,
  // Layout.sparse_weights_ratio: each reply carries the weights_topk_ratio
  // of the chunk's elements that changed most; every worker holds the same
  // copy, which the shards keep).
  v1::Encoding weights = v1::ENCODING_FP32;
  double weights_topk_ratio = 0;
};

// Parses --compression: "none" (or "fp32"), "bf16", "fp16", "int8" or
// "topk:RATIO" with RATIO in (0, 1], e.g. topk:0.01. InvalidArgument naming
// the problem.
absl::StatusOr<v1::Encoding> ParseGradientCompression(absl::string_view spec,
                                                      double* topk_ratio);
// Parses --weight_encoding: "fp32", "bf16" or "topk:RATIO" (RATIO in
// (0, 1]).
absl::StatusOr<v1::Encoding> ParseWeightEncoding(absl::string_view spec,
                                                 double* topk_ratio);
// InvalidArgument for a combination that cannot be sent.
absl::Status ValidateCompression(const Compression& c);
// The bytes an element takes on the wire in the larger direction, for
// automatic chunks (AutoChunkBytes): 4 for fp32 gradients or weights (and
// for top-k, whose warmup and indices can take as much), else 2 (bf16 or
// fp16 gradients, or int8 ones, with bf16 weights).
int WireBytesPerElement(const Compression& c);
// "bf16", "topk:0.01 without error feedback", "fp32 (bf16 weights)": for
// logs.
std::string CompressionName(const Compression& c);

// Encodes the gradient chunks of a model, one step at a time. Encode and
// Commit of different chunks may run on different threads at once; one
// chunk is used by one thread at a time.
class GradientCompressor {
 public:
  // REQUIRES: ValidateCompression(c).ok() and c.gradients != FP32.
  GradientCompressor(const Compression& c, std::vector<ChunkSpec> chunks);

  // InvalidArgument naming the element when chunk `id`'s gradient of
  // `step` cannot be encoded: non-finite, or (with the residual Encode will
  // add) non-finite or beyond fp16's range for FP16. Run before anything of
  // a step is sent, so that a refused step sends nothing.
  absl::Status CheckValues(uint32_t id, const float* gradient,
                           int64_t step) const;

  // The fraction of each chunk TOPK sends at `step`.
  double TopkRatioAt(int64_t step) const;

  // Encodes chunk `id`'s gradient of `step` (chunk-length, at `gradient`)
  // plus its residual. The same step again (a retry, or the step redone
  // after a failure) gets the payload first encoded for it, whatever the
  // gradient: the shard may hold that one and ignores another. The payload
  // stays valid until the chunk's next Encode; a retry sends it again as it is.
  // InvalidArgument naming the element for a value the encoding cannot carry
  // (non-finite, beyond fp16's range).
  absl::StatusOr<absl::string_view> Encode(uint32_t id, const float* gradient,
                                           int64_t step);
  // The shard acknowledged chunk `id`'s last payload: its residual becomes
  // what that payload dropped. Without a Commit the next Encode starts from
  // the residual before (the step was not accepted).
  void Commit(uint32_t id);
  // Drops every residual (a rollback undid the steps they came from).
  void Reset();
  // `chunks` are the ones this compressor was made for.
  bool SameChunks(const std::vector<ChunkSpec>& chunks) const;

  v1::Encoding encoding() const { return c_.gradients; }
  // Chunk `id` is encoded (else it goes as FP32, without a residual).
  bool compresses(uint32_t id) const {
    return chunks_[id].num_elements >= c_.min_elements;
  }

 private:
  struct ChunkCodec {
    std::string payload;
    std::string spare;            // the next Encode writes here
    std::vector<float> residual;  // committed; empty until first used
    std::vector<float> pending;   // after the last Encode
    // At least the largest |element| of each (ResidualBound), so that
    // CheckValues need not read the residual.
    float residual_max = 0;
    float pending_max = 0;
    bool encoded = false;  // pending not committed yet
    int64_t step = -1;     // of `payload`
  };
  const Compression c_;
  const std::vector<ChunkSpec> chunks_;
  std::vector<ChunkCodec> codecs_;  // by chunk id
};

}  // namespace shardps

#endif  // SHARDPS_WORKER_COMPRESSION_H_
