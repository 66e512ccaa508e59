// TLS, mutual TLS and the bearer token against the real daemons. The
// certificates are made at test time with deploy/tls/make-certs.sh: the
// job's CA and certificate, and an unrelated CA with a certificate of its
// own. Every wrong client (plaintext, wrong or no CA, no or a foreign client
// certificate, no or a wrong token) is refused with UNAVAILABLE or
// UNAUTHENTICATED and changes nothing; the right one trains a whole job.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "common/status_matchers.h"
#include "coordinator/coordinator_protocol.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "shardps/v1/coordinator.grpc.pb.h"
#include "shardps/v1/parameter_server.grpc.pb.h"
#include "tests/testing/e2e.h"
#include "tests/testing/test_cluster.h"
#include "worker/client.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::MustRun;
using ::shardps::testing::ReadFile;
using ::shardps::testing::TestCluster;

constexpr char kMakeCerts[] = SHARDPS_SOURCE_DIR "/deploy/tls/make-certs.sh";

// A client's configuration and the codes it may get.
struct BadClient {
  std::string name;
  SecurityFiles files;
  std::set<grpc::StatusCode> codes;
};

class SecurityE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(shardps::testing::MakeTempDir("security_e2e"));
    for (const char* sub : {"job", "other"}) {
      const std::string cmd =
          absl::StrCat(kMakeCerts, " ", *dir_, "/", sub, " >/dev/null 2>&1");
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    std::ofstream(Path("wrong-token")) << "not-the-token\n";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string Path(const std::string& name) {
    return absl::StrCat(*dir_, "/", name);
  }

  // The job's certificate, CA and token: what every daemon and good client
  // uses.
  static SecurityFiles GoodFiles() {
    SecurityFiles f;
    f.tls_cert = Path("job/tls.crt");
    f.tls_key = Path("job/tls.key");
    f.tls_ca = Path("job/ca.crt");
    f.auth_token_file = Path("job/token");
    return f;
  }
  static std::vector<std::string> DaemonFlags() {
    const SecurityFiles f = GoodFiles();
    return {"--tls_cert=" + f.tls_cert, "--tls_key=" + f.tls_key,
            "--tls_ca=" + f.tls_ca, "--auth_token_file=" + f.auth_token_file};
  }
  static SecurityOptions Load(const SecurityFiles& files) {
    absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(files);
    EXPECT_TRUE(o.ok()) << o.status();
    return o.ok() ? *std::move(o) : SecurityOptions();
  }

  static std::vector<BadClient> BadClients() {
    const std::set<grpc::StatusCode> refused = {grpc::StatusCode::UNAVAILABLE};
    const std::set<grpc::StatusCode> unauthenticated = {
        grpc::StatusCode::UNAUTHENTICATED};
    std::vector<BadClient> bad;
    bad.push_back({"plaintext", SecurityFiles(), refused});
    SecurityFiles f = GoodFiles();
    f.tls_ca.clear();  // the system's roots do not know the job's CA
    bad.push_back({"no CA", f, refused});
    f = GoodFiles();
    f.tls_ca = Path("other/ca.crt");
    bad.push_back({"wrong CA", f, refused});
    f = GoodFiles();
    f.tls_cert.clear();
    f.tls_key.clear();
    bad.push_back({"no client certificate", f, refused});
    f = GoodFiles();
    f.tls_cert = Path("other/tls.crt");
    f.tls_key = Path("other/tls.key");
    bad.push_back({"client certificate of another CA", f, refused});
    f = GoodFiles();
    f.auth_token_file.clear();
    bad.push_back({"no token", f, unauthenticated});
    f = GoodFiles();
    f.auth_token_file = Path("wrong-token");
    bad.push_back({"wrong token", f, unauthenticated});
    return bad;
  }

  static std::string* dir_;
};
std::string* SecurityE2eTest::dir_ = nullptr;

// `bad`'s call was refused with one of the codes it may get.
void ExpectRefused(const BadClient& bad, const grpc::Status& s) {
  EXPECT_TRUE(bad.codes.count(s.error_code()))
      << s.error_code() << " " << s.error_message();
}

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

v1::Layout SmallLayout(int64_t rows) {
  v1::Layout layout;
  v1::TensorSpec* t = layout.add_tensors();
  t->set_name("w");
  t->add_shape(rows);
  t->add_shape(4);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_NORMAL);
  t->mutable_init()->set_value(0.1f);
  t->mutable_init()->set_seed(7);
  return layout;
}

v1::OptimizerSpec Sgd() {
  v1::OptimizerSpec o;
  o.set_kind(v1::OptimizerSpec::KIND_SGD);
  o.set_learning_rate(0.5f);
  return o;
}

