#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"

namespace shardps {
namespace {

// Writes all of `bytes` to `fd`; false (errno set) on failure.
bool WriteAll(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t w = ::write(fd, bytes.data(), bytes.size());
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return false;
    bytes.remove_prefix(static_cast<size_t>(w));
  }
  return true;
}

std::string ParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status FileError(absl::string_view op, const std::string& path, int err) {
  const std::string msg =
      absl::StrCat(op, " ", path, ": ",
                   std::error_code(err, std::generic_category()).message());
  switch (err) {
    case EACCES:
    case EPERM:
    case EROFS:
    case ENOTDIR:
    case EEXIST:
      return absl::FailedPreconditionError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FileError("open", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : FileError("fsync", dir, err);
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::Span<const absl::string_view> pieces) {
  // Unique per writer: two shards may commit the same step at once (they
  // write the same manifest; the last rename wins).
  const std::string tmp =
      absl::StrCat(path, ".tmp.", ::getpid(), ".",
                   std::hash<std::thread::id>()(std::this_thread::get_id()));
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return FileError("open", tmp, errno);
  bool ok = true;
  for (const absl::string_view piece : pieces) {
    if (!WriteAll(fd, piece)) {
      ok = false;
      break;
    }
  }
  const char* failed = ok ? nullptr : "write";
  if (ok && ::fsync(fd) != 0) failed = "fsync";
  int err = errno;
  if (::close(fd) != 0 && failed == nullptr) {
    failed = "close";
    err = errno;
  }
  if (failed != nullptr) {
    ::unlink(tmp.c_str());
    return FileError(failed, tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    return FileError("rename", absl::StrCat(tmp, " to ", path), err);
  }
  return SyncDirectory(ParentDirectory(path));
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents) {
  return WriteFileAtomically(path, absl::MakeConstSpan(&contents, 1));
}

}  // namespace shardps
