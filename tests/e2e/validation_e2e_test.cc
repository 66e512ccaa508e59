// Bad input over the wire: each malformed request to a real shardps-server
// gets its gRPC code and a message naming the problem, and changes nothing.
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "shardps/v1/parameter_server.grpc.pb.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::Daemon;
using ::shardps::testing::TestCluster;

v1::DeclareRequest Declaration() {
  v1::DeclareRequest req;
  v1::TensorSpec* t = req.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(8);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_CONSTANT);
  t->mutable_init()->set_value(1.0f);
  req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  req.mutable_optimizer()->set_learning_rate(1.0f);
  req.set_num_shards(1);
  req.set_shard_index(0);
  return req;
}

v1::PushPullRequest GoodPush() {
  v1::PushPullRequest req;
  req.set_rank(0);
  req.set_step(0);
  req.set_chunk_id(0);
  req.set_encoding(v1::ENCODING_FP32);
  std::vector<float> g(8, 0.5f);
  req.set_payload(std::string(reinterpret_cast<const char*>(g.data()), 32));
  return req;
}

// One static server, talked to with raw requests.
ClusterOptions OneServer() {
  ClusterOptions o;
  o.server_flags = {"--max_message_bytes=65536"};
  return o;
}

class ValidationTest : public ::testing::Test {
 protected:
  ValidationTest() : cluster_(OneServer()) {}

  void SetUp() override {
    Daemon* server = cluster_.StartServer();
    ASSERT_NE(server, nullptr);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    stub_ = v1::ParameterServer::NewStub(grpc::CreateCustomChannel(
        server->address(), grpc::InsecureChannelCredentials(), args));
  }

  grpc::Status Declare(const v1::DeclareRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::DeclareResponse resp;
    return stub_->Declare(&ctx, req, &resp);
  }

  // Sends one push; returns the stream's status and the replies.
  grpc::Status PushOne(const v1::PushPullRequest& req,
                       std::vector<v1::PushPullResponse>* replies = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    auto stream = stub_->PushPull(&ctx);
    stream->Write(req);
    stream->WritesDone();
    v1::PushPullResponse resp;
    while (stream->Read(&resp)) {
      if (replies != nullptr) replies->push_back(resp);
    }
    return stream->Finish();
  }

  std::vector<float> Weights() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    auto reader = stub_->Pull(&ctx, v1::PullRequest());
    v1::PushPullResponse resp;
    std::vector<float> w;
    while (reader->Read(&resp)) {
      w.resize(resp.payload().size() / 4);
      std::memcpy(w.data(), resp.payload().data(), resp.payload().size());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return w;
  }

  TestCluster cluster_;
  std::unique_ptr<v1::ParameterServer::Stub> stub_;
};

TEST_F(ValidationTest, PushBeforeDeclareIsFailedPrecondition) {
  grpc::Status s = PushOne(GoodPush());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("Declare"), std::string::npos);
}

TEST_F(ValidationTest, EachMalformedPushGetsItsCodeAndChangesNothing) {
  ASSERT_TRUE(Declare(Declaration()).ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* what;
    std::function<void(v1::PushPullRequest*)> mutate;
    grpc::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases = {
      {"unknown chunk", [](auto* r) { r->set_chunk_id(9); },
       grpc::StatusCode::NOT_FOUND, "chunk 9 is not declared"},
      {"short payload", [](auto* r) { r->mutable_payload()->resize(31); },
       grpc::StatusCode::INVALID_ARGUMENT, "needs 32"},
      {"unknown encoding",
       [](auto* r) { r->set_encoding(static_cast<v1::Encoding>(7)); },
       grpc::StatusCode::INVALID_ARGUMENT, "unsupported encoding"},
      {"nan gradient",
       [nan](auto* r) {
         std::memcpy(r->mutable_payload()->data() + 8, &nan, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "non-finite value at element 2"},
      {"rank out of range", [](auto* r) { r->set_rank(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "rank 1 is out of range"},
      {"future step", [](auto* r) { r->set_step(3); },
       grpc::StatusCode::OUT_OF_RANGE, "future"},
      {"negative step", [](auto* r) { r->set_step(-1); },
       grpc::StatusCode::INVALID_ARGUMENT, "step -1 is negative"},
      {"oversize message",
       [](auto* r) { r->mutable_payload()->resize(1 << 20); },
       grpc::StatusCode::RESOURCE_EXHAUSTED, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PushPullRequest req = GoodPush();
    c.mutate(&req);
    std::vector<v1::PushPullResponse> replies;
    grpc::Status s = PushOne(req, &replies);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos)
        << s.error_message();
    EXPECT_TRUE(replies.empty());
    EXPECT_EQ(Weights(), std::vector<float>(8, 1.0f));
  }
  // The server still works: a good push is applied (w = 1 - 0.5).
  std::vector<v1::PushPullResponse> replies;
  ASSERT_TRUE(PushOne(GoodPush(), &replies).ok());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].version(), 1);
  EXPECT_EQ(Weights(), std::vector<float>(8, 0.5f));
  // Now step 0 is in the past by one (a retry) and -1... step 5 is future;
  // a step two behind is rejected as past.
  v1::PushPullRequest next = GoodPush();
  next.set_step(1);
  ASSERT_TRUE(PushOne(next).ok());
  v1::PushPullRequest old = GoodPush();
  old.set_step(0);
  grpc::Status s = PushOne(old);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_NE(s.error_message().find("past"), std::string::npos);
}

TEST_F(ValidationTest, BadDeclarationsAreRejected) {
  v1::DeclareRequest no_tensors = Declaration();
  no_tensors.mutable_layout()->clear_tensors();
  EXPECT_EQ(Declare(no_tensors).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::DeclareRequest wrong_shard = Declaration();
  wrong_shard.set_num_shards(2);
  grpc::Status s = Declare(wrong_shard);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("shard 0 of 1"), std::string::npos);
  v1::DeclareRequest bad_lr = Declaration();
  bad_lr.mutable_optimizer()->set_learning_rate(-1.0f);
  EXPECT_EQ(Declare(bad_lr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Declare(Declaration()).ok());
  ASSERT_TRUE(Declare(Declaration()).ok());  // idempotent
  v1::DeclareRequest other = Declaration();
  other.mutable_layout()->mutable_tensors(0)->set_shape(0, 9);
  EXPECT_EQ(Declare(other).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Weights(), std::vector<float>(8, 1.0f));
}

TEST_F(ValidationTest, PullOfAnUnknownChunkIsNotFound) {
  ASSERT_TRUE(Declare(Declaration()).ok());
  grpc::ClientContext ctx;
  v1::PullRequest req;
  req.add_chunk_ids(4);
  auto reader = stub_->Pull(&ctx, req);
  v1::PushPullResponse resp;
  EXPECT_FALSE(reader->Read(&resp));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace shardps
