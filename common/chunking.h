// Splits a model layout into chunks: the unit of ownership, aggregation,
// optimizer state and checkpoint. Every party derives the same chunks from the
// same v1::Layout. Pure functions; thread-safe.
#ifndef SHARDPS_COMMON_CHUNKING_H_
#define SHARDPS_COMMON_CHUNKING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {

inline constexpr uint64_t kDefaultChunkBytes = uint64_t{4} << 20;
// Largest chunk accepted: keeps every message well under gRPC's 2 GiB limit
// and bounds per-chunk memory on the servers.
inline constexpr uint64_t kMaxChunkBytes = uint64_t{64} << 20;
// Most chunks a layout may have: bounds the per-chunk state a Declare
// allocates.
inline constexpr int64_t kMaxChunks = int64_t{1} << 20;
// Largest model accepted, in elements (1 TiB of fp32 would not fit anyway).
inline constexpr int64_t kMaxModelElements = int64_t{1} << 38;

// A contiguous range of one tensor's row-major elements.
struct ChunkSpec {
  uint32_t id = 0;      // position in the layout's chunk list
  uint32_t tensor = 0;  // index into Layout.tensors
  int64_t offset = 0;   // first element within the tensor
  int64_t num_elements = 0;

  int64_t bytes() const { return num_elements * int64_t{4}; }
};

// Most Layout.chunk_count_multiple accepted.
inline constexpr uint32_t kMaxChunkCountMultiple = 64;

// Element count of a tensor (product of its shape).
int64_t NumElements(const v1::TensorSpec& tensor);

// InvalidArgument naming the problem: no tensors, empty or duplicate names,
// dimensions < 1, chunk_bytes not a multiple of 4 or over kMaxChunkBytes,
// chunk_count_multiple over kMaxChunkCountMultiple,
// a model over kMaxModelElements or over kMaxChunks chunks, or a bad init
// spec, a sparse_weights_ratio outside [0, 1] or a negative
// sparse_weights_min_elements.
absl::Status ValidateLayout(const v1::Layout& layout);

// The layout's chunk size in bytes (chunk_bytes, or the default for 0).
uint64_t ChunkBytes(const v1::Layout& layout);

// The chunk size a worker declares unless told one: the largest power of two
// at most model_bytes / kAutoChunksPerModel, from MinAutoChunkBytes to
// kMaxAutoChunkBytes, with chunk_count_multiple kAutoChunkCountMultiple.
// - Grain: a chunk's reply leaves a shard once every worker's copy is in, so
//   a step fills and drains its pipeline for about 2 * S * chunk / B (S
//   shards, links of rate B) beyond its bytes' time M / B: with M in 128
//   chunks that is at most S / 64 of it (6 % at 4 shards; with 32 chunks,
//   25 %: the wide GPT at 4 x 4 on 1 Gbit/s, not clipped, took 16.7 s in
//   1 MiB chunks and 13.6 s in 256 KiB, 0.93x and 0.82x DDP's time).
// - Messages: at least 64 KiB, since every chunk costs a message each way
//   (the main job at 4 x 4 on 1 Gbit/s, 2 cores: 10.2 k samples/s in 64 KiB
//   chunks, 7.9-8.2 k in 16 KiB), and at most 1 MiB.
// - Slow links: where the slowest link's rate is known (shardps-worker
//   --link_rate; shardps-local --emulate_hosts gives its --link) and a
//   64 KiB chunk takes it over kAutoChunkLinkTime, the least is what the
//   link carries in that time, rounded up to a power of two, and at least
//   kMinSlowLinkChunkBytes: 16 KiB at 100 Mbit/s, where a 64 KiB chunk
//   takes 5.2 ms and the main job at 4 x 4 stepped at 1.20x its
//   bytes-over-rate bound, against 1.07x in 16 KiB chunks. A link of
//   1 Gbit/s or more keeps 64 KiB.
// - Balance: a shard's share of the model is within about one chunk of the
//   mean (the partitioner places the largest chunks first), and a tensor of
//   8 or more chunks splits evenly over 2, 4 or 8 shards: the main job's
//   2 MiB model, whose first layer was 25 chunks, left one of 4 servers
//   8.4 % over the mean and now 1.3 %.
// - Wire bytes: the rules above hold for the bytes a chunk puts on the wire,
//   so where both directions take at most 2 bytes an element (bf16, fp16 or
//   int8 gradients with bf16 weights) a chunk holds twice the elements:
//   the main job at 4 x 4 on 1 Gbit/s, bf16 both ways, 2 cores, took
//   10.6-12.0 s in 24 chunks of 128 KiB (64 KiB on the wire) against
//   11.9-12.9 s in 44 of 64 KiB, alternated (fewer messages for the CPU);
//   at 100 Mbit/s 23.1-23.3 s in 76 of 32 KiB against 23.2-23.3 s in 140
//   of 16 KiB.
// Depends only on the model, the rate and the wire bytes given, not on the
// number of servers, so a checkpoint restores onto any number of them (with
// the same --link_rate and encodings, or the --chunk_kib it chose).
inline constexpr uint64_t kMinAutoChunkBytes = uint64_t{64} << 10;
inline constexpr uint64_t kMinSlowLinkChunkBytes = uint64_t{16} << 10;
inline constexpr int64_t kAutoChunkLinkTimeUs = 500;
inline constexpr uint64_t kMaxAutoChunkBytes = uint64_t{1} << 20;
inline constexpr uint64_t kAutoChunksPerModel = 128;
inline constexpr uint32_t kAutoChunkCountMultiple = 8;
// The least automatic chunk for links of this rate (0: not known).
uint64_t MinAutoChunkBytes(int64_t link_bits_per_second);
// `wire_bytes_per_element`: what an element takes on the wire in the larger
// direction, 4 (fp32), 2 or 1; other values count as 4.
uint64_t AutoChunkBytes(int64_t model_bytes, int64_t link_bits_per_second = 0,
                        int wire_bytes_per_element = 4);
// The model's fp32 bytes: every tensor's elements, 4 bytes each.
int64_t ModelBytes(const v1::Layout& layout);
// Sets layout.chunk_bytes to AutoChunkBytes(ModelBytes(layout), link rate,
// wire bytes) and layout.chunk_count_multiple to kAutoChunkCountMultiple
// where chunk_bytes is 0 (the callers' "automatic"); leaves a given size
// alone.
void ChooseChunkBytes(v1::Layout& layout, int64_t link_bits_per_second = 0,
                      int wire_bytes_per_element = 4);

// How many chunks a tensor of n elements becomes: ceil(n / max_elements),
// rounded up to a multiple of `multiple` where it is at least `multiple`
// (never more than n).
int64_t ChunkCount(int64_t n, int64_t max_elements, uint32_t multiple);

// Chunks of every tensor in layout order. A tensor of n elements becomes
// ChunkCount(n, ...) chunks of nearly equal size (they differ by at most one
// element). REQUIRES: ValidateLayout(layout).ok().
std::vector<ChunkSpec> MakeChunks(const v1::Layout& layout);

// Stable 64-bit fingerprint (FNV-1a over the deterministic serialization) of
// a declaration: layout and optimizer.
uint64_t Fingerprint(const v1::Layout& layout,
                     const v1::OptimizerSpec& optimizer);

}  // namespace shardps

#endif  // SHARDPS_COMMON_CHUNKING_H_
