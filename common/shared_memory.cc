#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace shardps {
namespace {

// True for "/proc/<digits>/fd/<digits>".
bool IsProcFdPath(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, "/proc/")) return false;
  std::vector<absl::string_view> parts = absl::StrSplit(path, '/');
  uint64_t n;
  return parts.size() == 3 && parts[1] == "fd" && !parts[0].empty() &&
         !parts[2].empty() &&
         parts[0].find_first_not_of("0123456789") == absl::string_view::npos &&
         parts[2].find_first_not_of("0123456789") == absl::string_view::npos &&
         absl::SimpleAtoi(parts[0], &n) && absl::SimpleAtoi(parts[2], &n);
}

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

SharedRegion::Identity IdentityOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(
    uint64_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("a shared memory region needs bytes");
  }
  const int fd = ::memfd_create("shardps", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    const int err = errno;
    return absl::InternalError(absl::StrCat("memfd_create: ", ErrnoText(err)));
  }
  auto fail = [fd](absl::string_view op, int err) {
    ::close(fd);
    const std::string msg = absl::StrCat(op, ": ", ErrnoText(err));
    return err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE
               ? absl::ResourceExhaustedError(msg)
               : absl::InternalError(msg);
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(absl::StrCat("ftruncate shared memory to ", bytes, " bytes"),
                errno);
  }
  if (::fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    return fail("sealing shared memory", errno);
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return fail(absl::StrCat("mmap ", bytes, " bytes of shared memory"), errno);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::munmap(p, bytes);
    return fail("fstat of shared memory", err);
  }
  std::string path = absl::StrCat("/proc/", ::getpid(), "/fd/", fd);
  return std::unique_ptr<SharedRegion>(new SharedRegion(
      static_cast<char*>(p), bytes, fd, std::move(path), IdentityOf(st)));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Open(
    absl::string_view path, uint64_t bytes, Mapping mapping) {
  auto refuse = [&](absl::string_view why) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region ", path, ": ", why));
  };
  if (!IsProcFdPath(path)) return refuse("not a /proc/<pid>/fd/<n> path");
  if (bytes == 0) return refuse("0 bytes");
  const std::string p(path);
  const bool writable = mapping != Mapping::kReadOnly;
  const bool populate = mapping == Mapping::kReadWrite;
  const int fd = ::open(p.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return refuse(absl::StrCat("cannot open it (", ErrnoText(err),
                               "): not on this machine, or another pid "
                               "namespace or user"));
  }
  auto close_and_refuse = [&](absl::string_view why) {
    ::close(fd);
    return refuse(why);
  };
  // Only a memfd answers F_GET_SEALS; its seals must keep its size fixed,
  // or shrinking it would fault this process on a mapped page.
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
                       (F_SEAL_SHRINK | F_SEAL_GROW)) {
    return close_and_refuse("not a memfd sealed at its size");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return close_and_refuse("cannot stat it");
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return close_and_refuse(
        absl::StrCat("it has ", st.st_size, " bytes, not ", bytes));
  }
  void* m =
      ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
             populate ? MAP_SHARED | MAP_POPULATE : MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the pages
  if (m == MAP_FAILED) {
    return refuse(absl::StrCat("mmap: ", ErrnoText(err)));
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(
      static_cast<char*>(m), bytes, -1, std::string(), IdentityOf(st)));
}

absl::StatusOr<SharedRegion::Identity> SharedRegion::Identify(
    absl::string_view path) {
  if (!IsProcFdPath(path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory region ", path, ": not a /proc/<pid>/fd/<n> path"));
  }
  struct stat st;
  if (::stat(std::string(path).c_str(), &st) != 0) {
    const int err = errno;
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region ", path, ": cannot stat it (",
                     ErrnoText(err), ")"));
  }
  return IdentityOf(st);
}

SharedRegion::~SharedRegion() {
  ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace shardps
