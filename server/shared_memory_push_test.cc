// PushPull and Pull through shared memory, over gRPC with an in-process
// shard: a worker's region (common/shared_memory.h) carries the gradient in
// and the weights out, the Declare probe tells a co-located worker, and
// every malformed use is refused with a clear error and changes nothing.
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/message_ring.h"
#include "common/shared_memory.h"
#include "common/shm_protocol.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/service_testing.h"
#include "server/shard_server.h"
#include "server/store_testing.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {
namespace {

using ::testing::HasSubstr;

std::vector<float> At(const SharedRegion& r, uint64_t offset, int n) {
  std::vector<float> v(n);
  std::memcpy(v.data(), r.data() + offset, 4 * n);
  return v;
}

class SharedMemoryPushTest : public ::testing::Test {
 protected:
  void Start(bool shared_memory = true, bool rings = true) {
    ShardServerOptions o;
    o.store.num_workers = 1;
    o.service.shared_memory = shared_memory;
    o.service.shared_memory_rings = rings;
    // One tensor "w" of 4 floats, all 1; SGD with lr 1.
    ASSERT_NO_FATAL_FAILURE(shard_.Serve(o, SgdDeclaration(4, 0, 1, 0)));
    stub_ = shard_.stub();
  }
  // One PushPull call naming `metadata` (none when empty) with `req`.
  grpc::Status PushOnce(const std::string& metadata,
                        const v1::PushPullRequest& req,
                        v1::PushPullResponse* resp,
                        const std::string& gradients = "",
                        const std::string& weights = "") {
    return PushPullOnce(stub_, req, resp, metadata, gradients, weights);
  }
  static std::string Named(const SharedRegion& r) {
    return absl::StrCat(r.path(), " ", r.size());
  }
  // Declares the shard's model with a fresh 16-byte probe region.
  void DeclareWithProbe(v1::DeclareResponse* resp) {
    SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> probe,
                                 SharedRegion::Create(16));
    v1::DeclareRequest req = SgdDeclaration(4, 0, 1, 0);
    req.set_shared_memory_probe(probe->path());
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Declare(&ctx, req, resp).ok());
  }
  v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse s;
    EXPECT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &s).ok());
    return s;
  }
  // A step-0 push of 4 floats of 2 at offset 0, reply asked at 64.
  static v1::PushPullRequest ShmPush() {
    v1::PushPullRequest req;
    req.set_chunk_id(0);
    req.set_encoding(v1::ENCODING_FP32);
    req.set_step(0);
    req.set_shm_offset(0);
    req.set_shm_bytes(16);
    req.set_reply_shm_offset(64);
    return req;
  }
  // One Pull call naming `metadata` (none when empty) with `req`: its
  // replies, or its status.
  grpc::Status PullOnce(const std::string& metadata, const v1::PullRequest& req,
                        std::vector<v1::PushPullResponse>* replies) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    if (!metadata.empty()) ctx.AddMetadata(shm::kStreamRegionKey, metadata);
    auto reader = stub_->Pull(&ctx, req);
    v1::PushPullResponse r;
    while (reader->Read(&r)) replies->push_back(r);
    return reader->Finish();
  }
  // A Pull of chunk 0 whose weights go to offset 64.
  static v1::PullRequest ShmPull() {
    v1::PullRequest req;
    (*req.mutable_reply_shm_offsets())[0] = 64;
    return req;
  }
  void ExpectPullRefused(const std::string& metadata, const v1::PullRequest& r,
                         grpc::StatusCode code, const std::string& part) {
    std::vector<v1::PushPullResponse> replies;
    const grpc::Status s = PullOnce(metadata, r, &replies);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(part));
    EXPECT_TRUE(replies.empty());
  }
  void ExpectRefused(const std::string& metadata, const v1::PushPullRequest& r,
                     grpc::StatusCode code, const std::string& part,
                     const std::string& gradients = "",
                     const std::string& weights = "") {
    v1::PushPullResponse resp;
    const grpc::Status s = PushOnce(metadata, r, &resp, gradients, weights);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(part));
  }

  ServedShard shard_;
  v1::ParameterServer::Stub* stub_ = nullptr;
};

