#include "server/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/atomic_file.h"
#include "common/checkpoint_steps.h"
#include "common/chunking.h"
#include "common/crc32c.h"
#include "common/partitioner.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "server/optimizer.h"

namespace shardps::server {
namespace {

namespace fs = std::filesystem;

constexpr char kManifestMagic[] = "shardps-checkpoint 1";
// A manifest lists a few lines per shard; anything bigger is garbage.
constexpr size_t kMaxManifestBytes = 1 << 20;

// Reads the whole file, or its first `limit` bytes, and computes the CRC32C
// and size of the whole file. NotFound when it does not exist.
struct FileScan {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  std::string prefix;  // the first min(bytes, limit) bytes
};
absl::StatusOr<FileScan> ScanFile(const std::string& path, size_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return FileError("open", path, errno);
  std::unique_ptr<char[]> buf(new char[1 << 20]);
  FileScan scan;
  for (;;) {
    const ssize_t n = ::read(fd, buf.get(), 1 << 20);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return FileError("read", path, err);
    }
    if (n == 0) break;
    if (scan.prefix.size() < limit) {
      scan.prefix.append(buf.get(), std::min(static_cast<size_t>(n),
                                             limit - scan.prefix.size()));
    }
    scan.crc32c = Crc32c(scan.crc32c, buf.get(), static_cast<size_t>(n));
    scan.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return scan;
}

std::string ShardFileName(uint32_t shard_index, uint32_t num_shards) {
  return absl::StrCat("shard-", shard_index, "-of-", num_shards,
                      ".safetensors");
}

std::string TensorName(uint32_t chunk_id, int slot) {
  return slot < 0 ? absl::StrCat("chunk.", chunk_id, ".weights")
                  : absl::StrCat("chunk.", chunk_id, ".slot", slot);
}

// What every party derives from a declaration.
struct ModelPlan {
  std::vector<ChunkSpec> chunks;  // indexed by chunk id
  // Optimizer slots of each chunk (its tensor's optimizer), by chunk id.
  std::vector<int> num_slots;
  uint64_t fingerprint = 0;
};

absl::StatusOr<ModelPlan> PlanModel(const v1::DeclareRequest& declaration) {
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(declaration.layout()));
  SHARDPS_ASSIGN_OR_RETURN(const TensorOptimizers optimizers,
                           TensorOptimizers::Create(declaration));
  ModelPlan plan{MakeChunks(declaration.layout()),
                 {},
                 Fingerprint(declaration.layout(), declaration.optimizer())};
  for (const ChunkSpec& spec : plan.chunks) {
    plan.num_slots.push_back(optimizers.of(spec.tensor).num_slots());
  }
  return plan;
}

absl::Status CheckShardView(uint32_t shard_index, uint32_t num_shards) {
  if (num_shards >= 1 && shard_index < num_shards) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "shard index ", shard_index, " is not below num_shards ", num_shards));
}

// Checks that `chunks` are exactly the chunks the shard owns, with the right
// sizes; returns them in chunk id order.
absl::StatusOr<std::vector<const ChunkState*>> OrderOwnedChunks(
    const ModelPlan& plan, uint32_t shard_index, uint32_t num_shards,
    const std::vector<ChunkState>& chunks) {
  const std::vector<uint32_t> owner = PartitionChunks(plan.chunks, num_shards);
  std::vector<const ChunkState*> by_id(plan.chunks.size(), nullptr);
  for (const ChunkState& c : chunks) {
    const std::string what = absl::StrCat("chunk ", c.chunk_id);
    if (c.chunk_id >= by_id.size() || owner[c.chunk_id] != shard_index) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not owned by shard ", shard_index, " of ", num_shards));
    }
    if (by_id[c.chunk_id] != nullptr) {
      return absl::InvalidArgumentError(what + " is given twice");
    }
    const size_t n = static_cast<size_t>(plan.chunks[c.chunk_id].num_elements);
    const int num_slots = plan.num_slots[c.chunk_id];
    bool sizes_ok = c.weights.size() == n &&
                    c.slots.size() == static_cast<size_t>(num_slots);
    for (const std::vector<float>& slot : c.slots) {
      sizes_ok = sizes_ok && slot.size() == n;
    }
    if (!sizes_ok) {
      return absl::InvalidArgumentError(absl::StrCat(what, " needs ", n,
                                                     " weights and ", num_slots,
                                                     " slots of that length"));
    }
    by_id[c.chunk_id] = &c;
  }
  std::vector<const ChunkState*> ordered;
  for (uint32_t id = 0; id < by_id.size(); ++id) {
    if (owner[id] != shard_index) continue;
    if (by_id[id] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", id, " of shard ", shard_index, " is missing"));
    }
    ordered.push_back(by_id[id]);
  }
  return ordered;
}

