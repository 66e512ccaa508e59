#include "deploy/local/worker_command.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps::local {
namespace {

// The value of `name` in `env`, or "<unset>".
std::string Get(const std::vector<std::string>& env, const std::string& name) {
  std::string value = "<unset>";
  int seen = 0;
  for (const std::string& entry : env) {
    if (absl::StartsWith(entry, name + "=")) {
      value = entry.substr(name.size() + 1);
      ++seen;
    }
  }
  EXPECT_LE(seen, 1) << name << " set twice";
  return value;
}

LaunchOptions Options() {
  LaunchOptions o;
  o.num_servers = 2;
  o.num_workers = 3;
  o.worker_command = {"/usr/bin/python3", "train.py"};
  o.python_dir = "/b/worker/python";
  return o;
}

TEST(WorkerCommandTest, SplitsArgvAtTheFirstDoubleDash) {
  char a0[] = "shardps-local", a1[] = "--workers=2", a2[] = "--", a3[] = "sh",
       a4[] = "-c", a5[] = "--";
  char* argv[] = {a0, a1, a2, a3, a4, a5};
  const CommandLine line = SplitAtCommand(6, argv);
  EXPECT_EQ(line.flags, (std::vector<char*>{a0, a1}));
  EXPECT_EQ(line.command, (std::vector<std::string>{"sh", "-c", "--"}));
  EXPECT_TRUE(line.has_command);

  const CommandLine none = SplitAtCommand(2, argv);
  EXPECT_EQ(none.flags.size(), 2u);
  EXPECT_FALSE(none.has_command);
  const CommandLine empty = SplitAtCommand(3, argv);
  EXPECT_TRUE(empty.has_command);
  EXPECT_TRUE(empty.command.empty());
}

TEST(WorkerCommandTest, RefusesWorkerFlagsInEverySpelling) {
  const std::vector<std::string> names = {"epochs", "nesterov",
                                          "worker_binary"};
  for (const char* arg : {"--epochs=3", "-epochs=3", "--epochs", "--nonesterov",
                          "--nesterov=false", "--worker_binary=/x"}) {
    SCOPED_TRACE(arg);
    const absl::Status s = CheckNoWorkerFlags({"--servers=1", arg}, names);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), arg)) << s;
  }
  // The launcher's own flags, and values that look like names, pass.
  EXPECT_TRUE(CheckNoWorkerFlags({"--servers=1", "--run_dir", "epochs",
                                  "--restart_on_crash", "--noepochsx"},
                                 names)
                  .ok());
}

TEST(WorkerCommandTest, FindsTheCommandOnPath) {
  const std::string dir = testing::MakeTempDir("worker-command");
  const std::string tool = dir + "/tool";
  std::ofstream(tool) << "#!/bin/sh\n";
  chmod(tool.c_str(), 0755);
  std::ofstream(dir + "/plain") << "not executable\n";

  absl::StatusOr<std::string> found =
      FindCommand("tool", "/nonexistent::" + dir);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, tool);
  EXPECT_EQ(FindCommand(tool, "").value_or(""), tool);
  EXPECT_EQ(FindCommand("plain", dir).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FindCommand(dir + "/plain", "").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FindCommand("", dir).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WorkerCommandTest, EnvironmentNamesTheCoordinatorRankAndRunDir) {
  const std::vector<std::string> env =
      WorkerCommandEnv(Options(), RunDir("/r"), 1, "127.0.0.1:7000", {},
                       {"HOME=/home/u", "PATH=/usr/bin"});
  EXPECT_EQ(Get(env, "SHARDPS_COORDINATOR"), "127.0.0.1:7000");
  EXPECT_EQ(Get(env, "SHARDPS_SERVERS"), "<unset>");
  EXPECT_EQ(Get(env, "SHARDPS_JOB_ID"), "shardps");
  EXPECT_EQ(Get(env, "SHARDPS_RANK"), "1");
  EXPECT_EQ(Get(env, "SHARDPS_NUM_WORKERS"), "3");
  EXPECT_EQ(Get(env, "SHARDPS_RUN_DIR"), "/r");
  EXPECT_EQ(Get(env, "SHARDPS_CHECKPOINT_DIR"), "<unset>");
  EXPECT_EQ(Get(env, "SHARDPS_TLS_CERT"), "<unset>");
  EXPECT_EQ(Get(env, "PYTHONPATH"), "/b/worker/python");
  EXPECT_EQ(Get(env, "PYTHONUNBUFFERED"), "1");
  EXPECT_EQ(Get(env, "HOME"), "/home/u");
  EXPECT_EQ(Get(env, "PATH"), "/usr/bin");
}

