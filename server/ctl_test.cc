#include "server/ctl.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::ctl {
namespace {

TEST(CtlTest, HealthRequestEncodesTheServiceName) {
  EXPECT_EQ(EncodeHealthCheckRequest(""), "");
  EXPECT_EQ(EncodeHealthCheckRequest("a.B"), std::string("\x0a\x03"
                                                         "a.B"));
}

TEST(CtlTest, HealthResponseDecodes) {
  struct Case {
    std::string bytes;
    HealthState want;
  };
  const std::vector<Case> cases = {
      {"", HealthState::kUnknown},
      {std::string("\x08\x01", 2), HealthState::kServing},
      {std::string("\x08\x02", 2), HealthState::kNotServing},
      {std::string("\x08\x03", 2), HealthState::kUnknown},
      // An unknown length-delimited field 2 before the status is skipped.
      {std::string("\x12\x01x\x08\x01", 5), HealthState::kServing},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    absl::StatusOr<HealthState> got = DecodeHealthCheckResponse(cases[i].bytes);
    SHARDPS_ASSERT_OK(got);
    EXPECT_EQ(*got, cases[i].want);
  }
  EXPECT_FALSE(DecodeHealthCheckResponse(std::string("\x08", 1)).ok());
  EXPECT_FALSE(DecodeHealthCheckResponse(std::string("\x12\x05x", 3)).ok());
}

TEST(CtlTest, TableAlignsColumnsAndLetsErrorsRunOn) {
  EXPECT_EQ(FormatTable({{"A", "BB"}, {"ccc", "d"}, {"e", "a long error"}}),
            "A    BB\n"
            "ccc  d\n"
            "e    a long error\n");
  EXPECT_EQ(FormatTable({{"ADDR", "X", "Y"}, {"127.0.0.1:1", "error: down"}}),
            "ADDR         X  Y\n"
            "127.0.0.1:1  error: down\n");
}

TEST(CtlTest, JobStatusShowsAddressesLivenessAndProgress) {
  v1::JobStatus status;
  status.set_protocol_version(1);
  status.set_heartbeat_timeout_ms(5000);
  v1::ClusterView* view = status.mutable_view();
  view->set_job_id("mnist");
  view->set_generation(7);
  view->set_num_shards(2);
  view->set_num_workers(1);
  view->set_global_step(120);
  view->set_epoch(3);
  auto add = [&](v1::Role role, uint32_t index, const std::string& address,
                 bool alive, int64_t age_ms) {
    v1::MemberStatus* m = status.add_members();
    m->set_role(role);
    m->set_index(index);
    m->set_address(address);
    m->set_alive(alive);
    m->set_heartbeat_age_ms(age_ms);
  };
  add(v1::ROLE_SERVER, 0, "10.0.0.1:5000", true, 400);
  add(v1::ROLE_SERVER, 1, "10.0.0.2:5000", false, 12000);
  add(v1::ROLE_WORKER, 0, "", false, -1);
  status.mutable_members(0)->set_stalled(
      "step 120 has waited 61s for rank(s) 0");
  const std::string text = FormatJobStatus(status);
  for (const char* want :
       {"stalled steps:\n  server 0: step 120 has waited 61s for rank(s) 0",
        "job mnist", "generation 7", "servers 1/2 alive", "workers 0/1 alive",
        "global step 120, epoch 3", "10.0.0.1:5000", "alive", "0.4 s ago",
        "10.0.0.2:5000", "gone", "12.0 s ago", "vacant",
        "job state: running (workers 0/1 finished)"}) {
    EXPECT_TRUE(absl::StrContains(text, want)) << want << " in\n" << text;
  }
}

TEST(CtlTest, JobStatusShowsFinishedWorkersAndTheJobState) {
  v1::JobStatus status;
  v1::ClusterView* view = status.mutable_view();
  view->set_num_shards(1);
  view->set_num_workers(2);
  view->set_job_finished(true);
  for (uint32_t rank : {0u, 1u}) {
    v1::MemberStatus* m = status.add_members();
    m->set_role(v1::ROLE_WORKER);
    m->set_index(rank);
    m->set_heartbeat_age_ms(100);
    m->set_finished(true);
  }
  const std::string text = FormatJobStatus(status);
  for (const char* want :
       {"job state: finished (workers 2/2 finished)", "finished"}) {
    EXPECT_TRUE(absl::StrContains(text, want)) << want << " in\n" << text;
  }
}

TEST(CtlTest, ShardTableShowsStatusesAndErrors) {
  std::vector<ShardReport> reports(2);
  v1::GetStatusResponse s;
  s.set_shard_index(0);
  s.set_num_shards(2);
  s.set_mode("sync");
  s.set_owned_bytes(3 << 20);
  s.set_max_version(6);
  reports[0] = {"127.0.0.1:5000", s};
  reports[1] = {"127.0.0.1:5001", absl::UnavailableError("connection refused")};
  const std::string text = FormatShardReports(reports);
  for (const char* want : {"127.0.0.1:5000", "0/2", "sync", "3.0 MiB", "0..6",
                           "127.0.0.1:5001", "error: UNAVAILABLE"}) {
    EXPECT_TRUE(absl::StrContains(text, want)) << want << " in\n" << text;
  }
}

}  // namespace
}  // namespace shardps::ctl
