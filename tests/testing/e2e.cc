#include "tests/testing/e2e.h"

#include <fstream>
#include <sstream>
#include <utility>

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

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace shardps::testing