TEST_F(SharedMemoryPushTest, GradientInAndWeightsOutThroughTheRegion) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  const std::vector<float> grad = {2, 2, 2, 2};
  std::memcpy(region->data(), grad.data(), 16);
  v1::PushPullResponse reply;
  ASSERT_TRUE(PushOnce(Named(*region), ShmPush(), &reply).ok());
  EXPECT_EQ(reply.version(), 1);
  EXPECT_EQ(reply.shm_bytes(), 16u);
  EXPECT_TRUE(reply.payload().empty());
  EXPECT_EQ(At(*region, 64, 4), std::vector<float>({-1, -1, -1, -1}));
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.shared_memory_streams_total(), 1u);
  EXPECT_EQ(st.bytes_in_total(), 16u);  // counted like bytes in a message
}

// The gradient comes from the worker's gradient region (at 32), the weights
// go into the stream's region (at 64).
TEST_F(SharedMemoryPushTest, GradientsAreReadFromTheGradientRegion) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> gradients,
                               SharedRegion::Create(64));
  const std::vector<float> grad = {2, 2, 2, 2};
  std::memcpy(gradients->data() + 32, grad.data(), 16);
  v1::PushPullRequest req = ShmPush();
  req.set_shm_in_gradient_region(true);
  req.set_shm_offset(32);
  v1::PushPullResponse reply;
  ASSERT_TRUE(PushOnce(Named(*region), req, &reply, Named(*gradients)).ok());
  EXPECT_EQ(reply.version(), 1);
  EXPECT_EQ(reply.shm_bytes(), 16u);
  EXPECT_EQ(At(*region, 64, 4), std::vector<float>({-1, -1, -1, -1}));
  // The shard only read the gradient region.
  EXPECT_EQ(At(*gradients, 32, 4), grad);
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.shared_memory_gradient_pushes_total(), 1u);
  EXPECT_EQ(st.bytes_in_total(), 16u);
}

TEST_F(SharedMemoryPushTest, MalformedGradientRegionUsesAreRefused) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> gradients,
                               SharedRegion::Create(64));
  const std::string named = Named(*region);
  const std::string grads = Named(*gradients);
  v1::PushPullRequest r = ShmPush();
  r.set_shm_in_gradient_region(true);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "push of chunk 0 from rank 0 refers to shared memory, but its "
                "stream names no gradient region (shardps-shm-gradients "
                "metadata)");
  r.set_shm_bytes(0);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "names the gradient region but no bytes in it", grads);
  r = ShmPush();
  r.set_shm_in_gradient_region(true);
  r.set_shm_offset(56);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "shared-memory bytes [56, +16) lie outside the gradient "
                "region of 64 bytes",
                grads);
  // The model's 16 bytes in one chunk need at most 16 + 64 + 64 bytes.
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> big,
                               SharedRegion::Create(145));
  ExpectRefused(named, ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "shared memory: a region of 145 bytes is more than the "
                "model's gradients need (144), named by shardps-shm-gradients",
                Named(*big));
  ExpectRefused(named, ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "shared memory: shared memory region /etc/passwd",
                "/etc/passwd 64");
  // A NaN there is refused like one in a message.
  const float nan = std::nanf("");
  std::memcpy(gradients->data() + 8, &nan, 4);
  r = ShmPush();
  r.set_shm_in_gradient_region(true);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "non-finite value at element 2", grads);
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.pushes_total(), 0u);
  EXPECT_EQ(st.min_version(), 0);
}

