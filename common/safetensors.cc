#include "common/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/atomic_file.h"
#include "common/safetensors_json.h"
#include "common/status.h"

namespace shardps {
namespace {

using safetensors_internal::FindMember;
using safetensors_internal::Json;

// The format is little-endian; we copy floats and lengths as host bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors I/O assumes a little-endian host");

// The reference implementation refuses headers above 100 MB; so do we, which
// also bounds what a corrupt length field can make us parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr char kMetadataKey[] = "__metadata__";

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out->append(buf);
    } else {
      out->push_back(c);  // UTF-8 passes through unchanged.
    }
  }
  out->push_back('"');
}

// Builds the JSON header, padded with spaces to a multiple of 8 bytes.
absl::StatusOr<std::string> BuildHeader(
    const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    AppendJsonString(kMetadataKey, &json);
    json.append(":{");
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) json.push_back(',');
      first = false;
      AppendJsonString(key, &json);
      json.push_back(':');
      AppendJsonString(value, &json);
    }
    json.push_back('}');
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid tensor name \"", t.name, "\""));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate tensor name \"", t.name, "\""));
    }
    uint64_t count = 1;
    for (const int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", t.name, "\" has negative dimension ", d));
      }
      count *= static_cast<uint64_t>(d);
    }
    if (count > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name, "\" has null data"));
    }
    if (json.size() > 1) json.push_back(',');
    AppendJsonString(t.name, &json);
    absl::StrAppend(&json, ":{\"dtype\":\"F32\",\"shape\":[");
    for (size_t i = 0; i < t.shape.size(); ++i) {
      absl::StrAppend(&json, i == 0 ? "" : ",", t.shape[i]);
    }
    absl::StrAppend(&json, "],\"data_offsets\":[", offset, ",",
                    offset + 4 * count, "]}");
    offset += 4 * count;
  }
  json.push_back('}');
  json.append((8 - json.size() % 8) % 8, ' ');
  return json;
}

// A tensor's header entry; offsets are relative to the data section.
struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

absl::StatusOr<TensorEntry> ParseTensorEntry(const std::string& name,
                                             const Json& value) {
  const auto error = [&name](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": ", what));
  };
  if (value.type != Json::Type::kObject) return error("entry is not an object");
  const Json* dtype = FindMember(value, "dtype");
  const Json* shape = FindMember(value, "shape");
  const Json* offsets = FindMember(value, "data_offsets");
  if (dtype == nullptr || dtype->type != Json::Type::kString) {
    return error("missing dtype");
  }
  if (dtype->string_value != "F32") {
    return error(absl::StrCat("unsupported dtype ", dtype->string_value,
                              " (only F32 is supported)"));
  }
  if (shape == nullptr || shape->type != Json::Type::kArray) {
    return error("missing shape");
  }
  if (offsets == nullptr || offsets->type != Json::Type::kArray ||
      offsets->items.size() != 2 || !offsets->items[0].is_uint ||
      !offsets->items[1].is_uint) {
    return error("data_offsets must be two non-negative integers");
  }
  TensorEntry entry{
      name, {}, offsets->items[0].uint_value, offsets->items[1].uint_value};
  // Bound every product by 2^62 so that it cannot overflow.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
  uint64_t bytes = 4;
  for (const Json& dim : shape->items) {
    if (!dim.is_uint || dim.uint_value >= kMaxBytes) {
      return error("shape entries must be non-negative integers");
    }
    entry.shape.push_back(static_cast<int64_t>(dim.uint_value));
    if (dim.uint_value == 0 || bytes <= kMaxBytes / dim.uint_value) {
      bytes *= dim.uint_value;
    } else {
      bytes = kMaxBytes;  // cannot match any real offsets
    }
  }
  if (entry.begin > entry.end || entry.end - entry.begin != bytes) {
    return error(absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                              ") do not hold the ", bytes,
                              " bytes its shape needs"));
  }
  return entry;
}

absl::Status ParseMetadata(const Json& value,
                           std::map<std::string, std::string>* metadata) {
  if (value.type != Json::Type::kObject) {
    return absl::InvalidArgumentError("__metadata__ is not an object");
  }
  for (const auto& [key, v] : value.members) {
    if (v.type != Json::Type::kString) {
      return absl::InvalidArgumentError(
          absl::StrCat("__metadata__ value of \"", key, "\" is not a string"));
    }
    if (metadata != nullptr) (*metadata)[key] = v.string_value;
  }
  return absl::OkStatus();
}

