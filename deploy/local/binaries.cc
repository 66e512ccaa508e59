#include "deploy/local/binaries.h"

#include <unistd.h>

#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

bool IsExecutable(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

absl::StatusOr<std::string> FindBinary(const std::string& given,
                                       const std::string& name,
                                       const std::string& subdir,
                                       const std::string& flag) {
  std::vector<fs::path> candidates;
  if (!given.empty()) {
    candidates.push_back(given);
  } else {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) {
      return absl::NotFoundError(absl::StrCat(
          "cannot locate this executable (", ec.message(), "); pass --", flag));
    }
    const fs::path dir = self.parent_path();
    candidates.push_back(
        (dir / ".." / ".." / subdir / name).lexically_normal());
    candidates.push_back(dir / name);
  }
  for (const fs::path& path : candidates) {
    if (IsExecutable(path)) return path.string();
  }
  std::vector<std::string> tried;
  for (const fs::path& path : candidates) tried.push_back(path.string());
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " at ",
                                          absl::StrJoin(tried, " or "),
                                          "; build it or pass --", flag));
}

}  // namespace shardps::local
