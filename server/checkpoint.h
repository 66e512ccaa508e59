// Coordinated checkpoints on disk: each shard writes its chunks (weights,
// optimizer slots, versions) to dir/step-<step>/shard-<i>-of-<n>.safetensors,
// and the step becomes a checkpoint once a COMMITTED manifest lists every
// shard file with its size and CRC32C (the layout: common/checkpoint_steps.h,
// where NewestCommittedStep reads it cheaply). Stateless functions; concurrent
// calls are safe on distinct step directories (shards of one step write
// distinct files), and readers only trust steps whose manifest and files all
// check out.
#ifndef SHARDPS_SERVER_CHECKPOINT_H_
#define SHARDPS_SERVER_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_steps.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps::server {

// The saved state of one chunk. `slots` holds Optimizer::num_slots() arrays,
// each as long as `weights`; `version` is the number of updates applied.
struct ChunkState {
  uint32_t chunk_id = 0;
  int64_t version = 0;
  std::vector<float> weights;
  std::vector<std::vector<float>> slots;
  // Chunk::skipped_updates: the optimizer's own step count is version -
  // skipped_updates.
  int64_t skipped_updates = 0;
};

// One written shard file, as a COMMITTED manifest lists it.
struct ShardFile {
  int64_t step = 0;
  uint32_t shard_index = 0;
  uint32_t num_shards = 0;
  uint64_t fingerprint = 0;  // Fingerprint(layout, optimizer)
  std::string name;          // file name inside the step directory
  uint64_t bytes = 0;        // file size
  uint32_t crc32c = 0;       // CRC32C of the whole file
};

// A valid (committed and verified) checkpoint.
struct CheckpointInfo {
  std::string step_dir;  // dir/step-<12 digits>
  int64_t step = 0;
  uint32_t num_shards = 0;
  uint64_t fingerprint = 0;
  std::vector<ShardFile> files;  // indexed by shard index
  // Newer step directories that were passed over, each "<name>: <why>", for
  // the daemon's log.
  std::vector<std::string> skipped;
};

// The model a checkpoint holds: the DeclareRequest saved in its shard 0 file
// (num_shards and shard_index cleared). DataLoss when it is unreadable.
absl::StatusOr<v1::DeclareRequest> CheckpointDeclaration(
    const CheckpointInfo& ckpt);

// Describes an existing shard file of `step` for the manifest: size, CRC32C
// of the whole file, and the fingerprint from its metadata. NotFound when the
// file does not exist (yet); DataLoss when it is unreadable.
absl::StatusOr<ShardFile> DescribeShardFile(const std::string& dir,
                                            int64_t step, uint32_t shard_index,
                                            uint32_t num_shards);

// Writes `chunks`, which must be exactly the chunks that shard `shard_index`
// of `num_shards` owns under PartitionChunks, to
// StepDirectory(dir, step)/shard-<i>-of-<n>.safetensors, creating directories
// as needed, atomically (tmp, fsync, rename, fsync dir). Tensors are
// "chunk.<id>.weights" and "chunk.<id>.slot<k>" (F32, shape [n]) in chunk id
// order; "__metadata__" holds step, shard_index, num_shards, fingerprint (16
// hex digits), declaration (base64 of the serialized DeclareRequest with
// num_shards and shard_index cleared), versions ("id:version,..." ascending),
// skipped ("id:skipped_updates,..." of the chunks where it is not 0; absent
// when none) and crc32c (8 hex digits, of the data section). A COMMITTED
// manifest already in the step directory is removed first, so the step reads as
// uncommitted until CommitCheckpoint runs again. Returns the file's entry for
// the manifest. InvalidArgument for a bad layout, optimizer, step or shard
// view, or chunks that are missing, extra, duplicated or of the wrong size;
// FailedPrecondition naming the path when a directory cannot be created or
// written; Internal for other I/O errors.
absl::StatusOr<ShardFile> WriteShardCheckpoint(
    const std::string& dir, int64_t step, uint32_t shard_index,
    uint32_t num_shards, const v1::DeclareRequest& declaration,
    const std::vector<ChunkState>& chunks);

// Marks `step` committed by writing StepDirectory(dir, step)/COMMITTED, a
// text manifest of step, num_shards, fingerprint and every shard file's
// name, size and CRC32C, atomically (tmp, fsync, rename, fsync dir).
// InvalidArgument unless `files` has one entry per shard index of this step,
// num_shards and fingerprint; FailedPrecondition when a listed file is missing
// or has another size; Internal for I/O errors.
absl::Status CommitCheckpoint(const std::string& dir, int64_t step,
                              uint32_t num_shards,
                              const std::vector<ShardFile>& files);

// The newest valid checkpoint under `dir`: its step directory has a
// parsable COMMITTED manifest and every listed file exists with the listed
// size and CRC32C (every file is read). Newer directories that fail any check
// are reported in `skipped`. NotFound when `dir` holds no valid checkpoint
// (the message lists what was skipped).
absl::StatusOr<CheckpointInfo> LatestCommitted(const std::string& dir);

// The committed checkpoint of exactly `step` under `dir`, verified like
// LatestCommitted; FailedPrecondition or DataLoss naming what is wrong when
// it is missing, torn or not committed.
absl::StatusOr<CheckpointInfo> CommittedAt(const std::string& dir,
                                           int64_t step);

// The state of every chunk that shard `shard_index` of `num_shards` owns
// under PartitionChunks for `declaration`, ascending by chunk id, read from
// whichever files of `ckpt` hold them (the checkpoint may come from another
// number of shards). Each file read is checked again (metadata and data
// CRC32C). InvalidArgument for a bad layout, optimizer or shard view;
// FailedPrecondition when the declaration's fingerprint differs from the
// checkpoint's (a different model); DataLoss naming the file or chunk when a
// file is unreadable or inconsistent or a chunk is missing.
absl::StatusOr<std::vector<ChunkState>> LoadChunksForShard(
    const CheckpointInfo& ckpt, uint32_t shard_index, uint32_t num_shards,
    const v1::DeclareRequest& declaration);

// Keeps the newest `keep` valid checkpoints under `dir` and removes every
// older step directory, committed or not. Directories newer than the newest
// valid checkpoint are left alone: they may be in progress. Does nothing when
// there is no valid checkpoint. Verifies like LatestCommitted, so it reads
// the kept checkpoints. InvalidArgument if keep < 1; Internal for I/O errors.
absl::Status PruneCheckpoints(const std::string& dir, int keep);

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CHECKPOINT_H_
