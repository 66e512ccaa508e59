#include "deploy/local/run_dir.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps::local {
namespace {

namespace fs = std::filesystem;

constexpr char kHeader[] =
    "epoch,step,train_loss,test_loss,test_accuracy,samples_per_s,epoch_s,"
    "compute_share,push_share,wait_share\n";

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

TEST(RunDirTest, PrepareRemovesStaleResultsAndKeepsLogs) {
  const RunDir dir(testing::MakeTempDir("run_dir_test") + "/run");
  SHARDPS_ASSERT_OK(dir.Prepare());
  WriteText(dir.MetricsPath(), kHeader);
  WriteText(dir.ModelPath(), "model");
  WriteText(dir.PortPath("server-0"), "1234\n");
  SHARDPS_ASSERT_OK(dir.WritePid("worker-3", 42));
  WriteText(dir.LogPath("server-0"), "old log\n");
  EXPECT_EQ(dir.ReadPort("server-0"), 1234);

  SHARDPS_ASSERT_OK(dir.Prepare());
  EXPECT_FALSE(fs::exists(dir.MetricsPath()));
  EXPECT_FALSE(fs::exists(dir.ModelPath()));
  EXPECT_FALSE(fs::exists(dir.PidPath("worker-3")));
  EXPECT_EQ(dir.ReadPort("server-0"), 0);
  EXPECT_TRUE(fs::exists(dir.LogPath("server-0")));
}

TEST(RunDirTest, RemovePortForgetsTheOldPort) {
  const RunDir dir(testing::MakeTempDir("run_dir_test") + "/run");
  SHARDPS_ASSERT_OK(dir.Prepare());
  WriteText(dir.PortPath("coordinator"), "7000\n");
  EXPECT_EQ(dir.ReadPort("coordinator"), 7000);
  dir.RemovePort("coordinator");
  EXPECT_EQ(dir.ReadPort("coordinator"), 0);
  dir.RemovePort("coordinator");  // none: nothing to do
}

TEST(RunDirTest, FinalMetricsLineTakesTheLastRow) {
  const std::string path =
      testing::MakeTempDir("run_dir_test") + "/metrics.csv";
  WriteText(path,
            absl::StrCat(kHeader,
                         "1,235,0.61,0.52,0.8100,9000.0,6.5,0.5,0.3,0.2\n"
                         "2,470,0.41,0.45,0.8400,9100.0,6.4,0.5,0.3,0.2\n"));
  absl::StatusOr<std::string> line =
      FinalMetricsLine(path, absl::Milliseconds(12345));
  SHARDPS_ASSERT_OK(line);
  EXPECT_EQ(*line,
            "final: epoch=2 step=470 test_accuracy=0.8400 train_loss=0.41 "
            "wall_s=12.3\n");
}

TEST(RunDirTest, FinalMetricsLineRejectsMissingOrIncompleteMetrics) {
  const std::string dir = testing::MakeTempDir("run_dir_test");
  struct Case {
    const char* name;
    const char* text;  // nullptr: no file
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"missing", nullptr, absl::StatusCode::kNotFound},
      {"empty", "", absl::StatusCode::kNotFound},
      {"header only", kHeader, absl::StatusCode::kNotFound},
      {"no test_accuracy", "epoch,step,train_loss\n1,10,0.5\n",
       absl::StatusCode::kInvalidArgument},
      {"short row", "epoch,step,train_loss,test_accuracy\n1,10\n",
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = absl::StrCat(dir, "/", c.name, ".csv");
    if (c.text != nullptr) WriteText(path, c.text);
    absl::StatusOr<std::string> line = FinalMetricsLine(path, absl::Seconds(1));
    EXPECT_EQ(line.status().code(), c.code) << line.status();
  }
}

}  // namespace
}  // namespace shardps::local