// The gradient comes from the stream's region, the weights go into the
// worker's weight region (at 16), not into the stream's.
TEST_F(SharedMemoryPushTest, WeightsAreWrittenIntoTheWeightRegion) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> weights,
                               SharedRegion::Create(64));
  const std::vector<float> grad = {2, 2, 2, 2};
  std::memcpy(region->data(), grad.data(), 16);
  v1::PushPullRequest req = ShmPush();
  req.set_reply_in_weight_region(true);
  req.set_reply_shm_offset(16);
  v1::PushPullResponse reply;
  ASSERT_TRUE(PushOnce(Named(*region), req, &reply, "", Named(*weights)).ok());
  EXPECT_EQ(reply.version(), 1);
  EXPECT_EQ(reply.shm_bytes(), 16u);
  EXPECT_TRUE(reply.payload().empty());
  EXPECT_EQ(At(*weights, 16, 4), std::vector<float>({-1, -1, -1, -1}));
  EXPECT_EQ(At(*region, 64, 4), std::vector<float>({0, 0, 0, 0}));
  EXPECT_EQ(Status().shared_memory_weight_replies_total(), 1u);
}

TEST_F(SharedMemoryPushTest, MalformedWeightRegionUsesAreRefused) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> weights,
                               SharedRegion::Create(64));
  const std::string named = Named(*region);
  const std::string w = Named(*weights);
  v1::PushPullRequest r = ShmPush();
  r.set_reply_in_weight_region(true);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "push of chunk 0 from rank 0 refers to shared memory, but its "
                "stream names no weight region (shardps-shm-weights "
                "metadata)");
  r.clear_reply_shm_offset();
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "asks its reply in the weight region but gives no "
                "reply_shm_offset",
                "", w);
  r = ShmPush();
  r.set_reply_in_weight_region(true);
  r.set_reply_shm_offset(64);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "reply_shm_offset 64 lies outside the weight region of 64 "
                "bytes",
                "", w);
  r.set_reply_shm_offset(0);
  r.set_reply_encoding(v1::ENCODING_BF16);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "asks its reply in the weight region as ENCODING_BF16: "
                "replies there are ENCODING_FP32 only",
                "", w);
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> big,
                               SharedRegion::Create(145));
  ExpectRefused(named, ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "shared memory: a region of 145 bytes is more than the "
                "model's weights need (144), named by shardps-shm-weights",
                "", Named(*big));
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.pushes_total(), 0u);
  EXPECT_EQ(st.min_version(), 0);
  EXPECT_EQ(At(*weights, 0, 16), std::vector<float>(16, 0.0f));
}

TEST_F(SharedMemoryPushTest, DeclareReadsTheProbeBackOnlyWhenAllowed) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> probe,
                               SharedRegion::Create(16));
  std::memcpy(probe->data(), "0123456789abcdef", 16);
  v1::DeclareRequest req = SgdDeclaration(4, 0, 1, 0);
  req.set_shared_memory_probe(probe->path());
  v1::DeclareResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Declare(&ctx, req, &resp).ok());
  }
  EXPECT_EQ(resp.shared_memory_token(), "0123456789abcdef");
  EXPECT_TRUE(resp.shared_memory_rings());
  EXPECT_EQ(resp.fingerprint(), shard_.declared().fingerprint());
  req.set_shared_memory_probe("/etc/passwd");
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Declare(&ctx, req, &resp).ok());
  }
  EXPECT_TRUE(resp.shared_memory_token().empty());
  EXPECT_FALSE(resp.shared_memory_rings());
  EXPECT_THAT(resp.shared_memory_error(), HasSubstr("/etc/passwd"));
}

TEST_F(SharedMemoryPushTest, AShardStartedWithoutItRefusesRegionsRetryably) {
  Start(/*shared_memory=*/false);
  v1::DeclareResponse resp;
  ASSERT_NO_FATAL_FAILURE(DeclareWithProbe(&resp));
  EXPECT_TRUE(resp.shared_memory_token().empty());
  EXPECT_THAT(resp.shared_memory_error(), HasSubstr("--shared_memory=false"));
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  ExpectRefused(Named(*region), ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "shared memory: this shard was started with "
                "--shared_memory=false");
  EXPECT_EQ(Status().pushes_total(), 0u);
}