std::unique_ptr<v1::ParameterServer::Stub> ShardStub(
    const std::string& address, const SecurityOptions& security) {
  return v1::ParameterServer::NewStub(
      MakeChannel(address, security, grpc::ChannelArguments()));
}

// What a client may observe of a shard; equal before and after refused
// calls.
std::string ShardState(const v1::GetStatusResponse& s) {
  return absl::StrCat(
      "declared=", s.declared(), " fingerprint=", s.fingerprint(),
      " version=", s.min_version(), "..", s.max_version(),
      " pushes=", s.pushes_total(), " updates=", s.updates_total(),
      " rejected=", s.rejected_total());
}

TEST_F(SecurityE2eTest, ShardRefusesWrongClientsAndServesTheRightOne) {
  ClusterOptions o;
  o.server_flags = DaemonFlags();
  TestCluster cluster(std::move(o));
  Daemon* server = cluster.StartServer();
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  const SecurityOptions good = Load(GoodFiles());

  auto good_status = [&]() {
    v1::GetStatusResponse s;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    const grpc::Status status =
        ShardStub(address, good)->GetStatus(&ctx, {}, &s);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return ShardState(s);
  };
  // Each wrong client tries to declare a model and to read the status.
  auto try_bad_clients = [&](int64_t rows) {
    for (const BadClient& bad : BadClients()) {
      SCOPED_TRACE(bad.name);
      std::unique_ptr<v1::ParameterServer::Stub> stub =
          ShardStub(address, Load(bad.files));
      v1::DeclareRequest declare;
      *declare.mutable_layout() = SmallLayout(rows);
      *declare.mutable_optimizer() = Sgd();
      declare.set_num_shards(1);
      v1::DeclareResponse declared;
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      ExpectRefused(bad, stub->Declare(&ctx, declare, &declared));
      v1::GetStatusResponse status;
      grpc::ClientContext status_ctx;
      SetDeadline(&status_ctx);
      ExpectRefused(bad, stub->GetStatus(&status_ctx, {}, &status));
    }
  };

  const std::string fresh = good_status();
  EXPECT_TRUE(absl::StartsWith(fresh, "declared=0")) << fresh;
  try_bad_clients(8);
  EXPECT_EQ(good_status(), fresh);

  // The right client declares and trains a step.
  ClientOptions options;
  options.servers = {address};
  options.security = good;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  SHARDPS_ASSERT_OK(client);
  SHARDPS_ASSERT_OK((*client)->Declare(SmallLayout(8), Sgd()));
  std::vector<float> w(32), g(32, 1.0f), before(32), after(32);
  SHARDPS_ASSERT_OK((*client)->Pull({absl::MakeSpan(before)}));
  SHARDPS_ASSERT_OK((*client)->PushPull(0, {g}, {absl::MakeSpan(w)}));
  for (size_t i = 0; i < w.size(); ++i) EXPECT_FLOAT_EQ(w[i], before[i] - 0.5f);
  const std::string trained = good_status();
  EXPECT_TRUE(absl::StrContains(trained, "updates=1")) << trained;

  // A different model from a wrong client would be FAILED_PRECONDITION and
  // counted as rejected if it got through.
  try_bad_clients(16);
  EXPECT_EQ(good_status(), trained);
  SHARDPS_ASSERT_OK((*client)->Pull({absl::MakeSpan(after)}));
  EXPECT_EQ(after, w);
  EXPECT_TRUE(absl::StrContains(
      server->ReadLog(),
      "TLS with client certificates required; bearer token required"))
      << server->ReadLog();
}

// Runs shardps-ctl with `args`; returns its exit code and output.
std::pair<int, std::string> Ctl(std::vector<std::string> args) {
  CommandResult r = MustRun(SHARDPS_CTL_BIN, std::move(args));
  return {r.code, std::move(r.output)};
}