// Creates the step directory and makes sure it is writable and uncommitted.
absl::Status PrepareStepDirectory(const std::string& step_dir) {
  std::error_code ec;
  fs::create_directories(step_dir, ec);
  if (ec) return FileError("create directory", step_dir, ec.value());
  if (::access(step_dir.c_str(), W_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint directory ", step_dir,
                     " is not writable: ", ErrnoText(errno)));
  }
  const std::string manifest = absl::StrCat(step_dir, "/", kCommittedManifest);
  if (::unlink(manifest.c_str()) == 0) return SyncDirectory(step_dir);
  return errno == ENOENT ? absl::OkStatus()
                         : FileError("unlink", manifest, errno);
}

// The whole file's size and CRC32C, from its header (read back) and the CRC
// of the data section computed while writing: no second pass over the data.
absl::Status FinishShardFile(const std::string& path, uint32_t data_crc,
                             uint64_t data_bytes, ShardFile* file) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return FileError("open", path, errno);
  uint64_t header_len = 0;
  std::string head(8, '\0');
  struct stat st;
  bool ok = ::pread(fd, head.data(), 8, 0) == 8 && ::fstat(fd, &st) == 0;
  if (ok) {
    std::memcpy(&header_len, head.data(), 8);
    ok = static_cast<uint64_t>(st.st_size) == 8 + header_len + data_bytes;
  }
  if (ok) {
    head.resize(8 + header_len);
    ok = ::pread(fd, head.data() + 8, header_len, 8) ==
         static_cast<ssize_t>(header_len);
  }
  ::close(fd);
  if (!ok) {
    return absl::InternalError(
        absl::StrCat(path, " does not hold the header and ", data_bytes,
                     " data bytes just written"));
  }
  file->bytes = head.size() + data_bytes;
  file->crc32c =
      Crc32cCombine(Crc32c(0, head.data(), head.size()), data_crc, data_bytes);
  return absl::OkStatus();
}

std::string FormatManifest(int64_t step, uint32_t num_shards,
                           uint64_t fingerprint,
                           const std::vector<const ShardFile*>& files) {
  std::string text =
      absl::StrFormat("%s\nstep %d\nnum_shards %d\nfingerprint %016x\n",
                      kManifestMagic, step, num_shards, fingerprint);
  for (const ShardFile* f : files) {
    absl::StrAppendFormat(&text, "shard %d %s %d %08x\n", f->shard_index,
                          f->name, f->bytes, f->crc32c);
  }
  return text + "end\n";
}

// `digits` lowercase or uppercase hex digits, nothing else.
template <typename T>
bool ParseHex(absl::string_view s, size_t digits, T* out) {
  return s.size() == digits &&
         std::all_of(s.begin(), s.end(), absl::ascii_isxdigit) &&
         absl::SimpleHexAtoi(s, out);
}

// "<key> <decimal>".
template <typename T>
bool ParseField(absl::string_view line, absl::string_view key, T* out) {
  return absl::ConsumePrefix(&line, key) && absl::ConsumePrefix(&line, " ") &&
         absl::SimpleAtoi(line, out);
}

