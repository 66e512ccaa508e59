#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

using ::testing::HasSubstr;

// The error of `result`: its code and message.
template <typename T>
void ExpectError(const absl::StatusOr<T>& result, absl::StatusCode code,
                 const std::string& part) {
  ASSERT_FALSE(result.ok()) << "expected " << part;
  EXPECT_EQ(result.status().code(), code) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(part));
}

TEST(SharedRegionTest, AnOpenedRegionSharesThePagesBothWays) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> made,
                               SharedRegion::Create(1 << 20));
  EXPECT_EQ(made->size(), 1u << 20);
  EXPECT_EQ(made->path().rfind("/proc/", 0), 0u) << made->path();
  EXPECT_EQ(made->data()[12345], 0);  // zero-filled
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> opened,
                               SharedRegion::Open(made->path(), 1 << 20));
  EXPECT_NE(opened->data(), made->data());  // another mapping
  std::memcpy(made->data() + 100, "gradient", 8);
  EXPECT_EQ(std::string(opened->data() + 100, 8), "gradient");
  std::memcpy(opened->data() + 1000, "weights", 7);
  EXPECT_EQ(std::string(made->data() + 1000, 7), "weights");
  // The opener's mapping outlives the creator's object.
  made.reset();
  EXPECT_EQ(std::string(opened->data() + 100, 8), "gradient");
}

TEST(SharedRegionTest, AReadOnlyMappingSeesTheCreatorsWritesAndCannotWrite) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> made,
                               SharedRegion::Create(1 << 20));
  SHARDPS_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<SharedRegion> opened,
      SharedRegion::Open(made->path(), 1 << 20,
                         SharedRegion::Mapping::kReadOnly));
  // Written after the mapping was made, on a page it had not read yet.
  std::memcpy(made->data() + (1 << 19) + 7, "gradient", 8);
  EXPECT_EQ(std::string(opened->data() + (1 << 19) + 7, 8), "gradient");
  // The pages are not writable through it.
  EXPECT_EQ(::mprotect(opened->data(), 4096, PROT_READ | PROT_WRITE), -1);
  EXPECT_EQ(errno, EACCES);
}

TEST(SharedRegionTest, ContainsChecksBoundsWithoutOverflow) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> r,
                               SharedRegion::Create(4096));
  EXPECT_TRUE(r->Contains(0, 4096));
  EXPECT_TRUE(r->Contains(4096, 0));
  EXPECT_FALSE(r->Contains(1, 4096));
  EXPECT_FALSE(r->Contains(4097, 0));
  EXPECT_FALSE(r->Contains(8, ~uint64_t{0}));
  EXPECT_FALSE(r->Contains(~uint64_t{0}, 2));
}

TEST(SharedRegionTest, OpenRefusesWhatIsNotASealedRegionOfThatSize) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> r,
                               SharedRegion::Create(4096));
  ExpectError(SharedRegion::Open(r->path(), 8192),
              absl::StatusCode::kFailedPrecondition,
              "it has 4096 bytes, not 8192");
  for (const char* path :
       {"/etc/passwd", "/proc/self/fd/0", "/proc/1/fd/", "/proc/1/fd/2/x",
        "/proc/../etc/fd/1", "relative/path"}) {
    SCOPED_TRACE(path);
    ExpectError(SharedRegion::Open(path, 4096),
                absl::StatusCode::kFailedPrecondition,
                "not a /proc/<pid>/fd/<n> path");
  }
  ExpectError(
      SharedRegion::Open(absl::StrCat("/proc/", getpid(), "/fd/9999"), 4096),
      absl::StatusCode::kFailedPrecondition, "cannot open it");
  // A memfd whose size is not sealed could be shrunk under a mapping.
  const int fd = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ExpectError(
      SharedRegion::Open(absl::StrCat("/proc/", getpid(), "/fd/", fd), 4096),
      absl::StatusCode::kFailedPrecondition, "not a memfd sealed at its size");
  close(fd);
  // A regular file is no memfd.
  const std::string file =
      testing::MakeTempDir("shared_memory_test") + "/plain";
  const int ffd = open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(ffd, 0);
  ASSERT_EQ(ftruncate(ffd, 4096), 0);
  ExpectError(
      SharedRegion::Open(absl::StrCat("/proc/", getpid(), "/fd/", ffd), 4096),
      absl::StatusCode::kFailedPrecondition, "not a memfd");
  close(ffd);
}

TEST(SharedRegionTest, CreateRefusesAnEmptyRegion) {
  ExpectError(SharedRegion::Create(0), absl::StatusCode::kInvalidArgument,
              "needs bytes");
}

}  // namespace
}  // namespace shardps
