// A shard served in this process over gRPC, and one-push PushPull calls to
// it, for tests of the ParameterServer service. Test-only.
#ifndef SHARDPS_SERVER_SERVICE_TESTING_H_
#define SHARDPS_SERVER_SERVICE_TESTING_H_

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "common/shm_protocol.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/shard_server.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {

// One PushPull call of one request (naming `shm_metadata` as its region when
// not empty); the reply, or the call's status.
inline grpc::Status PushPullOnce(v1::ParameterServer::Stub* stub,
                                 const v1::PushPullRequest& req,
                                 v1::PushPullResponse* resp,
                                 const std::string& shm_metadata = "",
                                 const std::string& gradients_metadata = "",
                                 const std::string& weights_metadata = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!shm_metadata.empty()) {
    ctx.AddMetadata(shm::kStreamRegionKey, shm_metadata);
  }
  if (!gradients_metadata.empty()) {
    ctx.AddMetadata(shm::kGradientRegionKey, gradients_metadata);
  }
  if (!weights_metadata.empty()) {
    ctx.AddMetadata(shm::kWeightRegionKey, weights_metadata);
  }
  auto stream = stub->PushPull(&ctx);
  stream->Write(req);
  stream->WritesDone();
  const bool got = stream->Read(resp);
  grpc::Status status = stream->Finish();
  if (status.ok() && !got) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "no reply");
  }
  return status;
}

// A test fixture's shard: Serve starts it and declares a model on it.
class ServedShard {
 public:
  ~ServedShard() {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(1));
  }
  // Call with ASSERT_NO_FATAL_FAILURE.
  void Serve(ShardServerOptions options, const v1::DeclareRequest& declare) {
    absl::StatusOr<std::unique_ptr<ShardServer>> server =
        ShardServer::Start(std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = v1::ParameterServer::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->Declare(&ctx, declare, &declared_);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  v1::ParameterServer::Stub* stub() const { return stub_.get(); }
  const v1::DeclareResponse& declared() const { return declared_; }

 private:
  std::unique_ptr<ShardServer> server_;
  std::unique_ptr<v1::ParameterServer::Stub> stub_;
  v1::DeclareResponse declared_;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_SERVICE_TESTING_H_