// Parses the header and checks that the tensors tile the data section exactly,
// as the format requires. Returns the entries sorted by offset.
absl::StatusOr<std::vector<TensorEntry>> ParseHeader(
    absl::string_view header, uint64_t data_size,
    std::map<std::string, std::string>* metadata) {
  SHARDPS_ASSIGN_OR_RETURN(const Json root,
                           safetensors_internal::ParseJson(header));
  if (root.type != Json::Type::kObject) {
    return absl::InvalidArgumentError("header is not a JSON object");
  }
  std::vector<TensorEntry> entries;
  std::set<std::string> names;
  for (const auto& [name, value] : root.members) {
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate key \"", name, "\""));
    }
    if (name == kMetadataKey) {
      SHARDPS_RETURN_IF_ERROR(ParseMetadata(value, metadata));
      continue;
    }
    SHARDPS_ASSIGN_OR_RETURN(TensorEntry entry, ParseTensorEntry(name, value));
    entries.push_back(std::move(entry));
  }
  std::sort(entries.begin(), entries.end(),
            [](const TensorEntry& a, const TensorEntry& b) {
              return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
            });
  uint64_t expected_begin = 0;
  for (const TensorEntry& e : entries) {
    if (e.end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "truncated: tensor \"", e.name, "\" needs data bytes [", e.begin,
          ", ", e.end, ") but the data section has ", data_size, " bytes"));
    }
    if (e.begin != expected_begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", e.name, "\" starts at data byte ", e.begin,
                       ", expected ", expected_begin, " (overlap or gap)"));
    }
    expected_begin = e.end;
  }
  if (expected_begin != data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("data section has ", data_size, " bytes but the tensors ",
                     "cover ", expected_begin));
  }
  return entries;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const std::string why = ErrnoText(errno);
    return errno == ENOENT
               ? absl::NotFoundError(absl::StrCat(path, ": ", why))
               : absl::InternalError(absl::StrCat("open ", path, ": ", why));
  }
  std::string bytes;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::InternalError(absl::StrCat("read ", path));
  return bytes;
}

absl::StatusOr<std::vector<LoadedTensor>> ParseFile(
    absl::string_view bytes, std::map<std::string, std::string>* metadata) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "truncated: ", bytes.size(), " bytes, need 8 for the header length"));
  }
  uint64_t header_len = 0;  // little-endian
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  }
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header length ", header_len, " exceeds ", kMaxHeaderBytes));
  }
  if (8 + header_len > bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated: header length is ", header_len,
                     " bytes but only ", bytes.size() - 8, " follow"));
  }
  const absl::string_view data = bytes.substr(8 + header_len);
  SHARDPS_ASSIGN_OR_RETURN(
      const std::vector<TensorEntry> entries,
      ParseHeader(bytes.substr(8, header_len), data.size(), metadata));
  std::vector<LoadedTensor> tensors;
  tensors.reserve(entries.size());
  for (const TensorEntry& e : entries) {
    LoadedTensor t{e.name, e.shape, std::vector<float>((e.end - e.begin) / 4)};
    std::memcpy(t.data.data(), data.data() + e.begin, e.end - e.begin);
    tensors.push_back(std::move(t));
  }
  return tensors;
}

}  // namespace

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  SHARDPS_ASSIGN_OR_RETURN(const std::string header,
                           BuildHeader(tensors, metadata));
  const uint64_t header_len = header.size();  // little-endian on disk
  std::vector<absl::string_view> pieces = {
      absl::string_view(reinterpret_cast<const char*>(&header_len), 8), header};
  for (const SafetensorsTensor& t : tensors) {
    size_t count = 1;
    for (const int64_t d : t.shape) count *= static_cast<size_t>(d);
    pieces.emplace_back(reinterpret_cast<const char*>(t.data), 4 * count);
  }
  const absl::Status written = WriteFileAtomically(path, pieces);
  // Every I/O failure is Internal here (the header's contract), whatever
  // the errno.
  if (!written.ok()) return absl::InternalError(written.message());
  return written;
}

absl::StatusOr<std::vector<LoadedTensor>> ReadSafetensors(
    const std::string& path, std::map<std::string, std::string>* metadata) {
  SHARDPS_ASSIGN_OR_RETURN(const std::string bytes, ReadWholeFile(path));
  std::map<std::string, std::string> read_metadata;
  absl::StatusOr<std::vector<LoadedTensor>> tensors =
      ParseFile(bytes, &read_metadata);
  if (!tensors.ok()) {
    return WithPrefix(path, tensors.status());
  }
  if (metadata != nullptr) *metadata = std::move(read_metadata);
  return tensors;
}

}  // namespace shardps