TEST_F(SharedMemoryPushTest, MalformedUsesAreRefusedAndChangeNothing) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  const std::string named = Named(*region);
  // Regions the shard cannot or will not map: retried without.
  ExpectRefused("/etc/passwd 128", ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "shared memory: shared memory region /etc/passwd: not a "
                "/proc/<pid>/fd/<n> path");
  ExpectRefused(region->path(), ShmPush(), grpc::StatusCode::UNAVAILABLE,
                "is not \"<path> <bytes>\"");
  ExpectRefused(absl::StrCat(region->path(), " 144"), ShmPush(),
                grpc::StatusCode::UNAVAILABLE, "it has 128 bytes, not 144");
  // One chunk of 16 bytes needs at most 2 x (16 + 64) bytes, and 64 more
  // and two rings of 192 + 4096 bytes.
  ExpectRefused(absl::StrCat(region->path(), " 8801"), ShmPush(),
                grpc::StatusCode::UNAVAILABLE,
                "a region of 8801 bytes is more than this shard's chunks need "
                "(8800)");
  // Requests that misuse the region.
  v1::PushPullRequest r = ShmPush();
  ExpectRefused("", r, grpc::StatusCode::INVALID_ARGUMENT,
                "push of chunk 0 from rank 0 refers to shared memory, but "
                "its stream names no region");
  r.set_shm_offset(120);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "shared-memory bytes [120, +16) lie outside the stream's "
                "region of 128 bytes");
  r = ShmPush();
  r.set_shm_offset(~uint64_t{0} - 4);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "lie outside the stream's region");
  r = ShmPush();
  r.set_payload(std::string(16, '\0'));
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "has both a payload and 16 bytes in shared memory");
  r = ShmPush();
  r.set_reply_shm_offset(128);
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                "reply_shm_offset 128 lies outside the stream's region");
  r = ShmPush();
  r.set_shm_bytes(12);  // not the chunk's 16
  ExpectRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT, "12");
  // A NaN in the region is refused like one in a message.
  const float nan = std::nanf("");
  std::memcpy(region->data() + 4, &nan, 4);
  ExpectRefused(named, ShmPush(), grpc::StatusCode::INVALID_ARGUMENT,
                "non-finite value at element 1");
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.pushes_total(), 0u);
  EXPECT_EQ(st.min_version(), 0);
}

TEST_F(SharedMemoryPushTest, AReplyThatDoesNotFitTheRegionComesInTheMessage) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(72));
  const std::vector<float> grad = {2, 2, 2, 2};
  std::memcpy(region->data(), grad.data(), 16);
  v1::PushPullResponse reply;
  ASSERT_TRUE(PushOnce(Named(*region), ShmPush(), &reply).ok());
  EXPECT_EQ(reply.shm_bytes(), 0u);
  ASSERT_EQ(reply.payload().size(), 16u);
  std::vector<float> w(4);
  std::memcpy(w.data(), reply.payload().data(), 16);
  EXPECT_EQ(w, std::vector<float>({-1, -1, -1, -1}));
}

TEST_F(SharedMemoryPushTest, PullWritesTheWeightsIntoTheRegion) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  std::vector<v1::PushPullResponse> replies;
  ASSERT_TRUE(PullOnce(Named(*region), ShmPull(), &replies).ok());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].chunk_id(), 0u);
  EXPECT_EQ(replies[0].shm_bytes(), 16u);
  EXPECT_TRUE(replies[0].payload().empty());
  EXPECT_EQ(At(*region, 64, 4), std::vector<float>({1, 1, 1, 1}));
  EXPECT_EQ(Status().shared_memory_streams_total(), 1u);
  // Without offsets the weights come in the message, region or not.
  replies.clear();
  ASSERT_TRUE(PullOnce(Named(*region), v1::PullRequest(), &replies).ok());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].shm_bytes(), 0u);
  EXPECT_EQ(replies[0].payload().size(), 16u);
}

