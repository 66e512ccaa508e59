// The training flags of a job (--dataset, --model, --lr, ...), defined once
// and shared by shardps-worker (which trains with them) and shardps-local
// (which passes them through to every worker). Defaults are the main job:
// Fashion-MNIST, MLP 784-512-256-10, SGD lr 0.1 momentum 0.9 with cosine
// decay, global batch 256, 10 epochs.
#ifndef SHARDPS_WORKER_TRAINING_FLAGS_H_
#define SHARDPS_WORKER_TRAINING_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "worker/compression.h"

ABSL_DECLARE_FLAG(std::string, dataset);
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int64_t, batch_size);
ABSL_DECLARE_FLAG(int32_t, epochs);
ABSL_DECLARE_FLAG(int64_t, max_steps);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(double, momentum);
ABSL_DECLARE_FLAG(bool, nesterov);
ABSL_DECLARE_FLAG(double, weight_decay);
ABSL_DECLARE_FLAG(std::string, lr_schedule);
ABSL_DECLARE_FLAG(int64_t, warmup_steps);
ABSL_DECLARE_FLAG(double, clip_grad_norm);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int32_t, eval_every_epochs);
ABSL_DECLARE_FLAG(int32_t, threads);
ABSL_DECLARE_FLAG(int64_t, train_limit);
ABSL_DECLARE_FLAG(int64_t, test_limit);
ABSL_DECLARE_FLAG(int64_t, chunk_kib);
ABSL_DECLARE_FLAG(std::string, link_rate);
ABSL_DECLARE_FLAG(int32_t, streams_per_shard);
ABSL_DECLARE_FLAG(bool, shared_memory);
ABSL_DECLARE_FLAG(bool, speculative_weights);
ABSL_DECLARE_FLAG(std::string, compression);
ABSL_DECLARE_FLAG(bool, error_feedback);
ABSL_DECLARE_FLAG(int64_t, topk_warmup_steps);
ABSL_DECLARE_FLAG(int64_t, compression_min_elements);
ABSL_DECLARE_FLAG(std::string, weight_encoding);

namespace shardps::worker {

// Every training flag as "--name=value", for passing on to a worker.
std::vector<std::string> TrainingFlagArgs();

// --compression, --error_feedback and --weight_encoding; InvalidArgument
// naming a bad one.
absl::StatusOr<Compression> CompressionFromFlags();

// The training flags' scalar values, checked: what the worker's trainer
// takes from them. InvalidArgument naming a bad one. shardps-local checks
// them too, so that a bad value fails before any process starts.
struct TrainingFlagValues {
  int32_t epochs = 0;
  int32_t eval_every_epochs = 0;
  int64_t max_steps = 0;
  double clip_grad_norm = 0;
  uint64_t chunk_bytes = 0;          // 0: automatic
  int64_t link_bits_per_second = 0;  // 0: --link_rate not given
};
absl::StatusOr<TrainingFlagValues> TrainingFlagValuesFromFlags();

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_TRAINING_FLAGS_H_
