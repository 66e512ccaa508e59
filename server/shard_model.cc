#include "server/shard_model.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/tensor_init.h"

namespace shardps::server {

absl::StatusOr<Chunk*> ShardModel::Find(uint32_t chunk_id) const {
  if (chunk_id >= all_chunks.size()) {
    return absl::NotFoundError(absl::StrCat("chunk ", chunk_id,
                                            " is not declared (the layout has ",
                                            all_chunks.size(), " chunks)"));
  }
  Chunk* chunk = chunks[chunk_id].get();
  if (chunk == nullptr) {
    const ChunkSpec& spec = all_chunks[chunk_id];
    return absl::NotFoundError(absl::StrCat(
        "chunk ", chunk_id, " (",
        declaration.layout().tensors(spec.tensor).name(), ") belongs to shard ",
        shard_of[chunk_id], ", not ", shard_index));
  }
  return chunk;
}

void ShardModel::StopAwaiting(Chunk* chunk) {
  if (!chunk->awaiting_values) return;
  chunk->awaiting_values = false;
  num_awaiting.fetch_sub(1, std::memory_order_release);
}

std::vector<Chunk*> ShardModel::ChunksById() const {
  std::vector<Chunk*> by_id(chunks.size(), nullptr);
  for (Chunk* chunk : owned) by_id[chunk->spec.id] = chunk;
  return by_id;
}

absl::StatusOr<std::unique_ptr<ShardModel>> BuildShardModel(
    const v1::DeclareRequest& req, uint32_t shard_index, uint32_t num_shards) {
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(req.layout()));
  auto model = std::make_unique<ShardModel>();
  SHARDPS_ASSIGN_OR_RETURN(model->optimizers, TensorOptimizers::Create(req));
  model->shard_index = shard_index;
  model->declaration = req;
  model->fingerprint = Fingerprint(req.layout(), req.optimizer());
  model->all_chunks = MakeChunks(req.layout());
  model->shard_of = PartitionChunks(model->all_chunks, num_shards);
  model->chunks.resize(model->all_chunks.size());
  for (size_t i = 0; i < model->all_chunks.size(); ++i) {
    if (model->shard_of[i] != shard_index) continue;
    const ChunkSpec& spec = model->all_chunks[i];
    const v1::TensorSpec& tensor = req.layout().tensors(spec.tensor);
    auto chunk = std::make_unique<Chunk>();
    chunk->spec = spec;
    chunk->tensor_name = tensor.name();
    chunk->optimizer = &model->optimizers.of(spec.tensor);
    absl::MutexLock lock(&chunk->mu);
    chunk->weights = std::make_shared<std::vector<float>>(spec.num_elements);
    if (tensor.init().kind() == v1::InitSpec::KIND_PROVIDED) {
      // Zeros until a worker sends the values (PushArgs::initial_values).
      chunk->awaiting_values = true;
      model->num_awaiting.fetch_add(1, std::memory_order_relaxed);
    } else {
      FillInit(tensor.init(), spec.tensor, spec.offset, chunk->weights->data(),
               spec.num_elements);
    }
    if (spec.num_elements >= req.layout().sparse_weights_min_elements()) {
      chunk->sparse_ratio = req.layout().sparse_weights_ratio();
    }
    ResetWorkerCopy(chunk.get());
    chunk->slots.assign(chunk->optimizer->num_slots(),
                        std::vector<float>(spec.num_elements));
    std::vector<float*> slot_ptrs;
    for (auto& s : chunk->slots) slot_ptrs.push_back(s.data());
    chunk->optimizer->InitSlots(slot_ptrs, spec.num_elements);
    model->owned_bytes += spec.bytes();
    model->owned.push_back(chunk.get());
    model->chunks[i] = std::move(chunk);
  }
  return model;
}

absl::Status CheckSavedChunks(const ShardModel& model,
                              const std::vector<ChunkState>& chunks) {
  if (chunks.size() != model.owned.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint holds ", chunks.size(), " chunks for shard ",
                     model.shard_index, ", which owns ", model.owned.size()));
  }
  std::vector<bool> seen(model.chunks.size(), false);
  for (const ChunkState& saved : chunks) {
    const Chunk* chunk = saved.chunk_id < model.chunks.size()
                             ? model.chunks[saved.chunk_id].get()
                             : nullptr;
    if (chunk != nullptr && seen[saved.chunk_id]) chunk = nullptr;
    if (chunk != nullptr) seen[saved.chunk_id] = true;
    if (saved.version < 0 || saved.version != chunks.front().version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint chunk ", saved.chunk_id, " is at step ", saved.version,
          ", not at the checkpoint's step ", chunks.front().version));
    }
    if (chunk == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint chunk ", saved.chunk_id,
                       " is not owned by shard ", model.shard_index));
    }
    bool sizes_ok =
        saved.weights.size() == static_cast<size_t>(chunk->spec.num_elements) &&
        saved.slots.size() ==
            static_cast<size_t>(chunk->optimizer->num_slots());
    for (const std::vector<float>& slot : saved.slots) {
      sizes_ok = sizes_ok && slot.size() == saved.weights.size();
    }
    if (!sizes_ok) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint chunk ", saved.chunk_id, " (", chunk->tensor_name,
          ") has another size or optimizer state than the "
          "declaration"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardps::server
