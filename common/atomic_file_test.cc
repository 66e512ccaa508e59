#include "common/atomic_file.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  return names;
}

TEST(AtomicFileTest, ReplacesTheFileAndLeavesNoTemporary) {
  const std::string dir = testing::MakeTempDir("atomic_file");
  const std::string path = dir + "/port";
  SHARDPS_ASSERT_OK(WriteFileAtomically(path, "7000\n"));
  EXPECT_EQ(ReadText(path), "7000\n");
  SHARDPS_ASSERT_OK(WriteFileAtomically(path, "7001\n"));
  EXPECT_EQ(ReadText(path), "7001\n");
  EXPECT_EQ(Entries(dir), std::vector<std::string>{"port"});
}

TEST(AtomicFileTest, WritesThePiecesInOrder) {
  const std::string path = testing::MakeTempDir("atomic_file") + "/f";
  const std::string binary("\0\1\2", 3);
  const std::vector<absl::string_view> pieces = {"head:", binary, "", "tail"};
  SHARDPS_ASSERT_OK(WriteFileAtomically(path, pieces));
  EXPECT_EQ(ReadText(path), "head:" + binary + "tail");
}

TEST(AtomicFileTest, AMissingDirectoryIsNotFoundNamingThePath) {
  const std::string path =
      testing::MakeTempDir("atomic_file") + "/no_such_dir/f";
  const absl::Status s = WriteFileAtomically(path, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), path)) << s;
}

TEST(AtomicFileTest, FileErrorCodesSayWhoMustAct) {
  EXPECT_EQ(FileError("open", "/x", EACCES).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FileError("open", "/x", EROFS).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FileError("open", "/x", ENOENT).code(),
            absl::StatusCode::kNotFound);
  const absl::Status io = FileError("write", "/x/y", EIO);
  EXPECT_EQ(io.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(absl::StartsWith(io.message(), "write /x/y: ")) << io;
}

TEST(AtomicFileTest, SyncsADirectory) {
  SHARDPS_EXPECT_OK(SyncDirectory(testing::MakeTempDir("atomic_file")));
  EXPECT_EQ(SyncDirectory("/no/such/dir").code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardps
