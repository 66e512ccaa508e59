#include "deploy/local/run_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

std::string Join(const std::string& root, const std::string& relative) {
  return (fs::path(root) / relative).string();
}

}  // namespace

std::string RunDir::LogPath(const std::string& name) const {
  return Join(root_, absl::StrCat("logs/", name, ".log"));
}

std::string RunDir::PidPath(const std::string& name) const {
  return Join(root_, absl::StrCat("pids/", name, ".pid"));
}

std::string RunDir::PortPath(const std::string& name) const {
  return Join(root_, absl::StrCat("ports/", name, ".port"));
}

std::string RunDir::MetricsPath() const { return Join(root_, "metrics.csv"); }

std::string RunDir::ModelPath() const {
  return Join(root_, "model.safetensors");
}

absl::Status RunDir::Prepare() const {
  for (const char* sub : {"logs", "pids", "ports"}) {
    std::error_code ec;
    fs::create_directories(Join(root_, sub), ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create ", Join(root_, sub), ": ", ec.message()));
    }
  }
  // Old metrics would pass for this run's results, an old port file would
  // make a server look ready before it is, and an old pid file would name a
  // process this run never started.
  std::vector<fs::path> stale = {MetricsPath(), ModelPath()};
  for (const auto& [sub, extension] :
       {std::pair{"ports", ".port"}, std::pair{"pids", ".pid"}}) {
    std::error_code ec;
    for (const fs::directory_entry& entry :
         fs::directory_iterator(Join(root_, sub), ec)) {
      if (entry.path().extension() == extension) stale.push_back(entry.path());
    }
  }
  for (const fs::path& path : stale) {
    std::error_code ec;
    fs::remove(path, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot remove ", path.string(),
                       " of an earlier run: ", ec.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status RunDir::WritePid(const std::string& name, pid_t pid) const {
  const std::string path = PidPath(name);
  std::ofstream out(path, std::ios::trunc);
  out << pid << "\n";
  out.close();
  if (!out) {
    return absl::FailedPreconditionError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

int RunDir::ReadPort(const std::string& name) const {
  std::ifstream in(PortPath(name));
  int port = 0;
  return in >> port && port > 0 ? port : 0;
}

void RunDir::RemovePort(const std::string& name) const {
  std::error_code ec;
  fs::remove(PortPath(name), ec);
}

absl::StatusOr<std::string> FinalMetricsLine(const std::string& path,
                                             absl::Duration wall) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("no metrics: worker-0 did not write ", path));
  }
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) {
    absl::string_view row = absl::StripSuffix(line, "\r");
    if (!row.empty()) rows.emplace_back(row);
  }
  if (rows.size() < 2) {
    return absl::NotFoundError(
        absl::StrCat("no metrics: ", path,
                     rows.empty() ? " is empty" : " has a header but no rows"));
  }
  const std::vector<std::string> header = absl::StrSplit(rows.front(), ',');
  const std::vector<std::string> last = absl::StrSplit(rows.back(), ',');
  if (last.size() != header.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the last row of ", path, " has ", last.size(),
                     " fields, its header ", header.size()));
  }
  std::string line = "final:";
  for (const char* column : {"epoch", "step", "test_accuracy", "train_loss"}) {
    const auto it = std::find(header.begin(), header.end(), column);
    if (it == header.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " has no column ", column));
    }
    absl::StrAppend(&line, " ", column, "=", last[it - header.begin()]);
  }
  absl::StrAppendFormat(&line, " wall_s=%.1f\n", absl::ToDoubleSeconds(wall));
  return line;
}

}  // namespace shardps::local