TEST_F(SharedMemoryPushTest, MalformedPullsAreRefusedBeforeAnythingIsSent) {
  Start();
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  const std::string named = Named(*region);
  ExpectPullRefused("", ShmPull(), grpc::StatusCode::INVALID_ARGUMENT,
                    "Pull gives reply_shm_offsets, but its call names no "
                    "region");
  v1::PullRequest r = ShmPull();
  (*r.mutable_reply_shm_offsets())[0] = 128;
  ExpectPullRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                    "reply_shm_offsets of chunk 0 (128) lies outside the "
                    "call's region of 128 bytes");
  r = ShmPull();
  (*r.mutable_reply_shm_offsets())[7] = 0;
  ExpectPullRefused(named, r, grpc::StatusCode::INVALID_ARGUMENT,
                    "reply_shm_offsets names chunk 7, which this Pull does "
                    "not read");
  ExpectPullRefused("/etc/passwd 128", ShmPull(), grpc::StatusCode::UNAVAILABLE,
                    "shared memory: shared memory region /etc/passwd");
  EXPECT_EQ(Status().shared_memory_streams_total(), 0u);
}

TEST_F(SharedMemoryPushTest, AShardStartedWithoutItRefusesPullRegions) {
  Start(/*shared_memory=*/false);
  SHARDPS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedRegion> region,
                               SharedRegion::Create(128));
  ExpectPullRefused(Named(*region), ShmPull(), grpc::StatusCode::UNAVAILABLE,
                    "shared memory: this shard was started with "
                    "--shared_memory=false");
}

// A stream with message rings: a region of 128 bytes of payloads (the
// gradient at 0, the weights at 64), then the requests' and the replies'
// rings of kRing bytes each.
constexpr uint64_t kRing =
    MessageRing::kControlBytes + MessageRing::kMinCapacity;
struct RingStream {
  RingStream() {
    region = *SharedRegion::Create(128 + 2 * kRing);
    requests = std::make_unique<MessageRing>(region->data() + 128, kRing);
    replies =
        std::make_unique<MessageRing>(region->data() + 128 + kRing, kRing);
  }
  // Opens the call naming the region and `rings` (as the metadata says
  // them; empty: none) on `stub`.
  void Open(v1::ParameterServer::Stub* stub, const std::string& rings,
            bool with_region = true) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    if (with_region) {
      ctx.AddMetadata(shm::kStreamRegionKey,
                      absl::StrCat(region->path(), " ", region->size()));
    }
    if (!rings.empty()) ctx.AddMetadata(shm::kRingsKey, rings);
    stream = stub->PushPull(&ctx);
  }
  void Send(const std::string& bytes) {
    ASSERT_TRUE(requests->Append(bytes).ok());
    requests->Publish();
  }
  // The next reply from the ring; false after 30 s without one.
  bool Receive(v1::PushPullResponse* reply) {
    std::string bytes;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      absl::StatusOr<bool> popped = replies->Pop(&bytes);
      if (!popped.ok()) return false;
      if (*popped) return reply->ParseFromString(bytes);
      replies->Wait(absl::Milliseconds(100));
    }
    return false;
  }
  std::unique_ptr<SharedRegion> region;
  std::unique_ptr<MessageRing> requests, replies;
  grpc::ClientContext ctx;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::PushPullRequest, v1::PushPullResponse>>
      stream;
};