// Parses what FormatManifest wrote; `files` come out indexed by shard index.
absl::StatusOr<CheckpointInfo> ParseManifest(absl::string_view text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  CheckpointInfo info;
  const size_t n = lines.size();
  if (n < 7 || lines[0] != kManifestMagic || lines[n - 2] != "end" ||
      !lines[n - 1].empty() || !ParseField(lines[1], "step", &info.step) ||
      !ParseField(lines[2], "num_shards", &info.num_shards) ||
      !absl::ConsumePrefix(&lines[3], "fingerprint ") ||
      !ParseHex(lines[3], 16, &info.fingerprint) ||
      n != size_t{info.num_shards} + 6) {
    return absl::DataLossError("malformed COMMITTED manifest");
  }
  for (uint32_t i = 0; i < info.num_shards; ++i) {
    const std::vector<absl::string_view> f = absl::StrSplit(lines[4 + i], ' ');
    ShardFile file{info.step, i, info.num_shards, info.fingerprint,
                   ShardFileName(i, info.num_shards)};
    uint32_t index = 0;
    // The name must be the expected one, which also keeps paths inside the
    // step directory.
    if (f.size() != 5 || f[0] != "shard" || !absl::SimpleAtoi(f[1], &index) ||
        index != i || f[2] != file.name ||
        !absl::SimpleAtoi(f[3], &file.bytes) ||
        !ParseHex(f[4], 8, &file.crc32c)) {
      return absl::DataLossError(
          absl::StrCat("malformed COMMITTED manifest line ", 5 + i));
    }
    info.files.push_back(std::move(file));
  }
  return info;
}

// The checkpoint in dir/name if its manifest and every file check out.
absl::StatusOr<CheckpointInfo> VerifyStep(const std::string& dir, int64_t step,
                                          const std::string& name) {
  const std::string step_dir = absl::StrCat(dir, "/", name);
  absl::StatusOr<FileScan> manifest = ScanFile(
      absl::StrCat(step_dir, "/", kCommittedManifest), kMaxManifestBytes);
  if (absl::IsNotFound(manifest.status())) {
    return absl::NotFoundError("no COMMITTED manifest (in progress or torn)");
  }
  if (!manifest.ok()) return manifest.status();
  SHARDPS_ASSIGN_OR_RETURN(CheckpointInfo info,
                           ParseManifest(manifest->prefix));
  if (info.step != step) {
    return absl::DataLossError(
        absl::StrCat("COMMITTED manifest is for step ", info.step));
  }
  info.step_dir = step_dir;
  for (const ShardFile& f : info.files) {
    SHARDPS_ASSIGN_OR_RETURN(const FileScan scan,
                             ScanFile(absl::StrCat(step_dir, "/", f.name), 0));
    if (scan.bytes != f.bytes || scan.crc32c != f.crc32c) {
      return absl::DataLossError(absl::StrFormat(
          "%s has %d bytes with CRC32C %08x; the manifest lists %d bytes "
          "with %08x",
          f.name, scan.bytes, scan.crc32c, f.bytes, f.crc32c));
    }
  }
  return info;
}

// Removes a step directory, manifest first so that a partly removed
// directory never reads as committed.
absl::Status RemoveStep(const std::string& dir, const std::string& name) {
  const std::string step_dir = absl::StrCat(dir, "/", name);
  ::unlink(absl::StrCat(step_dir, "/", kCommittedManifest).c_str());
  std::error_code ec;
  fs::remove_all(step_dir, ec);
  // Another shard pruning the same directory at once is not an error.
  if (ec == std::errc::no_such_file_or_directory) return absl::OkStatus();
  return ec ? FileError("remove", step_dir, ec.value()) : absl::OkStatus();
}

// Parses the "versions" metadata ("id:version,...") of the file at `path`.
absl::StatusOr<std::map<uint32_t, int64_t>> ParseVersions(
    const std::string& path, absl::string_view text) {
  std::map<uint32_t, int64_t> versions;
  for (absl::string_view pair : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(pair, absl::MaxSplits(':', 1));
    uint32_t id = 0;
    int64_t version = 0;
    if (!absl::SimpleAtoi(kv.first, &id) ||
        !absl::SimpleAtoi(kv.second, &version)) {
      return absl::DataLossError(
          absl::StrCat(path, ": bad versions entry \"", pair, "\""));
    }
    versions[id] = version;
  }
  return versions;
}

