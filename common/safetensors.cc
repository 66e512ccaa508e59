#include "common/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"

namespace shardps {
namespace {

// The format is little-endian; we copy floats and lengths as host bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors I/O assumes a little-endian host");

// The reference implementation refuses headers above 100 MB; so do we, which
// also bounds what a corrupt length field can make us parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr char kMetadataKey[] = "__metadata__";

std::string ErrnoText() {
  return std::error_code(errno, std::generic_category()).message();
}

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\t':
        out->append("\\t");
        break;
      case '\r':
        out->append("\\r");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(c);  // UTF-8 passes through unchanged.
        }
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

absl::Status WriteAll(int fd, const void* bytes, size_t n,
                      const std::string& path) {
  const char* p = static_cast<const char*>(bytes);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      return absl::InternalError(absl::StrCat("write ", path, ": ", ErrnoText()));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status WriteFile(int fd, const std::string& path,
                       const std::string& header,
                       const std::vector<SafetensorsTensor>& tensors) {
  const uint64_t header_len = header.size();
  SHARDPS_RETURN_IF_ERROR(WriteAll(fd, &header_len, 8, path));
  SHARDPS_RETURN_IF_ERROR(WriteAll(fd, header.data(), header.size(), path));
  for (const SafetensorsTensor& t : tensors) {
    size_t count = 1;
    for (const int64_t d : t.shape) count *= static_cast<size_t>(d);
    SHARDPS_RETURN_IF_ERROR(WriteAll(fd, t.data, 4 * count, path));
  }
  if (::fsync(fd) != 0) {
    return absl::InternalError(absl::StrCat("fsync ", path, ": ", ErrnoText()));
  }
  return absl::OkStatus();
}

// Makes a completed rename durable.
absl::Status SyncParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("open ", dir, ": ", ErrnoText()));
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("fsync ", dir, ": ", ErrnoText()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata) {
  SHARDPS_ASSIGN_OR_RETURN(const std::string header,
                           BuildHeader(tensors, metadata));
  const std::string tmp = path + ".tmp";
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("open ", tmp, ": ", ErrnoText()));
  }
  absl::Status status = WriteFile(fd, tmp, header, tensors);
  if (::close(fd) != 0 && status.ok()) {
    status = absl::InternalError(absl::StrCat("close ", tmp, ": ", ErrnoText()));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(
        absl::StrCat("rename ", tmp, " to ", path, ": ", ErrnoText()));
    ::unlink(tmp.c_str());
    return status;
  }
  return SyncParentDirectory(path);
}

}  // namespace shardps