TEST_F(SecurityE2eTest, CoordinatorRefusesWrongClientsAndCtlUsesTheFlags) {
  ClusterOptions o;
  o.coordinated = true;
  o.coordinator_flags = DaemonFlags();
  TestCluster cluster(std::move(o));
  Daemon* coordinator = cluster.StartCoordinator();
  ASSERT_NE(coordinator, nullptr);
  const std::string address = coordinator->address();

  for (const BadClient& bad : BadClients()) {
    SCOPED_TRACE(bad.name);
    std::unique_ptr<v1::Coordinator::Stub> stub = v1::Coordinator::NewStub(
        MakeChannel(address, Load(bad.files), grpc::ChannelArguments()));
    v1::JoinRequest join;
    join.set_job_id("e2e");
    join.set_protocol_version(coordinator::kCoordinatorProtocolVersion);
    join.set_role(v1::ROLE_SERVER);
    join.set_address("127.0.0.1:1");
    join.set_requested_index(0);
    v1::JoinResponse joined;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    ExpectRefused(bad, stub->Join(&ctx, join, &joined));
  }

  // Nobody joined: no slot was ever held.
  std::unique_ptr<v1::Coordinator::Stub> stub = v1::Coordinator::NewStub(
      MakeChannel(address, Load(GoodFiles()), grpc::ChannelArguments()));
  v1::JobStatus status;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  const grpc::Status s = stub->GetJobStatus(&ctx, {}, &status);
  ASSERT_TRUE(s.ok()) << s.error_message();
  for (const v1::MemberStatus& m : status.members()) {
    EXPECT_FALSE(m.alive()) << m.DebugString();
    EXPECT_EQ(m.heartbeat_age_ms(), -1) << m.DebugString();
  }

  // shardps-ctl with the job's flags; health also without the token.
  const std::vector<std::string> tls = DaemonFlags();
  std::vector<std::string> status_args = {"status", "--coordinator=" + address};
  std::vector<std::string> good_args = status_args;
  good_args.insert(good_args.end(), tls.begin(), tls.end());
  auto [code, out] = Ctl(good_args);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "e2e")) << out;
  std::tie(code, out) = Ctl(status_args);
  EXPECT_EQ(code, 1) << out;
  std::vector<std::string> no_token = status_args;
  no_token.insert(no_token.end(), tls.begin(), tls.end() - 1);
  std::tie(code, out) = Ctl(no_token);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "UNAUTHENTICATED")) << out;
  std::vector<std::string> health = {"health", "--addr=" + address};
  health.insert(health.end(), tls.begin(), tls.end() - 1);
  std::tie(code, out) = Ctl(health);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "SERVING")) << out;
  std::tie(code, out) = Ctl({"health", "--addr=" + address});
  EXPECT_EQ(code, 1) << out;
}

TEST_F(SecurityE2eTest, WholeJobTrainsWithMutualTlsAndToken) {
  const std::string run_dir = Path("run");
  std::vector<std::string> args = {
      "--servers=2",           "--workers=2",      "--dataset=fashion-mnist",
      "--model=mlp:784-32-10", "--epochs=1",       "--train_limit=2048",
      "--test_limit=1000",     "--batch_size=128", "--timeout_s=240",
      "--run_dir=" + run_dir};
  const std::vector<std::string> tls = DaemonFlags();
  args.insert(args.end(), tls.begin(), tls.end());
  const CommandResult local =
      MustRun(SHARDPS_LOCAL_BIN, args, absl::Seconds(300));
  EXPECT_EQ(local.code, 0) << local.output;
  EXPECT_TRUE(absl::StrContains(local.output, "final: epoch=1"))
      << local.output;
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/model.safetensors"));
  for (const char* log : {"coordinator", "server-0", "server-1"}) {
    const std::string text =
        ReadFile(absl::StrCat(run_dir, "/logs/", log, ".log"));
    EXPECT_TRUE(absl::StrContains(
        text, "TLS with client certificates required; bearer token required"))
        << log << ":\n"
        << text;
  }
}

TEST_F(SecurityE2eTest, EveryBinaryRejectsBadSecurityFlags) {
  const std::string missing = Path("missing.crt");
  struct Case {
    const char* binary;
    std::vector<std::string> args;
    std::string want;
  };
  const std::vector<Case> cases = {
      {SHARDPS_SERVER_BIN,
       {"--tls_cert=" + missing, "--tls_key=" + Path("job/tls.key")},
       "--tls_cert=" + missing},
      {SHARDPS_COORDINATOR_BIN,
       {"--tls_cert=" + Path("job/tls.crt")},
       "--tls_cert needs --tls_key"},
      {SHARDPS_SERVER_BIN,
       {"--auth_token_file=" + Path("job/token")},
       "--auth_token_file needs TLS"},
      {SHARDPS_COORDINATOR_BIN,
       {"--tls_ca=" + Path("job/ca.crt")},
       "--tls_ca on a daemon needs --tls_cert"},
      {SHARDPS_WORKER_BIN,
       {"--servers=127.0.0.1:1", "--tls_ca=" + missing},
       "--tls_ca=" + missing},
      {SHARDPS_CTL_BIN,
       {"health", "--addr=127.0.0.1:1", "--tls_key=" + Path("job/tls.key")},
       "--tls_key needs --tls_cert"},
      {SHARDPS_LOCAL_BIN,
       {"--run_dir=" + Path("bad-run"), "--tls_ca=" + Path("job/ca.crt")},
       "--tls_ca on a daemon needs --tls_cert"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.binary, " ", c.want));
    const CommandResult r = MustRun(c.binary, c.args);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.want)) << r.output;
  }
}

}  // namespace
}  // namespace shardps