TEST(WorkerCommandTest, StaticModeGivesTheServersInShardOrder) {
  const std::vector<std::string> env = WorkerCommandEnv(
      Options(), RunDir("/r"), 0, "", {"127.0.0.1:5001", "127.0.0.1:5000"}, {});
  EXPECT_EQ(Get(env, "SHARDPS_SERVERS"), "127.0.0.1:5001,127.0.0.1:5000");
  EXPECT_EQ(Get(env, "SHARDPS_COORDINATOR"), "<unset>");
}

TEST(WorkerCommandTest, SecurityFlagsAndCheckpointsBecomeVariables) {
  LaunchOptions o = Options();
  o.security_args = {"--tls_cert=/t/tls.crt", "--tls_key=/t/tls.key",
                     "--tls_ca=/t/ca.crt", "--auth_token_file=/t/token",
                     "--tls_server_name=shardps"};
  o.checkpoint_dir = "/r/checkpoints";
  const std::vector<std::string> env =
      WorkerCommandEnv(o, RunDir("/r"), 0, "127.0.0.1:7000", {}, {});
  EXPECT_EQ(Get(env, "SHARDPS_TLS_CERT"), "/t/tls.crt");
  EXPECT_EQ(Get(env, "SHARDPS_TLS_KEY"), "/t/tls.key");
  EXPECT_EQ(Get(env, "SHARDPS_TLS_CA"), "/t/ca.crt");
  EXPECT_EQ(Get(env, "SHARDPS_AUTH_TOKEN_FILE"), "/t/token");
  EXPECT_EQ(Get(env, "SHARDPS_TLS_SERVER_NAME"), "shardps");
  EXPECT_EQ(Get(env, "SHARDPS_CHECKPOINT_DIR"), "/r/checkpoints");
}

TEST(WorkerCommandTest, EmulatedHostsTurnSharedMemoryOffAndGiveTheRate) {
  LaunchOptions o = Options();
  o.emulate_hosts = true;
  o.link_bits_per_second = 100000000;
  std::vector<std::string> env = WorkerCommandEnv(
      o, RunDir("/r"), 0, "10.213.0.1:7000", {}, {"SHARDPS_SHARED_MEMORY=1"});
  EXPECT_EQ(Get(env, "SHARDPS_SHARED_MEMORY"), "0");
  EXPECT_EQ(Get(env, "SHARDPS_LINK_RATE"), "100000000bit");
  // A rate the user set is theirs.
  env = WorkerCommandEnv(o, RunDir("/r"), 0, "10.213.0.1:7000", {},
                         {"SHARDPS_LINK_RATE=1gbit"});
  EXPECT_EQ(Get(env, "SHARDPS_LINK_RATE"), "1gbit");
  o.emulate_hosts = false;
  env = WorkerCommandEnv(o, RunDir("/r"), 0, "127.0.0.1:7000", {}, {});
  EXPECT_EQ(Get(env, "SHARDPS_LINK_RATE"), "<unset>");
}

TEST(WorkerCommandTest, LauncherVariablesReplaceInheritedOnes) {
  LaunchOptions o = Options();
  const std::vector<std::string> inherited = {
      "SHARDPS_SERVERS=10.0.0.1:5000", "SHARDPS_RANK=7",
      "SHARDPS_TLS_CA=/old/ca.crt",    "SHARDPS_CONNECT_TIMEOUT_S=9",
      "PYTHONPATH=/site:/more",        "PYTHONUNBUFFERED=0"};
  std::vector<std::string> env =
      WorkerCommandEnv(o, RunDir("/r"), 2, "127.0.0.1:7000", {}, inherited);
  EXPECT_EQ(Get(env, "SHARDPS_SERVERS"), "<unset>");
  EXPECT_EQ(Get(env, "SHARDPS_RANK"), "2");
  EXPECT_EQ(Get(env, "SHARDPS_TLS_CA"), "<unset>");
  // Settings the launcher does not own pass through.
  EXPECT_EQ(Get(env, "SHARDPS_CONNECT_TIMEOUT_S"), "9");
  EXPECT_EQ(Get(env, "PYTHONPATH"), "/b/worker/python:/site:/more");
  EXPECT_EQ(Get(env, "PYTHONUNBUFFERED"), "0");

  // Without a build tree package the user's PYTHONPATH stays as it was;
  // an empty one is dropped rather than turned into the current directory.
  o.python_dir.clear();
  env = WorkerCommandEnv(o, RunDir("/r"), 0, "127.0.0.1:7000", {}, inherited);
  EXPECT_EQ(Get(env, "PYTHONPATH"), "/site:/more");
  env = WorkerCommandEnv(o, RunDir("/r"), 0, "127.0.0.1:7000", {},
                         {"PYTHONPATH="});
  EXPECT_EQ(Get(env, "PYTHONPATH"), "<unset>");
}

}  // namespace
}  // namespace shardps::local