TEST_F(SharedMemoryPushTest, PushesAndRepliesGoThroughTheRings) {
  Start();
  RingStream rs;
  const std::vector<float> grad = {2, 2, 2, 2};
  std::memcpy(rs.region->data(), grad.data(), 16);
  rs.Open(stub_, absl::StrCat(128, " ", kRing));
  rs.Send(ShmPush().SerializeAsString());
  v1::PushPullResponse reply;
  ASSERT_TRUE(rs.Receive(&reply));
  EXPECT_EQ(reply.chunk_id(), 0u);
  EXPECT_EQ(reply.version(), 1);
  EXPECT_EQ(reply.shm_bytes(), 16u);
  EXPECT_EQ(At(*rs.region, 64, 4), std::vector<float>({-1, -1, -1, -1}));
  // The next step on the same stream.
  v1::PushPullRequest next = ShmPush();
  next.set_step(1);
  rs.Send(next.SerializeAsString());
  ASSERT_TRUE(rs.Receive(&reply));
  EXPECT_EQ(reply.version(), 2);
  EXPECT_EQ(At(*rs.region, 64, 4), std::vector<float>({-3, -3, -3, -3}));
  // Nothing came through gRPC; the half-close ends the stream cleanly.
  rs.stream->WritesDone();
  v1::PushPullResponse over_grpc;
  EXPECT_FALSE(rs.stream->Read(&over_grpc));
  const grpc::Status s = rs.stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.shared_memory_ring_streams_total(), 1u);
  EXPECT_EQ(st.pushes_total(), 2u);
}

TEST_F(SharedMemoryPushTest, MalformedRingsAreRefusedAndChangeNothing) {
  Start();
  const std::string rings = absl::StrCat(128, " ", kRing);
  // The call's end, after `send` (if any) went into its request ring.
  auto finish = [&](const std::string& named, const std::string& send,
                    bool with_region = true) {
    RingStream rs;
    const std::vector<float> grad = {2, 2, 2, 2};
    std::memcpy(rs.region->data(), grad.data(), 16);
    rs.Open(stub_, named, with_region);
    if (!send.empty()) rs.Send(send);
    return rs.stream->Finish();
  };
  auto expect = [](const grpc::Status& s, grpc::StatusCode code,
                   const std::string& part) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(part));
  };
  // Places the shard will not use: the client goes on without shared
  // memory.
  expect(finish(rings, "", /*with_region=*/false),
         grpc::StatusCode::UNAVAILABLE,
         "shared memory: shardps-shm-rings \"128 4288\": the call names no "
         "region");
  expect(finish("128", ""), grpc::StatusCode::UNAVAILABLE,
         "not \"<offset> <bytes>\"");
  expect(finish(absl::StrCat(8, " ", kRing), ""), grpc::StatusCode::UNAVAILABLE,
         "must start at a cache line");
  expect(finish(absl::StrCat(192, " ", kRing), ""),
         grpc::StatusCode::UNAVAILABLE,
         "two rings there do not lie in the region of 8704 bytes");
  expect(finish("128 4000", ""), grpc::StatusCode::UNAVAILABLE,
         "is not 192 bytes of control and a power of two");
  // What a ring carries: refused like a malformed message.
  expect(finish(rings, "not a protobuf \xff\xff"),
         grpc::StatusCode::INVALID_ARGUMENT,
         "malformed PushPullRequest in the stream's request ring");
  v1::PushPullRequest r = ShmPush();
  r.clear_reply_shm_offset();
  expect(finish(rings, r.SerializeAsString()),
         grpc::StatusCode::INVALID_ARGUMENT,
         "came through the stream's message ring without reply_shm_offset");
  r = ShmPush();
  r.set_shm_offset(8700);
  expect(finish(rings, r.SerializeAsString()),
         grpc::StatusCode::INVALID_ARGUMENT,
         "shared-memory bytes [8700, +16) lie outside");
  {
    // A length that runs past what the producer published.
    RingStream rs;
    rs.Open(stub_, rings);
    ASSERT_TRUE(rs.requests->Append("x").ok());
    const uint32_t length = 3000;
    std::memcpy(rs.region->data() + 128 + MessageRing::kControlBytes, &length,
                4);
    rs.requests->Publish();
    expect(rs.stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
           "the stream's request ring: message ring at 0 of 8 published "
           "bytes: a message of 3000 bytes does not fit");
  }
  {
    // A push through gRPC on a stream whose pushes go through its rings.
    RingStream rs;
    rs.Open(stub_, rings);
    rs.stream->Write(ShmPush());
    expect(rs.stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
           "a push came through gRPC on a stream whose pushes go through its "
           "message rings");
  }
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.pushes_total(), 0u);
  EXPECT_EQ(st.min_version(), 0);
}

