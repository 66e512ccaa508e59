// The lead's duties pass on when rank 0 dies: coordinator, two servers and
// two workers as processes on 127.0.0.1; rank 0 (the lead) is killed with
// SIGKILL after the first epoch and not restarted. The surviving rank 1
// finishes the job, evaluates (its final line has a test accuracy), appends
// the last epoch's row to the metrics CSV rank 0 started and writes the model.
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using testing::ClusterOptions;
using testing::Daemon;
using testing::TestCluster;

// The line of `log` that contains `text` (the last one), or "".
std::string LineWith(const std::string& log, const std::string& text) {
  std::string found;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, text)) found = std::string(line);
  }
  return found;
}

TEST(LeadTakeoverTest, TheLowestRankLeftEvaluatesAndWritesTheOutputs) {
  if (!testing::HaveFashionMnist()) GTEST_SKIP() << testing::kNoFashionMnist;
  ClusterOptions o;
  o.coordinated = true;
  o.job_id = "takeover";
  o.num_servers = 2;
  o.num_workers = 2;
  // A dead worker holds steps up for the heartbeat timeout.
  o.coordinator_flags = {"--heartbeat_timeout_ms=1000"};
  TestCluster job(o);
  const std::string metrics = job.dir() + "/metrics.csv";
  // Both workers get the output paths, as shardps-local gives them; 2048
  // samples in batches of 64: 32 steps per epoch, 2 epochs.
  ASSERT_NE(job.StartCoordinator(), nullptr);
  ASSERT_TRUE(job.StartServers());
  std::vector<std::vector<std::string>> rank_flags;
  for (int r = 0; r < 2; ++r) {
    rank_flags.push_back({absl::StrCat("--rank=", r), "--dataset=fashion-mnist",
                          "--model=mlp:784-32-10", "--epochs=2",
                          "--train_limit=2048", "--test_limit=500",
                          "--batch_size=64", "--backend=cpu",
                          "--fault_step_delay_ms=20", job.model_out_flag(),
                          "--metrics_csv=" + metrics});
  }
  ASSERT_TRUE(job.StartWorkers(rank_flags));
  // Rank 0 leads the first epoch, then dies.
  ASSERT_TRUE(testing::WaitForLog(job.worker(0), "epoch 1/2 step 32"))
      << job.worker(0).ReadLog();
  SHARDPS_ASSERT_OK(job.Kill(&job.worker(0)));

  job.ExpectWorkersExitZero(absl::Minutes(3));
  Daemon& w1 = job.worker(1);
  const std::string log = w1.ReadLog();
  const std::string done = LineWith(log, "done: epoch 2 step 64");
  ASSERT_FALSE(done.empty()) << log;
  const size_t at = done.find("test_accuracy ");
  ASSERT_NE(at, std::string::npos) << done;
  double accuracy = 0;
  ASSERT_TRUE(absl::SimpleAtod(absl::StripAsciiWhitespace(done.substr(at + 14)),
                               &accuracy))
      << done;
  EXPECT_GT(accuracy, 0.3) << done;  // chance is 0.1
  EXPECT_LE(accuracy, 1.0) << done;

  // The metrics CSV: rank 0's row for epoch 1, rank 1's for epoch 2, both
  // with a test accuracy, under one header.
  std::istringstream csv(testing::ReadFile(metrics));
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(csv, line);) {
    rows.push_back(absl::StrSplit(line, ','));
  }
  ASSERT_EQ(rows.size(), 3u) << testing::ReadFile(metrics);
  EXPECT_EQ(rows[0][0], "epoch");
  EXPECT_EQ(rows[1][0], "1");
  EXPECT_EQ(rows[2][0], "2");
  EXPECT_EQ(rows[2][1], "64");
  for (size_t r = 1; r < rows.size(); ++r) {
    ASSERT_GE(rows[r].size(), 5u);
    EXPECT_FALSE(rows[r][4].empty()) << "no test accuracy in row " << r;
  }

  std::map<std::string, std::string> meta;
  absl::StatusOr<std::vector<LoadedTensor>> tensors =
      ReadSafetensors(job.model_path(), &meta);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(tensors->size(), 4u);  // two layers' weights and biases
  EXPECT_EQ(meta["step"], "64");

  job.ExpectJobEnds(absl::Seconds(1), absl::Seconds(60));
}

}  // namespace
}  // namespace shardps
