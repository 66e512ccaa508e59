#include "common/checkpoint_steps.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

namespace fs = std::filesystem;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

TEST(CheckpointStepsTest, NamesStepDirectoriesWithTwelveDigits) {
  EXPECT_EQ(StepDirectory("/ckpt", 42), "/ckpt/step-000000000042");
}

TEST(CheckpointStepsTest, NewestCommittedStepSkipsUncommittedSteps) {
  const std::string dir = testing::MakeTempDir("checkpoint_steps") + "/ckpt";
  // no directory yet
  EXPECT_EQ(NewestCommittedStep(dir).value_or(0), kNoCommittedStep);
  for (const char* step : {"step-000000000020", "step-000000000040",
                           "step-000000000060", "step-x", "step-80"}) {
    fs::create_directories(absl::StrCat(dir, "/", step));
  }
  EXPECT_EQ(NewestCommittedStep(dir).value_or(0), kNoCommittedStep);
  WriteText(dir + "/step-000000000020/COMMITTED", "");
  WriteText(dir + "/step-000000000040/COMMITTED", "");
  WriteText(dir + "/step-x/COMMITTED", "");
  WriteText(dir + "/step-80/COMMITTED", "");  // not a name servers write
  // step 60 is still being written.
  EXPECT_EQ(NewestCommittedStep(dir).value_or(0), 40);
}

TEST(CheckpointStepsTest, StepZeroCanBeCommitted) {
  const std::string dir = testing::MakeTempDir("checkpoint_steps");
  fs::create_directories(StepDirectory(dir, 0));
  WriteText(StepDirectory(dir, 0) + "/COMMITTED", "");
  EXPECT_EQ(NewestCommittedStep(dir).value_or(-2), 0);
}

TEST(CheckpointStepsTest, ListsStepDirectoriesNewestFirst) {
  const std::string dir = testing::MakeTempDir("checkpoint_steps");
  for (const int64_t step : {5, 100, 20}) {
    fs::create_directories(StepDirectory(dir, step));
  }
  WriteText(StepDirectory(dir, 7), "a file, not a step directory");
  absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> steps =
      ListStepDirectories(dir);
  SHARDPS_ASSERT_OK(steps);
  ASSERT_EQ(steps->size(), 3u);
  EXPECT_EQ((*steps)[0].first, 100);
  EXPECT_EQ((*steps)[0].second, "step-000000000100");
  EXPECT_EQ((*steps)[1].first, 20);
  EXPECT_EQ((*steps)[2].first, 5);
}

}  // namespace
}  // namespace shardps
