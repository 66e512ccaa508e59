// End to end: real shardps-server and shardps-worker processes training on
// Fashion-MNIST. Sync data parallelism must give the weights of a single
// worker training on the whole global batch, on any number of servers.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

using ::shardps::testing::Daemon;

constexpr char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";

bool HaveFashionMnist() {
  struct stat st;
  return stat(kFashionMnist, &st) == 0;
}

// Flags of a short run on a subset of the data.
std::vector<std::string> TrainingFlags() {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-64-32-10",
          "--batch_size=64",
          "--max_steps=50",
          "--train_limit=6400",
          "--test_limit=500",
          "--optimizer=sgd",
          "--lr=0.1",
          "--momentum=0.9",
          "--lr_schedule=cosine",
          "--chunk_kib=16",
          "--backend=cpu",
          "--seed=5"};
}

// Trains with `servers` shard processes and `workers` worker processes;
// returns the model rank 0 wrote.
absl::StatusOr<std::vector<LoadedTensor>> TrainCluster(int servers,
                                                       int workers) {
  std::vector<std::unique_ptr<Daemon>> shards;
  std::vector<std::string> addresses;
  for (int s = 0; s < servers; ++s) {
    absl::StatusOr<std::unique_ptr<Daemon>> d =
        Daemon::Start(absl::StrCat("server-", s), SHARDPS_SERVER_BIN,
                      {absl::StrCat("--shard_index=", s),
                       absl::StrCat("--num_shards=", servers),
                       absl::StrCat("--num_workers=", workers)});
    if (!d.ok()) return d.status();
    addresses.push_back((*d)->address());
    shards.push_back(*std::move(d));
  }
  const std::string model_out =
      testing::MakeTempDir("shardps-model") + "/model.safetensors";
  std::vector<std::unique_ptr<Daemon>> procs;
  for (int r = 0; r < workers; ++r) {
    std::vector<std::string> args = TrainingFlags();
    args.push_back("--servers=" + absl::StrJoin(addresses, ","));
    args.push_back(absl::StrCat("--rank=", r));
    args.push_back(absl::StrCat("--num_workers=", workers));
    if (r == 0) args.push_back("--model_out=" + model_out);
    absl::StatusOr<std::unique_ptr<Daemon>> w = Daemon::StartProcess(
        absl::StrCat("worker-", r), SHARDPS_WORKER_BIN, args);
    if (!w.ok()) return w.status();
    procs.push_back(*std::move(w));
  }
  for (auto& p : procs) {
    absl::StatusOr<int> code = p->Wait(absl::Seconds(240));
    if (!code.ok()) return code.status();
    if (*code != 0) {
      return absl::InternalError(
          absl::StrCat("worker exited with ", *code, ":\n", p->ReadLog()));
    }
  }
  return ReadSafetensors(model_out);
}

TEST(WorkerE2ETest, SyncWorkersMatchASingleWorkerOnAnyNumberOfServers) {
  if (!HaveFashionMnist()) {
    GTEST_SKIP() << "no " << kFashionMnist
                 << " (apt-get install dataset-fashion-mnist)";
  }
  absl::StatusOr<std::vector<LoadedTensor>> reference = TrainCluster(1, 1);
  SHARDPS_ASSERT_OK(reference);
  ASSERT_EQ(reference->size(), 6u);
  struct Config {
    int servers, workers;
  };
  for (Config c : {Config{1, 2}, Config{2, 2}, Config{3, 2}, Config{1, 4},
                   Config{2, 4}, Config{3, 4}}) {
    SCOPED_TRACE(absl::StrCat(c.servers, " servers, ", c.workers, " workers"));
    absl::StatusOr<std::vector<LoadedTensor>> got =
        TrainCluster(c.servers, c.workers);
    SHARDPS_ASSERT_OK(got);
    ASSERT_EQ(got->size(), reference->size());
    double max_diff = 0.0;
    for (size_t t = 0; t < got->size(); ++t) {
      ASSERT_EQ((*got)[t].name, (*reference)[t].name);
      ASSERT_EQ((*got)[t].data.size(), (*reference)[t].data.size());
      for (size_t i = 0; i < (*got)[t].data.size(); ++i) {
        max_diff = std::max<double>(
            max_diff, std::abs((*got)[t].data[i] - (*reference)[t].data[i]));
      }
    }
    // Only the float summation order differs (slices summed per worker,
    // then averaged on the servers).
    EXPECT_LE(max_diff, 1e-5);
    std::printf("%d servers, %d workers: max |w - w_1worker| = %.3g\n",
                c.servers, c.workers, max_diff);
  }
}

// Runs a worker that must fail before training; returns its exit code and
// log.
std::pair<int, std::string> RunFailingWorker(std::vector<std::string> args) {
  args.push_back("--servers=127.0.0.1:1");
  args.push_back("--connect_timeout_s=2");
  absl::StatusOr<std::unique_ptr<Daemon>> w =
      Daemon::StartProcess("bad-worker", SHARDPS_WORKER_BIN, args);
  if (!w.ok()) return {-1, std::string(w.status().message())};
  absl::StatusOr<int> code = (*w)->Wait(absl::Seconds(60));
  return {code.ok() ? *code : -1, (*w)->ReadLog()};
}

TEST(WorkerE2ETest, BadInputIsAClearErrorNotACrash) {
  const std::string dir = testing::MakeTempDir("shardps-bad-data");
  // A truncated IDX image file beside a good-looking label file.
  {
    std::ofstream images(dir + "/train-images-idx3-ubyte", std::ios::binary);
    const unsigned char header[] = {0, 0, 8, 3,  0, 0, 0, 10,
                                    0, 0, 0, 28, 0, 0, 0, 28};
    images.write(reinterpret_cast<const char*>(header), sizeof(header));
    images << "too short";
    std::ofstream labels(dir + "/train-labels-idx1-ubyte", std::ios::binary);
    const unsigned char lheader[] = {0, 0, 8, 1, 0, 0, 0, 10};
    labels.write(reinterpret_cast<const char*>(lheader), sizeof(lheader));
    labels << std::string(10, '\1');
  }
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  std::vector<Case> cases = {
      {{"--dataset=idx:/nonexistent/dir"}, "/nonexistent/dir"},
      {{"--dataset=idx:" + dir}, "train-images-idx3-ubyte"},
      {{"--dataset=csv:/nonexistent.csv"}, "/nonexistent.csv"},
      {{"--dataset=mnist-ish"}, "mnist-ish"},
      {{"--rank=2", "--num_workers=2"}, "--rank=2"},
      {{"--optimizer=rmsprop"}, "--optimizer=rmsprop"},
      {{"--backend=tpu"}, "--backend=tpu"},
  };
  if (HaveFashionMnist()) {
    cases.push_back({{"--model=mlp:100-10"}, "100"});
    cases.push_back({{"--model=mlp:784-10-7"}, "7"});
    cases.push_back(
        {{"--batch_size=3", "--num_workers=2"}, "not divisible by the 2"});
    cases.push_back({{"--batch_size=1", "--num_workers=2", "--rank=1"},
                     "smaller than the 2 workers"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    auto [code, log] = RunFailingWorker(c.args);
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find(c.message), std::string::npos) << log;
    EXPECT_NE(log.find("ERROR"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace shardps