// Checks a shard file against its manifest entry and its data CRC, then
// moves the states of chunks `ids` out of it into `out`.
absl::Status ReadChunksFromFile(const CheckpointInfo& ckpt,
                                const ShardFile& file, const ModelPlan& plan,
                                const std::vector<uint32_t>& ids,
                                std::vector<ChunkState>* out) {
  const std::string path = absl::StrCat(ckpt.step_dir, "/", file.name);
  std::map<std::string, std::string> md;
  absl::StatusOr<std::vector<LoadedTensor>> tensors =
      ReadSafetensors(path, &md);
  if (!tensors.ok()) {
    return absl::DataLossError(std::string(tensors.status().message()));
  }
  uint32_t crc = 0;
  std::map<std::string, std::vector<float>*> by_name;
  for (LoadedTensor& t : *tensors) {
    crc = Crc32c(crc, t.data.data(), 4 * t.data.size());
    by_name[t.name] = &t.data;
  }
  if (md["step"] != absl::StrCat(ckpt.step) ||
      md["shard_index"] != absl::StrCat(file.shard_index) ||
      md["num_shards"] != absl::StrCat(ckpt.num_shards) ||
      md["fingerprint"] != absl::StrFormat("%016x", ckpt.fingerprint) ||
      md["crc32c"] != absl::StrFormat("%08x", crc)) {
    return absl::DataLossError(absl::StrCat(
        path, ": metadata or data CRC32C does not match the checkpoint"));
  }
  SHARDPS_ASSIGN_OR_RETURN(const auto versions,
                           ParseVersions(path, md["versions"]));
  SHARDPS_ASSIGN_OR_RETURN(const auto skipped,
                           ParseVersions(path, md["skipped"]));
  for (const uint32_t id : ids) {
    const auto version = versions.find(id);
    if (version == versions.end()) {
      return absl::DataLossError(
          absl::StrCat(path, ": chunk ", id, " has no version"));
    }
    ChunkState state{id, version->second, {}, {}};
    if (const auto it = skipped.find(id); it != skipped.end()) {
      state.skipped_updates = it->second;
    }
    const size_t n = static_cast<size_t>(plan.chunks[id].num_elements);
    for (int slot = -1; slot < plan.num_slots[id]; ++slot) {
      const auto it = by_name.find(TensorName(id, slot));
      if (it == by_name.end() || it->second->size() != n) {
        return absl::DataLossError(absl::StrCat(path, ": chunk ", id, " lacks ",
                                                TensorName(id, slot), " of ", n,
                                                " elements"));
      }
      (slot < 0 ? state.weights : state.slots.emplace_back()) =
          std::move(*it->second);
    }
    out->push_back(std::move(state));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::DeclareRequest> CheckpointDeclaration(
    const CheckpointInfo& ckpt) {
  if (ckpt.files.empty()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", ckpt.step_dir, " lists no files"));
  }
  const std::string path = absl::StrCat(ckpt.step_dir, "/", ckpt.files[0].name);
  std::map<std::string, std::string> md;
  absl::StatusOr<std::vector<LoadedTensor>> read = ReadSafetensors(path, &md);
  if (!read.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", read.status().message()));
  }
  std::string bytes;
  v1::DeclareRequest declaration;
  if (!absl::Base64Unescape(md["declaration"], &bytes) ||
      !declaration.ParseFromString(bytes)) {
    return absl::DataLossError(
        absl::StrCat(path, ": no readable model declaration in its metadata"));
  }
  return declaration;
}

absl::StatusOr<ShardFile> DescribeShardFile(const std::string& dir,
                                            int64_t step, uint32_t shard_index,
                                            uint32_t num_shards) {
  ShardFile f;
  f.step = step;
  f.shard_index = shard_index;
  f.num_shards = num_shards;
  f.name = ShardFileName(shard_index, num_shards);
  const std::string path = absl::StrCat(StepDirectory(dir, step), "/", f.name);
  if (::access(path.c_str(), F_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  }
  std::map<std::string, std::string> md;
  absl::StatusOr<std::vector<LoadedTensor>> read = ReadSafetensors(path, &md);
  if (!read.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", read.status().message()));
  }
  if (!ParseHex(md["fingerprint"], 16, &f.fingerprint)) {
    return absl::DataLossError(absl::StrCat(path, ": bad fingerprint"));
  }
  SHARDPS_ASSIGN_OR_RETURN(FileScan scan, ScanFile(path, 0));
  f.bytes = scan.bytes;
  f.crc32c = scan.crc32c;
  return f;
}

absl::StatusOr<ShardFile> WriteShardCheckpoint(
    const std::string& dir, int64_t step, uint32_t shard_index,
    uint32_t num_shards, const v1::DeclareRequest& declaration,
    const std::vector<ChunkState>& chunks) {
  SHARDPS_RETURN_IF_ERROR(CheckShardView(shard_index, num_shards));
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative step ", step));
  }
  SHARDPS_ASSIGN_OR_RETURN(const ModelPlan plan, PlanModel(declaration));
  SHARDPS_ASSIGN_OR_RETURN(
      const std::vector<const ChunkState*> ordered,
      OrderOwnedChunks(plan, shard_index, num_shards, chunks));
  const std::string step_dir = StepDirectory(dir, step);
  SHARDPS_RETURN_IF_ERROR(PrepareStepDirectory(step_dir));

  std::vector<SafetensorsTensor> tensors;
  std::vector<std::string> versions;
  std::vector<std::string> skipped;
  uint32_t data_crc = 0;  // tensors are written contiguously in this order
  uint64_t data_bytes = 0;
  for (const ChunkState* c : ordered) {
    versions.push_back(absl::StrCat(c->chunk_id, ":", c->version));
    if (c->skipped_updates != 0) {
      skipped.push_back(absl::StrCat(c->chunk_id, ":", c->skipped_updates));
    }
    for (int slot = -1; slot < plan.num_slots[c->chunk_id]; ++slot) {
      const std::vector<float>& v = slot < 0 ? c->weights : c->slots[slot];
      tensors.push_back({TensorName(c->chunk_id, slot),
                         {static_cast<int64_t>(v.size())},
                         v.data()});
      data_crc = Crc32c(data_crc, v.data(), 4 * v.size());
      data_bytes += 4 * v.size();
    }
  }
  v1::DeclareRequest model = declaration;
  model.clear_num_shards();  // the model, not this shard's view of it
  model.clear_shard_index();
  std::map<std::string, std::string> metadata = {
      {"step", absl::StrCat(step)},
      {"shard_index", absl::StrCat(shard_index)},
      {"num_shards", absl::StrCat(num_shards)},
      {"fingerprint", absl::StrFormat("%016x", plan.fingerprint)},
      {"declaration", absl::Base64Escape(model.SerializeAsString())},
      {"versions", absl::StrJoin(versions, ",")},
      {"crc32c", absl::StrFormat("%08x", data_crc)}};
  if (!skipped.empty()) metadata["skipped"] = absl::StrJoin(skipped, ",");
  ShardFile file{step, shard_index, num_shards, plan.fingerprint,
                 ShardFileName(shard_index, num_shards)};
  const std::string path = absl::StrCat(step_dir, "/", file.name);
  SHARDPS_RETURN_IF_ERROR(WriteSafetensors(path, tensors, metadata));
  SHARDPS_RETURN_IF_ERROR(FinishShardFile(path, data_crc, data_bytes, &file));
  return file;
}

absl::Status CommitCheckpoint(const std::string& dir, int64_t step,
                              uint32_t num_shards,
                              const std::vector<ShardFile>& files) {
  if (step < 0 || num_shards == 0 || files.size() != num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit of step ", step, " needs one file per shard of ",
                     num_shards, ", got ", files.size()));
  }
  const std::string step_dir = StepDirectory(dir, step);
  std::vector<const ShardFile*> by_index(num_shards, nullptr);
  for (const ShardFile& f : files) {
    if (f.step != step || f.num_shards != num_shards ||
        f.shard_index >= num_shards || by_index[f.shard_index] != nullptr ||
        f.fingerprint != files[0].fingerprint ||
        f.name != ShardFileName(f.shard_index, num_shards)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard file ", f.name, " (step ", f.step, ", shard ", f.shard_index,
          " of ", f.num_shards, ") does not fit step ", step, " of ",
          num_shards, " shards, one file each, one fingerprint"));
    }
    by_index[f.shard_index] = &f;
    const std::string path = absl::StrCat(step_dir, "/", f.name);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 ||
        static_cast<uint64_t>(st.st_size) != f.bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is missing or is not ", f.bytes, " bytes long"));
    }
  }
  return WriteFileAtomically(
      absl::StrCat(step_dir, "/", kCommittedManifest),
      FormatManifest(step, num_shards, files[0].fingerprint, by_index));
}

