// The model a shard holds once declared: the declaration, every chunk of the
// layout and the shard it belongs to, each tensor's optimizer, and the chunks
// this shard owns with their initial values and optimizer slots. Built once
// (by Declare or from a checkpoint), then constant but for the chunks' state
// and the count of chunks awaiting their values.
#ifndef SHARDPS_SERVER_SHARD_MODEL_H_
#define SHARDPS_SERVER_SHARD_MODEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/chunking.h"
#include "server/checkpoint.h"
#include "server/chunk.h"
#include "server/optimizer.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

struct ShardModel {
  uint32_t shard_index = 0;
  v1::DeclareRequest declaration;
  uint64_t fingerprint = 0;  // of (layout, optimizer)
  std::vector<ChunkSpec> all_chunks;
  std::vector<uint32_t> shard_of;  // by chunk id
  TensorOptimizers optimizers;     // Chunk::optimizer points into these
  // By chunk id; null where another shard owns the chunk.
  std::vector<std::unique_ptr<Chunk>> chunks;
  std::vector<Chunk*> owned;  // the owned chunks, ascending id
  uint64_t owned_bytes = 0;
  // Owned chunks whose Chunk::awaiting_values is set (KIND_PROVIDED, not
  // sent yet); changed with the chunk's lock held, read without it: 0 means
  // no push or read needs to look.
  std::atomic<int64_t> num_awaiting{0};

  // The chunk `chunk_id`; NotFound naming its shard when another shard owns
  // it or the layout has no such chunk.
  absl::StatusOr<Chunk*> Find(uint32_t chunk_id) const;
  // The owned chunks by id, null elsewhere (what an Aggregator takes).
  std::vector<Chunk*> ChunksById() const;
  // `chunk` (owned) stops awaiting its initial values, if it did.
  void StopAwaiting(Chunk* chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu);
};

// Validates `req` (layout, optimizers: see TensorOptimizers) and creates
// shard `shard_index`'s chunks of it, placed over `num_shards` shards, at
// their initial values; the chunks of a KIND_PROVIDED tensor hold zeros and
// await their values. InvalidArgument naming what is wrong.
absl::StatusOr<std::unique_ptr<ShardModel>> BuildShardModel(
    const v1::DeclareRequest& req, uint32_t shard_index, uint32_t num_shards);

// FailedPrecondition unless `chunks` hold exactly the chunks `model` owns,
// all at one step, with the sizes and the optimizer slots of each chunk's
// tensor's optimizer.
absl::Status CheckSavedChunks(const ShardModel& model,
                              const std::vector<ChunkState>& chunks);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_MODEL_H_
