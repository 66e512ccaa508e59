#include "common/chunking.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace shardps {

int64_t NumElements(const v1::TensorSpec& tensor) {
  int64_t n = 1;
  for (int64_t d : tensor.shape()) n *= d;
  return n;
}

namespace {

absl::Status ValidateTensor(const v1::TensorSpec& t, int index) {
  std::string where = absl::StrCat("tensor ", index, " (", t.name(), ")");
  if (t.name().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", index, " has an empty name"));
  }
  if (t.shape_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has no shape"));
  }
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has dimension ", d, " (must be >= 1)"));
    }
    if (n > kMaxModelElements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has over ", kMaxModelElements, " elements"));
    }
    n *= d;
  }
  const v1::InitSpec& init = t.init();
  if (!std::isfinite(init.value())) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " init value is not finite"));
  }
  if (!v1::InitSpec::Kind_IsValid(init.kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has unknown init kind ", init.kind()));
  }
  if ((init.kind() == v1::InitSpec::KIND_UNIFORM ||
       init.kind() == v1::InitSpec::KIND_NORMAL) &&
      init.value() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " init scale ", init.value(), " is negative"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLayout(const v1::Layout& layout) {
  if (layout.tensors_size() == 0) {
    return absl::InvalidArgumentError("layout has no tensors");
  }
  if (layout.chunk_bytes() % 4 != 0 || layout.chunk_bytes() > kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", layout.chunk_bytes(),
                     " must be a multiple of 4 and at most ", kMaxChunkBytes));
  }
  if (layout.chunk_count_multiple() > kMaxChunkCountMultiple) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_count_multiple ", layout.chunk_count_multiple(),
                     " is over ", kMaxChunkCountMultiple));
  }
  const float sparse = layout.sparse_weights_ratio();
  if (!(sparse >= 0 && sparse <= 1)) {  // NaN too
    return absl::InvalidArgumentError(
        absl::StrCat("sparse_weights_ratio ", sparse, " is not in [0, 1]"));
  }
  if (layout.sparse_weights_min_elements() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse_weights_min_elements ",
                     layout.sparse_weights_min_elements(), " is negative"));
  }
  absl::flat_hash_set<std::string> names;
  int64_t total = 0;
  int64_t num_chunks = 0;
  const int64_t max_elements = static_cast<int64_t>(ChunkBytes(layout) / 4);
  for (int i = 0; i < layout.tensors_size(); ++i) {
    const v1::TensorSpec& t = layout.tensors(i);
    if (absl::Status s = ValidateTensor(t, i); !s.ok()) return s;
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name \"", t.name(), "\" appears twice"));
    }
    total += NumElements(t);
    if (total > kMaxModelElements) {
      return absl::InvalidArgumentError(
          absl::StrCat("model has over ", kMaxModelElements, " elements"));
    }
    num_chunks +=
        ChunkCount(NumElements(t), max_elements, layout.chunk_count_multiple());
    if (num_chunks > kMaxChunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layout splits into over ", kMaxChunks,
          " chunks: raise chunk_bytes (now ", ChunkBytes(layout), ")"));
    }
  }
  return absl::OkStatus();
}

uint64_t ChunkBytes(const v1::Layout& layout) {
  return layout.chunk_bytes() == 0 ? kDefaultChunkBytes : layout.chunk_bytes();
}

uint64_t MinAutoChunkBytes(int64_t link_bits_per_second) {
  if (link_bits_per_second <= 0) return kMinAutoChunkBytes;
  const uint64_t in_link_time = static_cast<uint64_t>(
      link_bits_per_second / 8 * kAutoChunkLinkTimeUs / 1000000);
  uint64_t chunk = kMinSlowLinkChunkBytes;
  while (chunk < kMinAutoChunkBytes && chunk < in_link_time) chunk *= 2;
  return chunk;
}

uint64_t AutoChunkBytes(int64_t model_bytes, int64_t link_bits_per_second,
                        int wire_bytes_per_element) {
  // The rules are of wire bytes; a chunk is sized in fp32 bytes, `scale`
  // times its wire bytes.
  const uint64_t scale =
      wire_bytes_per_element == 1 || wire_bytes_per_element == 2
          ? static_cast<uint64_t>(4 / wire_bytes_per_element)
          : 1;
  const uint64_t wire_model =
      static_cast<uint64_t>(std::max<int64_t>(model_bytes, 0)) / scale;
  uint64_t chunk = MinAutoChunkBytes(link_bits_per_second);
  while (chunk < kMaxAutoChunkBytes &&
         chunk * 2 * kAutoChunksPerModel <= wire_model) {
    chunk *= 2;
  }
  return chunk * scale;
}

int64_t ModelBytes(const v1::Layout& layout) {
  int64_t bytes = 0;
  for (const v1::TensorSpec& t : layout.tensors()) bytes += NumElements(t) * 4;
  return bytes;
}

void ChooseChunkBytes(v1::Layout& layout, int64_t link_bits_per_second,
                      int wire_bytes_per_element) {
  if (layout.chunk_bytes() == 0) {
    layout.set_chunk_bytes(AutoChunkBytes(
        ModelBytes(layout), link_bits_per_second, wire_bytes_per_element));
    layout.set_chunk_count_multiple(kAutoChunkCountMultiple);
  }
}

int64_t ChunkCount(int64_t n, int64_t max_elements, uint32_t multiple) {
  int64_t count = (n + max_elements - 1) / max_elements;
  if (multiple > 1 && count >= multiple) {
    count = std::min(n, (count + multiple - 1) / multiple * multiple);
  }
  return count;
}

std::vector<ChunkSpec> MakeChunks(const v1::Layout& layout) {
  const int64_t max_elements = static_cast<int64_t>(ChunkBytes(layout) / 4);
  std::vector<ChunkSpec> chunks;
  for (int t = 0; t < layout.tensors_size(); ++t) {
    const int64_t n = NumElements(layout.tensors(t));
    const int64_t count =
        ChunkCount(n, max_elements, layout.chunk_count_multiple());
    const int64_t base = n / count;
    const int64_t extra = n % count;  // the first `extra` chunks get one more
    int64_t offset = 0;
    for (int64_t c = 0; c < count; ++c) {
      ChunkSpec spec;
      spec.id = static_cast<uint32_t>(chunks.size());
      spec.tensor = static_cast<uint32_t>(t);
      spec.offset = offset;
      spec.num_elements = base + (c < extra ? 1 : 0);
      offset += spec.num_elements;
      chunks.push_back(spec);
    }
  }
  return chunks;
}

uint64_t Fingerprint(const v1::Layout& layout,
                     const v1::OptimizerSpec& optimizer) {
  std::string bytes;
  {
    // Deterministic: these messages hold no maps.
    v1::DeclareRequest d;
    *d.mutable_layout() = layout;
    *d.mutable_optimizer() = optimizer;
    d.SerializeToString(&bytes);
  }
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace shardps
