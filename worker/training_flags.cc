#include "worker/training_flags.h"

#include <cmath>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "common/link_rate.h"
#include "common/status.h"
#include "shardps/v1/parameter_server.pb.h"

ABSL_FLAG(std::string, dataset, "fashion-mnist",
          "Training data: fashion-mnist (/usr/share/datasets/fashion-mnist), "
          "idx:DIR, csv:TRAIN[,TEST] or libsvm:TRAIN[,TEST].");
ABSL_FLAG(std::string, model, "mlp:784-512-256-10",
          "Model: softmax or mlp:IN-H1-...-OUT.");
ABSL_FLAG(int64_t, batch_size, 256,
          "Global batch size; each worker computes a contiguous slice.");
ABSL_FLAG(int32_t, epochs, 10, "Passes over the training set.");
ABSL_FLAG(int64_t, max_steps, 0, "Stop after this many steps (0: no limit).");
ABSL_FLAG(std::string, optimizer, "sgd",
          "Server-side optimizer: sgd, adam, adamw or adagrad.");
ABSL_FLAG(double, lr, 0.1, "Base learning rate.");
ABSL_FLAG(double, momentum, 0.9, "SGD momentum.");
ABSL_FLAG(bool, nesterov, false, "Nesterov momentum (SGD).");
ABSL_FLAG(double, weight_decay, 0.0,
          "L2 penalty (SGD, Adam, Adagrad) or decoupled decay (AdamW).");
ABSL_FLAG(std::string, lr_schedule, "cosine",
          "Learning-rate schedule: constant, cosine (to 0 over the run) or "
          "step:SIZE:GAMMA.");
ABSL_FLAG(int64_t, warmup_steps, 0, "Linear warmup steps.");
ABSL_FLAG(double, clip_grad_norm, 0,
          "Clip the global norm of each step's averaged gradient to this "
          "(torch's clip_grad_norm_), on the servers; 0: off. Adds one round "
          "trip of small messages per step.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial weights and data order.");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: auto (CUDA when a GPU exists), cpu or cuda.");
ABSL_FLAG(int32_t, eval_every_epochs, 1,
          "Evaluate on the test set every N epochs (and after the last).");
ABSL_FLAG(int32_t, threads, 1, "BLAS threads per worker (CPU backend).");
ABSL_FLAG(int64_t, train_limit, 0,
          "Use only the first N training samples (0: all).");
ABSL_FLAG(int64_t, test_limit, 0,
          "Use only the first N test samples (0: all).");
ABSL_FLAG(int64_t, chunk_kib, 0,
          "Largest parameter chunk, in KiB: the unit a server owns, sums and "
          "answers. 0: chosen from the model's size (the largest power of two "
          "at most 1/128 of it, from 64 KiB to 1 MiB), so that servers carry "
          "nearly equal bytes and a step's pipeline fills fast; counted in "
          "wire bytes, so with 2-byte gradients and --weight_encoding=bf16 "
          "a chunk holds twice the elements. Every worker of a job must "
          "choose the same.");
ABSL_FLAG(std::string, link_rate, "",
          "The slowest network link between workers and servers, as tc "
          "writes rates (100mbit, 1gbit); empty: not known. With automatic "
          "chunks (--chunk_kib=0), a link slower than 1 Gbit/s gets chunks "
          "down to what it carries in 0.5 ms (16 KiB at 100 Mbit/s), so "
          "that a step's pipeline fills and drains fast. Every worker of a "
          "job must give the same. Also gives every connection to a server a "
          "TCP receive buffer of what the link carries in 2.5 ms (30.5 KiB "
          "at 100 Mbit/s) instead of the kernel's autotuned one, so that the "
          "servers' replies converging on this worker keep a few ms of the "
          "link in flight instead of overflowing the queue before it (needs "
          "net.core.rmem_max at half of it, or CAP_NET_ADMIN). "
          "shardps-local --emulate_hosts gives its --link.");
ABSL_FLAG(int32_t, streams_per_shard, 1,
          "Parallel gRPC streams from each worker to each shard.");
ABSL_FLAG(bool, shared_memory, true,
          "With a server on this machine, move gradients and weights through "
          "shared memory (only headers over gRPC); false: everything over "
          "gRPC.");
ABSL_FLAG(bool, speculative_weights, true,
          "Clipped steps (--clip_grad_norm): the servers also send, with "
          "each chunk's part of the norm, the weights of the update that does "
          "not clip, and keep them when the step does not clip, so that the "
          "weights travel while later gradients are still pushed. Asked of "
          "servers reached over the network (not through shared memory), "
          "unless the last two steps both clipped; never with "
          "--weight_encoding=topk:RATIO (sparse weights).");
