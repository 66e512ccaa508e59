#include "server/ctl/ctl.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

// A declared shard of two at `step`, writing checkpoints to /ckpt.
v1::GetStatusResponse Shard(uint32_t index, int64_t step) {
  v1::GetStatusResponse s;
  s.set_shard_index(index);
  s.set_num_shards(2);
  s.set_declared(true);
  s.set_min_version(step);
  s.set_max_version(step);
  s.set_checkpoint_dir("/ckpt");
  return s;
}

TEST(CtlTest, ShardLoadShowsStepsTrafficCheckpointsAndErrors) {
  v1::GetStatusResponse s = Shard(0, 41);
  s.set_num_chunks(3);
  s.set_owned_bytes(2 << 20);
  s.set_pushes_total(1234);
  s.set_updates_total(617);
  s.set_rejected_total(2);
  s.set_bytes_in_total(5 << 20);
  s.set_bytes_out_total(6 << 20);
  s.set_last_committed_checkpoint_step(40);
  s.set_failed_checkpoint_step(30);
  s.set_checkpoint_error("checkpoint of step 30 skipped");
  v1::GetStatusResponse off = Shard(1, 41);
  off.set_min_version(40);
  off.clear_checkpoint_dir();
  std::vector<ShardReport> reports = {
      {"10.0.0.1:5000", s},
      {"10.0.0.2:5000", off},
      {"10.0.0.3:5000", absl::UnavailableError("connection refused")}};
  const std::string text = FormatShardLoad(reports);
  for (const char* want :
       {"SHARD", "CHECKPOINT", "10.0.0.1:5000", "0/2", "41", "2.0 MiB", "1234",
        "617", "5.0 MiB", "6.0 MiB", "40..41", "off",
        "10.0.0.3:5000  error: UNAVAILABLE: connection refused",
        "failed checkpoints:\n  shard 0: step 30: checkpoint of step 30 "
        "skipped"}) {
    EXPECT_TRUE(absl::StrContains(text, want)) << want << " in\n" << text;
  }
  // The first shard's row ends with its last committed checkpoint.
  EXPECT_TRUE(absl::StrContains(text, "6.0 MiB    40\n")) << text;
}

TEST(CtlTest, ShardLoadShowsCompressedTrafficBesideItsFp32Bytes) {
  v1::GetStatusResponse s = Shard(0, 7);
  s.set_bytes_in_total(1 << 20);
  s.set_bytes_in_fp32_total(4 << 20);
  s.set_bytes_out_total(2 << 20);
  s.set_bytes_out_fp32_total(2 << 20);  // weights sent as fp32
  const std::string text = FormatShardLoad({{"10.0.0.1:5000", s}});
  EXPECT_TRUE(absl::StrContains(text, "1.0 MiB (4.0 MiB as fp32)")) << text;
  EXPECT_FALSE(absl::StrContains(text, "2.0 MiB (")) << text;
  EXPECT_TRUE(absl::StrContains(FormatShardReports({{"10.0.0.1:5000", s}}),
                                "1.0 MiB (4.0 MiB as fp32)"));
}

TEST(CtlTest, ServersComeFromTheCoordinatorsView) {
  v1::JobStatus status;
  status.mutable_view()->set_num_shards(2);
  for (uint32_t i : {0u, 1u}) {
    v1::ServerSlot* slot = status.mutable_view()->add_servers();
    slot->set_shard_index(i);
    slot->set_address(absl::StrCat("10.0.0.", i, ":5000"));
    slot->set_alive(true);
  }
  absl::StatusOr<std::vector<std::string>> all = AllServers(status);
  SHARDPS_ASSERT_OK(all);
  EXPECT_EQ(*all, (std::vector<std::string>{"10.0.0.0:5000", "10.0.0.1:5000"}));
  status.mutable_view()->mutable_servers(0)->set_alive(false);
  EXPECT_EQ(LiveServers(status), (std::vector<std::string>{"10.0.0.1:5000"}));
  EXPECT_EQ(AllServers(status).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CtlTest, NextCheckpointStepIsAheadOfTheMostAdvancedShard) {
  std::vector<ShardReport> reports = {{"a:1", Shard(0, 41)},
                                      {"b:1", Shard(1, 42)}};
  absl::StatusOr<int64_t> step = NextCheckpointStep(reports, 2);
  SHARDPS_ASSERT_OK(step);
  EXPECT_EQ(*step, 44);

  v1::GetStatusResponse off = Shard(1, 42);
  off.clear_checkpoint_dir();
  reports[1].status = off;
  absl::Status refused = NextCheckpointStep(reports, 2).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.message(), "--checkpoint_dir"))
      << refused;

  v1::GetStatusResponse fresh = Shard(1, 0);
  fresh.set_declared(false);
  reports[1].status = fresh;
  EXPECT_EQ(NextCheckpointStep(reports, 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  reports[1].status = absl::UnavailableError("b:1: connection refused");
  EXPECT_EQ(NextCheckpointStep(reports, 2).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(NextCheckpointStep({}, 2).ok());
}

TEST(CtlTest, CheckpointIsCommittedOnceEveryShardSeesTheCommit) {
  v1::GetStatusResponse s0 = Shard(0, 44), s1 = Shard(1, 43);
  s0.set_last_checkpoint_step(44);
  CheckpointWait wait = CheckCheckpoint({{"a:1", s0}, {"b:1", s1}}, 44);
  SHARDPS_EXPECT_OK(wait.status);
  EXPECT_FALSE(wait.committed);
  EXPECT_EQ(wait.line,
            "checkpoint of step 44: shard 0 at step 44 (written), shard 1 at "
            "step 43");

  s1.set_max_version(45);
  s1.set_last_checkpoint_step(44);
  s0.set_last_committed_checkpoint_step(44);
  s1.set_last_committed_checkpoint_step(44);
  wait = CheckCheckpoint({{"a:1", s0}, {"b:1", s1}}, 44);
  SHARDPS_EXPECT_OK(wait.status);
  EXPECT_TRUE(wait.committed);

  // A shard that could not write it ends the wait.
  s1.set_last_committed_checkpoint_step(0);
  s1.set_failed_checkpoint_step(44);
  s1.set_checkpoint_error("disk full");
  wait = CheckCheckpoint({{"a:1", s0}, {"b:1", s1}}, 44);
  EXPECT_FALSE(wait.committed);
  EXPECT_EQ(wait.status.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(wait.status.message(), "disk full"))
      << wait.status;
  wait =
      CheckCheckpoint({{"a:1", s0}, {"b:1", absl::UnavailableError("x")}}, 44);
  EXPECT_FALSE(wait.committed);
  EXPECT_EQ(wait.status.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace shardps::ctl
