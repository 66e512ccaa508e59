#include "server/region_cache.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/shared_memory.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::server {
namespace {

TEST(RegionCacheTest, ThePathOfTheSameMemfdReusesItsMapping) {
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> made,
                               SharedRegion::Create(1 << 20));
  RegionCache cache;
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::shared_ptr<SharedRegion> first,
                               cache.Open(made->path(), 1 << 20));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::shared_ptr<SharedRegion> second,
                               cache.Open(made->path(), 1 << 20));
  EXPECT_EQ(first.get(), second.get());
  EXPECT_EQ(cache.mapped(), 1);
  EXPECT_EQ(cache.reused(), 1);
  std::memcpy(second->data() + 4096, "weights", 7);
  EXPECT_EQ(std::string(made->data() + 4096, 7), "weights");
}

TEST(RegionCacheTest, APathThatNamesAnotherMemfdNowIsMappedAgain) {
  RegionCache cache;
  std::string path;
  std::shared_ptr<SharedRegion> old_mapping;
  {
    SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> old_region,
                                 SharedRegion::Create(4096));
    path = old_region->path();
    SHARDPS_ASSERT_OK_AND_ASSIGN(old_mapping, cache.Open(path, 4096));
  }
  // The worker's new region takes the descriptor number the old one had
  // (the lowest free), so the same path now names another memfd.
  std::vector<std::unique_ptr<SharedRegion>> made;
  std::unique_ptr<SharedRegion>* same_path = nullptr;
  for (int i = 0; i < 8 && same_path == nullptr; ++i) {
    SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> r,
                                 SharedRegion::Create(4096));
    made.push_back(std::move(r));
    if (made.back()->path() == path) same_path = &made.back();
  }
  if (same_path == nullptr) GTEST_SKIP() << "no descriptor reused " << path;
  std::memcpy((*same_path)->data(), "new", 3);
  std::memcpy(old_mapping->data(), "old", 3);
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::shared_ptr<SharedRegion> now,
                               cache.Open(path, 4096));
  EXPECT_NE(now.get(), old_mapping.get());
  EXPECT_EQ(std::string(now->data(), 3), "new");
  EXPECT_EQ(cache.mapped(), 2);
  EXPECT_EQ(cache.reused(), 0);
}

TEST(RegionCacheTest, KeepsAtMostItsEntriesAndRefusesWhatOpenRefuses) {
  RegionCache cache;
  std::vector<std::unique_ptr<SharedRegion>> made;
  for (size_t i = 0; i < RegionCache::kEntries + 4; ++i) {
    SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> r,
                                 SharedRegion::Create(4096));
    SHARDPS_ASSERT_OK(cache.Open(r->path(), 4096).status());
    made.push_back(std::move(r));
  }
  // The first ones were dropped: opening them maps them again.
  SHARDPS_ASSERT_OK(cache.Open(made.front()->path(), 4096).status());
  EXPECT_EQ(cache.mapped(), static_cast<int64_t>(RegionCache::kEntries + 5));
  // The newest is still there.
  SHARDPS_ASSERT_OK(cache.Open(made.back()->path(), 4096).status());
  EXPECT_EQ(cache.reused(), 1);
  // Another size, a path that is no region: refused as Open refuses.
  EXPECT_FALSE(cache.Open(made.back()->path(), 8192).ok());
  EXPECT_FALSE(cache.Open("/etc/passwd", 4096).ok());
  EXPECT_FALSE(cache.Open("/proc/1/fd/999999", 4096).ok());
}

}  // namespace
}  // namespace shardps::server