ABSL_FLAG(std::string, compression, "none",
          "Gradient encoding on the wire: none (fp32), bf16, fp16, int8 or "
          "topk:RATIO (the RATIO largest of each chunk, e.g. topk:0.01).");
ABSL_FLAG(int64_t, topk_warmup_steps, 0,
          "--compression=topk:RATIO: over the first N steps the fraction "
          "sent falls exponentially from 1 to RATIO (0: RATIO from the "
          "start).");
ABSL_FLAG(int64_t, compression_min_elements, 0,
          "With --compression: chunks of fewer elements go as fp32 (small "
          "tensors: biases, norms, an output layer).");
ABSL_FLAG(bool, error_feedback, true,
          "Lossy compression: add what a step's encoding dropped to the next "
          "step's gradient (per chunk), so nothing is lost over time.");
ABSL_FLAG(std::string, weight_encoding, "fp32",
          "Weights sent back by the servers: fp32 (exact), bf16 (rounded; "
          "the servers keep fp32) or topk:RATIO (sparse: each step sends the "
          "RATIO of each chunk that changed most; sync mode).");

namespace shardps::worker {

std::vector<std::string> TrainingFlagArgs() {
  static const char* const kNames[] = {"dataset",
                                       "model",
                                       "batch_size",
                                       "epochs",
                                       "max_steps",
                                       "optimizer",
                                       "lr",
                                       "momentum",
                                       "nesterov",
                                       "weight_decay",
                                       "lr_schedule",
                                       "warmup_steps",
                                       "clip_grad_norm",
                                       "seed",
                                       "backend",
                                       "eval_every_epochs",
                                       "threads",
                                       "train_limit",
                                       "test_limit",
                                       "chunk_kib",
                                       "link_rate",
                                       "streams_per_shard",
                                       "shared_memory",
                                       "speculative_weights",
                                       "compression",
                                       "error_feedback",
                                       "topk_warmup_steps",
                                       "compression_min_elements",
                                       "weight_encoding"};
  std::vector<std::string> args;
  for (const char* name : kNames) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr) {
      args.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  return args;
}

absl::StatusOr<TrainingFlagValues> TrainingFlagValuesFromFlags() {
  TrainingFlagValues v;
  v.epochs = absl::GetFlag(FLAGS_epochs);
  v.eval_every_epochs = absl::GetFlag(FLAGS_eval_every_epochs);
  v.max_steps = absl::GetFlag(FLAGS_max_steps);
  v.clip_grad_norm = absl::GetFlag(FLAGS_clip_grad_norm);
  if (!(std::isfinite(v.clip_grad_norm) && v.clip_grad_norm >= 0 &&
        v.clip_grad_norm <= 3.0e38)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--clip_grad_norm=", v.clip_grad_norm,
                     " must be finite and >= 0 (0: no clipping)"));
  }
  const int64_t chunk_kib = absl::GetFlag(FLAGS_chunk_kib);
  if (v.epochs < 1 || v.eval_every_epochs < 1 || v.max_steps < 0 ||
      chunk_kib < 0 || chunk_kib > (64 << 10)) {
    return absl::InvalidArgumentError(
        "--epochs and --eval_every_epochs must be >= 1, --max_steps >= 0, "
        "--chunk_kib in [0, 65536] (0: automatic)");
  }
  v.chunk_bytes = static_cast<uint64_t>(chunk_kib) << 10;
  if (const std::string link = absl::GetFlag(FLAGS_link_rate); !link.empty()) {
    SHARDPS_ASSIGN_OR_RETURN(v.link_bits_per_second,
                             ParseLinkRate(link, "--link_rate"));
  }
  return v;
}

absl::StatusOr<Compression> CompressionFromFlags() {
  Compression c;
  absl::StatusOr<v1::Encoding> gradients =
      ParseGradientCompression(absl::GetFlag(FLAGS_compression), &c.topk_ratio);
  if (!gradients.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compression: ", gradients.status().message()));
  }
  c.gradients = *gradients;
  c.error_feedback = absl::GetFlag(FLAGS_error_feedback);
  c.topk_warmup_steps = absl::GetFlag(FLAGS_topk_warmup_steps);
  c.min_elements = absl::GetFlag(FLAGS_compression_min_elements);
  absl::StatusOr<v1::Encoding> weights = ParseWeightEncoding(
      absl::GetFlag(FLAGS_weight_encoding), &c.weights_topk_ratio);
  if (!weights.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight_encoding: ", weights.status().message()));
  }
  c.weights = *weights;
  return c;
}

}  // namespace shardps::worker
