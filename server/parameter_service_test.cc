// The ParameterServer service over gRPC, in-process: the PushPullRequest
// fields a worker-side optimizer sets (initial_values, learning_rate,
// no_gradient) reach the store, and DeclareResponse.awaiting_values and Pull
// report chunks that wait for their values; a stream whose gradient the
// store keeps early is not read further until it is used.
#include "server/parameter_service.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/service_testing.h"
#include "server/shard_server.h"
#include "server/store_testing.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {
namespace {

std::vector<float> Values(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

grpc::Status PullAll(v1::ParameterServer::Stub* stub,
                     std::vector<v1::PushPullResponse>* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Pull(&ctx, v1::PullRequest());
  v1::PushPullResponse r;
  while (reader->Read(&r)) out->push_back(r);
  return reader->Finish();
}

TEST(ParameterServiceTest, WorkerProvidedValuesAndRatesOverTheWire) {
  ShardServerOptions o;
  o.store.num_workers = 1;
  absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(o);
  SHARDPS_ASSERT_OK(server);
  auto stub = v1::ParameterServer::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials()));

  // One tensor "w" of 4 floats, SGD with lr 1, values from the worker.
  v1::DeclareRequest declare = SgdDeclaration(4, 0, 1, 0);
  declare.mutable_layout()->mutable_tensors(0)->mutable_init()->set_kind(
      v1::InitSpec::KIND_PROVIDED);
  v1::DeclareResponse declared;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Declare(&ctx, declare, &declared).ok());
  }
  EXPECT_TRUE(declared.awaiting_values());
  std::vector<v1::PushPullResponse> pulled;
  grpc::Status pull = PullAll(stub.get(), &pulled);
  EXPECT_EQ(pull.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(pull.error_message(),
            "chunk 0 (w) waits for its initial values: the declaring worker "
            "sends them");
  EXPECT_TRUE(pulled.empty());

  v1::PushPullRequest values;
  values.set_chunk_id(0);
  values.set_encoding(v1::ENCODING_FP32);
  values.set_initial_values(true);
  values.set_payload(Bytes({1, 2, 3, 4}));
  v1::PushPullResponse reply;
  ASSERT_TRUE(PushPullOnce(stub.get(), values, &reply).ok());
  EXPECT_EQ(Values(reply.payload()), std::vector<float>({1, 2, 3, 4}));
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Declare(&ctx, declare, &declared).ok());
  }
  EXPECT_FALSE(declared.awaiting_values());

  // Step 0 at lr 0.5 (not the declared 1): w = (1, 2, 3, 4) - 0.5 * 2.
  v1::PushPullRequest grad;
  grad.set_chunk_id(0);
  grad.set_encoding(v1::ENCODING_FP32);
  grad.set_step(0);
  grad.set_learning_rate(0.5f);
  grad.set_payload(Bytes({2, 2, 2, 2}));
  ASSERT_TRUE(PushPullOnce(stub.get(), grad, &reply).ok());
  EXPECT_EQ(reply.version(), 1);
  EXPECT_EQ(Values(reply.payload()), std::vector<float>({0, 1, 2, 3}));

  // Step 1 without a gradient: skipped, the version still moves on.
  v1::PushPullRequest none;
  none.set_chunk_id(0);
  none.set_step(1);
  none.set_no_gradient(true);
  ASSERT_TRUE(PushPullOnce(stub.get(), none, &reply).ok());
  EXPECT_EQ(reply.version(), 2);
  EXPECT_EQ(Values(reply.payload()), std::vector<float>({0, 1, 2, 3}));

  // A bad learning rate ends the stream with INVALID_ARGUMENT.
  grad.set_step(2);
  grad.set_learning_rate(-1);
  const grpc::Status refused = PushPullOnce(stub.get(), grad, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << refused.error_message();

  pulled.clear();
  ASSERT_TRUE(PullAll(stub.get(), &pulled).ok());
  ASSERT_EQ(pulled.size(), 1u);
  EXPECT_EQ(pulled[0].version(), 2);
  EXPECT_EQ(Values(pulled[0].payload()), std::vector<float>({0, 1, 2, 3}));
  (*server)->Shutdown(absl::Seconds(1));
}

uint64_t PushesSoFar(v1::ParameterServer::Stub* stub) {
  grpc::ClientContext ctx;
  v1::GetStatusResponse status;
  EXPECT_TRUE(stub->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
  return status.pushes_total();
}

v1::PushPullRequest Gradient(uint32_t rank, uint32_t chunk, float value) {
  v1::PushPullRequest req;
  req.set_rank(rank);
  req.set_chunk_id(chunk);
  req.set_encoding(v1::ENCODING_FP32);
  req.set_step(0);
  req.set_payload(Bytes({value, value}));
  return req;
}

TEST(ParameterServiceTest, AStreamWhoseGradientCameEarlyReadsNoMoreUntilUsed) {
  // Two workers, two chunks of two floats. Rank 1 pushes both chunks before
  // rank 0 pushes anything: its first gradient must wait for rank 0's (the
  // sum is in rank order), so its stream is not read further meanwhile.
  ShardServerOptions o;
  o.store.num_workers = 2;
  absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(o);
  SHARDPS_ASSERT_OK(server);
  auto stub = v1::ParameterServer::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::DeclareResponse declared;
    ASSERT_TRUE(
        stub->Declare(&ctx, SgdDeclaration(4, 8, 1, 0), &declared).ok());
  }
  auto open = [&](grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(30));
    return stub->PushPull(ctx);
  };
  grpc::ClientContext ctx1, ctx0;
  auto rank1 = open(&ctx1);
  ASSERT_TRUE(rank1->Write(Gradient(1, 0, 3)));
  ASSERT_TRUE(rank1->Write(Gradient(1, 1, 5)));
  // Its first push is taken (and held); the second stays unread.
  for (int i = 0; i < 200 && PushesSoFar(stub.get()) < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(PushesSoFar(stub.get()), 1u);
  auto rank0 = open(&ctx0);
  ASSERT_TRUE(rank0->Write(Gradient(0, 0, 1)));
  // Chunk 0 completes; rank 1's stream reads on and its chunk 1 waits for
  // rank 0's in turn.
  v1::PushPullResponse reply;
  ASSERT_TRUE(rank0->Read(&reply));
  EXPECT_EQ(reply.chunk_id(), 0u);
  EXPECT_EQ(Values(reply.payload()), std::vector<float>({-1, -1}));  // 1 - 2
  for (int i = 0; i < 200 && PushesSoFar(stub.get()) < 3; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(PushesSoFar(stub.get()), 3u);
  ASSERT_TRUE(rank0->Write(Gradient(0, 1, 1)));
  ASSERT_TRUE(rank0->Read(&reply));
  EXPECT_EQ(reply.chunk_id(), 1u);
  EXPECT_EQ(Values(reply.payload()), std::vector<float>({-2, -2}));  // 1 - 3
  rank0->WritesDone();
  EXPECT_TRUE(rank0->Finish().ok());
  std::vector<uint32_t> answered;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(rank1->Read(&reply));
    answered.push_back(reply.chunk_id());
  }
  EXPECT_EQ(answered, std::vector<uint32_t>({0, 1}));
  rank1->WritesDone();
  EXPECT_TRUE(rank1->Finish().ok());
  (*server)->Shutdown(absl::Seconds(1));
}

}  // namespace
}  // namespace shardps::server
