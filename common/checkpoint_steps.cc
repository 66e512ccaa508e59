#include "common/checkpoint_steps.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/status.h"

namespace shardps {

namespace fs = std::filesystem;

std::string StepDirectory(const std::string& dir, int64_t step) {
  return absl::StrFormat("%s/step-%012d", dir, step);
}

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>>
ListStepDirectories(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> steps;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec.value() == ENOENT) return steps;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    absl::string_view digits = name;
    int64_t step = 0;
    // Only the canonical name: "step-42" is not the directory of step 42.
    if (absl::ConsumePrefix(&digits, "step-") &&
        absl::SimpleAtoi(digits, &step) && step >= 0 &&
        StepDirectory(dir, step) == absl::StrCat(dir, "/", name) &&
        it->is_directory(ec)) {
      steps.emplace_back(step, name);
    }
  }
  if (ec) return FileError("list", dir, ec.value());
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

absl::StatusOr<int64_t> NewestCommittedStep(const std::string& dir) {
  SHARDPS_ASSIGN_OR_RETURN(const auto steps, ListStepDirectories(dir));
  for (const auto& [step, name] : steps) {
    std::error_code ec;  // an unreadable manifest counts as none
    if (fs::exists(absl::StrCat(dir, "/", name, "/", kCommittedManifest), ec)) {
      return step;
    }
  }
  return kNoCommittedStep;
}

}  // namespace shardps
