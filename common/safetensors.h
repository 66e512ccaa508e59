// Reads and writes float32 tensors in the safetensors format (an 8-byte
// little-endian header length, a JSON header, then raw little-endian data), so
// checkpoints and exported models load in common tools. Stateless functions;
// safe to call from any thread on distinct paths.
#ifndef SHARDPS_COMMON_SAFETENSORS_H_
#define SHARDPS_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardps {

// A tensor to write. Borrows `data`, which holds product(shape) floats
// (row-major) and must stay valid during the WriteSafetensors call.
struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// A tensor read back from a file; owns its values.
struct LoadedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Writes `tensors` (dtype F32, in the given order, contiguous) and the string
// pairs in `metadata` (as "__metadata__") to `path` with WriteFileAtomically
// (common/atomic_file.h), so a reader sees the old file or the whole new one.
// InvalidArgument for an empty or duplicate name, the reserved name
// "__metadata__", a negative dimension or null data; Internal for I/O errors
// (with errno text).
absl::Status WriteSafetensors(
    const std::string& path, const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata);

// Reads every tensor of `path`, in data-offset order. Stores the
// "__metadata__" pairs in `*metadata` when it is not null. NotFound if the file
// does not exist (Internal for other open/read errors); InvalidArgument (naming
// the file) for a truncated file, a malformed header, overlapping or
// out-of-range data offsets, a shape that does not match its byte size, or a
// dtype other than F32.
absl::StatusOr<std::vector<LoadedTensor>> ReadSafetensors(
    const std::string& path,
    std::map<std::string, std::string>* metadata = nullptr);

}  // namespace shardps

#endif  // SHARDPS_COMMON_SAFETENSORS_H_