absl::StatusOr<CheckpointInfo> LatestCommitted(const std::string& dir) {
  SHARDPS_ASSIGN_OR_RETURN(const auto steps, ListStepDirectories(dir));
  std::vector<std::string> skipped;
  for (const auto& [step, name] : steps) {
    absl::StatusOr<CheckpointInfo> info = VerifyStep(dir, step, name);
    if (info.ok()) {
      info->skipped = std::move(skipped);
      return info;
    }
    skipped.push_back(absl::StrCat(name, ": ", info.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", dir,
                                          skipped.empty() ? "" : "; skipped ",
                                          absl::StrJoin(skipped, "; ")));
}

absl::StatusOr<CheckpointInfo> CommittedAt(const std::string& dir,
                                           int64_t step) {
  const std::string step_dir = StepDirectory(dir, step);
  return VerifyStep(dir, step, step_dir.substr(dir.size() + 1));
}

absl::StatusOr<std::vector<ChunkState>> LoadChunksForShard(
    const CheckpointInfo& ckpt, uint32_t shard_index, uint32_t num_shards,
    const v1::DeclareRequest& declaration) {
  SHARDPS_RETURN_IF_ERROR(CheckShardView(shard_index, num_shards));
  SHARDPS_ASSIGN_OR_RETURN(const ModelPlan plan, PlanModel(declaration));
  if (plan.fingerprint != ckpt.fingerprint) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %s is of a different model: its fingerprint is %016x, "
        "the declaration's %016x (tensors, optimizer and chunk size count; "
        "automatic chunks depend on the workers' --link_rate and on "
        "whether their --compression and --weight_encoding take 2 bytes an "
        "element: restart them with the --chunk_kib or --link_rate and "
        "encodings (Python: chunk_bytes, link_rate, compression, "
        "weight_encoding) it was written with)",
        ckpt.step_dir, ckpt.fingerprint, plan.fingerprint));
  }
  if (ckpt.num_shards == 0 || ckpt.files.size() != ckpt.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", ckpt.step_dir, " lists ", ckpt.files.size(),
                     " files for ", ckpt.num_shards, " shards"));
  }
  // Placement is a pure function of (chunks, shard count), so the file that
  // holds each chunk is known without opening any.
  const std::vector<uint32_t> owner = PartitionChunks(plan.chunks, num_shards);
  const std::vector<uint32_t> writer =
      PartitionChunks(plan.chunks, ckpt.num_shards);
  std::map<uint32_t, std::vector<uint32_t>> ids_by_file;
  for (uint32_t id = 0; id < owner.size(); ++id) {
    if (owner[id] == shard_index) ids_by_file[writer[id]].push_back(id);
  }
  std::vector<ChunkState> out;
  for (const auto& [file_index, ids] : ids_by_file) {
    SHARDPS_RETURN_IF_ERROR(
        ReadChunksFromFile(ckpt, ckpt.files[file_index], plan, ids, &out));
  }
  std::sort(out.begin(), out.end(),
            [](const ChunkState& a, const ChunkState& b) {
              return a.chunk_id < b.chunk_id;
            });
  return out;
}

absl::Status PruneCheckpoints(const std::string& dir, int keep) {
  if (keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("keep ", keep, " < 1"));
  }
  SHARDPS_ASSIGN_OR_RETURN(const auto steps, ListStepDirectories(dir));
  int kept = 0;
  for (const auto& [step, name] : steps) {
    if (kept == keep) {
      SHARDPS_RETURN_IF_ERROR(RemoveStep(dir, name));
    } else if (VerifyStep(dir, step, name).ok()) {
      ++kept;
    } else if (kept > 0) {
      // Torn, and older than a valid checkpoint: nothing will finish it.
      SHARDPS_RETURN_IF_ERROR(RemoveStep(dir, name));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardps::server
