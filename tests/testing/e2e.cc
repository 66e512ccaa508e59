#include "tests/testing/e2e.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_steps.h"
#include "gtest/gtest.h"

namespace shardps::testing {

std::unique_ptr<Daemon> Must(absl::StatusOr<std::unique_ptr<Daemon>> d) {
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

void ExpectExitsZero(Daemon* d, absl::Duration timeout) {
  ASSERT_NE(d, nullptr);
  absl::StatusOr<int> code = d->Wait(timeout);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << d->ReadLog();
  EXPECT_EQ(*code, 0) << d->ReadLog();
}

CommandResult MustRun(const std::string& binary, std::vector<std::string> args,
                      absl::Duration timeout) {
  CommandResult result;
  std::unique_ptr<Daemon> d =
      Must(Daemon::StartProcess("command", binary, std::move(args)));
  if (d == nullptr) return result;
  absl::StatusOr<int> code = d->Wait(timeout);
  EXPECT_TRUE(code.ok()) << binary << ": " << code.status() << "\n"
                         << d->ReadLog();
  result.code = code.value_or(-1);
  result.output = d->ReadLog();
  return result;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

int64_t NewestCommitted(const std::string& dir) {
  return NewestCommittedStep(dir).value_or(kNoCommittedStep);
}

std::vector<std::string> KillJobTrainingFlags(int max_steps) {
  return {"--dataset=fashion-mnist",
          "--model=mlp:784-64-32-10",
          "--batch_size=64",
          absl::StrCat("--max_steps=", max_steps),
          "--train_limit=12800",
          "--test_limit=500",
          "--chunk_kib=16",
          "--backend=cpu",
          "--seed=9",
          "--optimizer=adam",
          "--lr=0.002"};
}

}  // namespace shardps::testing