// A gRPC message on a ring stream is refused without touching what the
// ring thread works with: the stream ends with INVALID_ARGUMENT, the
// shard's weights stay as the ring's last push left them, and a push that
// races it through the ring (one the store refuses) changes nothing either.
TEST_F(SharedMemoryPushTest, AGrpcPushOnARingStreamIsRefusedAndChangesNothing) {
  Start();
  const std::string rings = absl::StrCat(128, " ", kRing);
  const std::vector<float> grad = {2, 2, 2, 2};
  const std::string misplaced =
      "a push came through gRPC on a stream whose pushes go through its "
      "message rings";
  {
    RingStream rs;
    std::memcpy(rs.region->data(), grad.data(), 16);
    rs.Open(stub_, rings);
    rs.Send(ShmPush().SerializeAsString());
    v1::PushPullResponse reply;
    ASSERT_TRUE(rs.Receive(&reply));
    EXPECT_EQ(reply.version(), 1);
    v1::PushPullRequest next = ShmPush();
    next.set_step(1);
    ASSERT_TRUE(rs.stream->Write(next));
    const grpc::Status s = rs.stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(misplaced));
    EXPECT_EQ(At(*rs.region, 64, 4), std::vector<float>({-1, -1, -1, -1}));
  }
  // A ring push (a NaN gradient, which the store refuses) and a gRPC push
  // arrive together, so the ring thread takes one while gRPC reads the
  // other; either refusal may end the stream.
  const float nan = std::nanf("");
  for (int i = 0; i < 20; ++i) {
    SCOPED_TRACE(i);
    RingStream rs;
    std::memcpy(rs.region->data(), grad.data(), 16);
    std::memcpy(rs.region->data() + 4, &nan, 4);
    rs.Open(stub_, rings);
    v1::PushPullRequest push = ShmPush();
    push.set_step(1);
    rs.Send(push.SerializeAsString());
    rs.stream->Write(push);
    const grpc::Status s = rs.stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_THAT(s.error_message(),
                ::testing::AnyOf(HasSubstr(misplaced),
                                 HasSubstr("non-finite value at element 1")));
  }
  const v1::GetStatusResponse st = Status();
  EXPECT_EQ(st.pushes_total(), 1u);
  EXPECT_EQ(st.min_version(), 1);
  std::vector<v1::PushPullResponse> pulled;
  const grpc::Status pull = PullOnce("", v1::PullRequest(), &pulled);
  ASSERT_TRUE(pull.ok()) << pull.error_message();
  ASSERT_EQ(pulled.size(), 1u);
  EXPECT_EQ(pulled[0].version(), 1);
  std::vector<float> w(4);
  ASSERT_EQ(pulled[0].payload().size(), 16u);
  std::memcpy(w.data(), pulled[0].payload().data(), 16);
  EXPECT_EQ(w, std::vector<float>({-1, -1, -1, -1}));
}

TEST_F(SharedMemoryPushTest, AShardStartedWithoutRingsRefusesThem) {
  Start(/*shared_memory=*/true, /*rings=*/false);
  v1::DeclareResponse resp;
  ASSERT_NO_FATAL_FAILURE(DeclareWithProbe(&resp));
  EXPECT_EQ(resp.shared_memory_token().size(), 16u);  // payloads still
  EXPECT_FALSE(resp.shared_memory_rings());
  RingStream rs;
  rs.Open(stub_, absl::StrCat(128, " ", kRing));
  const grpc::Status s = rs.stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(),
              HasSubstr("shared memory: this shard was started with "
                        "--shared_memory_rings=false"));
  EXPECT_EQ(Status().shared_memory_ring_streams_total(), 0u);
}

}  // namespace
}  // namespace shardps::server
