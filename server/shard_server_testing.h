// The shards of a static job, started in this process on free ports, for
// tests of their clients; shut down when destroyed. Test-only.
#ifndef SHARDPS_SERVER_SHARD_SERVER_TESTING_H_
#define SHARDPS_SERVER_SHARD_SERVER_TESTING_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/shard_server.h"

namespace shardps::server {

class TestShards {
 public:
  // Starts shards 0 .. num_shards - 1 of a job of `num_workers`; status()
  // says why when one did not start. Shards in `no_shared_memory` refuse
  // workers' shared memory (--shared_memory=false).
  TestShards(uint32_t num_shards, uint32_t num_workers,
             std::vector<uint32_t> no_shared_memory = {}) {
    for (uint32_t s = 0; s < num_shards && status_.ok(); ++s) {
      ShardServerOptions so;
      so.service.shared_memory =
          std::find(no_shared_memory.begin(), no_shared_memory.end(), s) ==
          no_shared_memory.end();
      so.store.shard_index = s;
      so.store.num_shards = num_shards;
      so.store.num_workers = num_workers;
      absl::StatusOr<std::unique_ptr<ShardServer>> shard =
          ShardServer::Start(so);
      if (!shard.ok()) {
        status_ = shard.status();
        break;
      }
      addresses_.push_back(absl::StrCat("127.0.0.1:", (*shard)->port()));
      shards_.push_back(*std::move(shard));
    }
  }
  ~TestShards() {
    for (auto& shard : shards_) shard->Shutdown(absl::Seconds(1));
  }
  TestShards(const TestShards&) = delete;
  TestShards& operator=(const TestShards&) = delete;

  const absl::Status& status() const { return status_; }
  // host:port of shard i at index i.
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  absl::Status status_;
  std::vector<std::unique_ptr<ShardServer>> shards_;
  std::vector<std::string> addresses_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SHARD_SERVER_TESTING_H_
