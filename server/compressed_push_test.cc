// Compressed gradients and weights over the wire (a real in-process gRPC
// shard): every encoding's push gives the update its decoded values give,
// BF16 replies are the rounded weights, and every malformed payload is
// refused with INVALID_ARGUMENT naming chunk and rank while the shard's state
// stays as it was.
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
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

constexpr int64_t kElements = 8;

std::vector<float> Values(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

std::string U32(uint32_t v) {
  return std::string(reinterpret_cast<char*>(&v), 4);
}
std::string F32(float v) { return std::string(reinterpret_cast<char*>(&v), 4); }
std::string U16(uint16_t v) {
  return std::string(reinterpret_cast<char*>(&v), 2);
}

// A TOPK payload: the count, the indices, the values.
std::string Topk(const std::vector<uint32_t>& idx,
                 const std::vector<float>& val, uint32_t k) {
  std::string p = U32(k);
  for (uint32_t i : idx) p += U32(i);
  for (float v : val) p += F32(v);
  return p;
}

std::string Encoded(v1::Encoding e, const std::vector<float>& x,
                    double ratio = 0.25) {
  std::string out;
  EXPECT_TRUE(EncodePayload(e, x.data(), static_cast<int64_t>(x.size()), ratio,
                            nullptr, &out)
                  .ok());
  return out;
}

std::vector<float> Decoded(v1::Encoding e, const std::string& payload) {
  std::vector<float> out(kElements);
  EXPECT_TRUE(DecodePayload(e, payload, kElements, false, out.data()).ok());
  return out;
}

class CompressedPushTest : public ::testing::Test {
 protected:
  void Start(EncodingSet accepted = kAllGradientEncodings,
             int32_t num_workers = 1) {
    ShardServerOptions o;
    o.store.num_workers = num_workers;
    o.store.accepted_encodings = accepted;
    // One tensor "w" of 8 ones, SGD with lr 1: w = 1 - gradient.
    ASSERT_NO_FATAL_FAILURE(
        shard_.Serve(o, SgdDeclaration(kElements, 0, 1, 0)));
    stub_ = shard_.stub();
  }

  grpc::Status Push(v1::Encoding e, const std::string& payload, int64_t step,
                    v1::PushPullResponse* reply,
                    v1::Encoding reply_encoding = v1::ENCODING_FP32) {
    v1::PushPullRequest req;
    req.set_chunk_id(0);
    req.set_step(step);
    req.set_encoding(e);
    req.set_reply_encoding(reply_encoding);
    req.set_payload(payload);
    return PushPullOnce(stub_, req, reply);
  }

  v1::GetStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::GetStatusResponse status;
    EXPECT_TRUE(stub_->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
    return status;
  }

  // The weights as Pull reads them (fp32).
  std::vector<float> Weights(v1::Encoding encoding = v1::ENCODING_FP32) {
    grpc::ClientContext ctx;
    v1::PullRequest req;
    req.set_encoding(encoding);
    auto reader = stub_->Pull(&ctx, req);
    v1::PushPullResponse r;
    std::vector<float> w;
    while (reader->Read(&r)) {
      EXPECT_EQ(r.encoding(), encoding);
      if (encoding == v1::ENCODING_BF16) {
        w.resize(kElements);
        DecodeBf16(reinterpret_cast<const uint16_t*>(r.payload().data()),
                   kElements, w.data());
      } else {
        w = Values(r.payload());
      }
    }
    EXPECT_TRUE(reader->Finish().ok());
    return w;
  }

  // Refused with INVALID_ARGUMENT naming chunk 0, rank 0 and `problem`; the
  // shard's weights, version and counters are as they were.
  void ExpectRefused(v1::Encoding e, const std::string& payload,
                     const std::string& problem) {
    const std::vector<float> before = Weights();
    const v1::GetStatusResponse status_before = Status();
    v1::PushPullResponse reply;
    const grpc::Status s =
        Push(e, payload, status_before.max_version(), &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_NE(s.error_message().find("chunk 0"), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find("rank 0"), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find(problem), std::string::npos)
        << s.error_message() << " does not say " << problem;
    EXPECT_EQ(Weights(), before);
    const v1::GetStatusResponse after = Status();
    EXPECT_EQ(after.max_version(), status_before.max_version());
    EXPECT_EQ(after.updates_total(), status_before.updates_total());
    EXPECT_EQ(after.bytes_in_total(), status_before.bytes_in_total());
  }

  ServedShard shard_;
  v1::ParameterServer::Stub* stub_ = nullptr;
};

TEST_F(CompressedPushTest, EveryEncodingAppliesItsDecodedValues) {
  Start();
  const std::vector<float> g = {0.5f,  -0.25f, 1.0f / 3, 3e-3f,
                                -2.0f, 0.0f,   100.0f,   -7e-8f};
  std::vector<float> want = Weights();
  int64_t step = 0;
  uint64_t fp32_in = 0, wire_in = 0;
  for (v1::Encoding e :
       {v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16,
        v1::ENCODING_INT8, v1::ENCODING_TOPK}) {
    SCOPED_TRACE(v1::Encoding_Name(e));
    const std::string payload = Encoded(e, g);
    const std::vector<float> d = Decoded(e, payload);
    for (int64_t i = 0; i < kElements; ++i) want[i] = want[i] - d[i];
    v1::PushPullResponse reply;
    const grpc::Status s = Push(e, payload, step++, &reply);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(reply.encoding(), v1::ENCODING_FP32);
    EXPECT_EQ(Values(reply.payload()), want);
    wire_in += payload.size();
    fp32_in += kElements * 4;
  }
  const v1::GetStatusResponse status = Status();
  EXPECT_EQ(status.bytes_in_total(), wire_in);
  EXPECT_EQ(status.bytes_in_fp32_total(), fp32_in);
  EXPECT_LT(status.bytes_in_total(), status.bytes_in_fp32_total());
}

TEST_F(CompressedPushTest, Bf16RepliesAreTheRoundedWeights) {
  Start();
  const std::vector<float> g = {1.0f / 3, 1e-3f, -5.5f,  0.0f,
                                2.0f,     7.0f,  -1e-5f, 0.1f};
  v1::PushPullResponse reply;
  ASSERT_TRUE(
      Push(v1::ENCODING_FP32, Bytes(g), 0, &reply, v1::ENCODING_BF16).ok());
  EXPECT_EQ(reply.encoding(), v1::ENCODING_BF16);
  ASSERT_EQ(reply.payload().size(), kElements * 2);
  const std::vector<float> exact = Weights();  // the shard keeps fp32
  for (int64_t i = 0; i < kElements; ++i) EXPECT_EQ(exact[i], 1.0f - g[i]);
  std::vector<uint16_t> want(kElements);
  EncodeBf16(exact.data(), kElements, want.data());
  EXPECT_EQ(std::memcmp(reply.payload().data(), want.data(), kElements * 2), 0);
  // Pull in BF16 too; the counters tell the halved bytes.
  std::vector<float> rounded(kElements);
  DecodeBf16(want.data(), kElements, rounded.data());
  EXPECT_EQ(Weights(v1::ENCODING_BF16), rounded);
  const v1::GetStatusResponse status = Status();
  EXPECT_EQ(status.bytes_out_fp32_total(), 4 * kElements * 3);  // 1 + 2 pulls
  EXPECT_EQ(status.bytes_out_total(), 2 * kElements * 2 + 4 * kElements);
}

TEST_F(CompressedPushTest, Bf16RepliesOfOneUpdateAreItsWeightsRoundedOnce) {
  // Three ranks, two asking for BF16 weights, one for FP32: every reply of
  // an update is that update's weights (the BF16 ones share one rounding),
  // and the next update's replies are the next weights, not the last.
  Start(kAllGradientEncodings, /*num_workers=*/3);
  std::vector<float> exact(kElements, 1.0f);
  for (int64_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    grpc::ClientContext ctx[3];
    std::unique_ptr<
        grpc::ClientReaderWriter<v1::PushPullRequest, v1::PushPullResponse>>
        streams[3];
    for (uint32_t r = 0; r < 3; ++r) {
      ctx[r].set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(30));
      streams[r] = stub_->PushPull(&ctx[r]);
      std::vector<float> g(kElements);
      for (int64_t i = 0; i < kElements; ++i) {
        g[i] = 0.01f * static_cast<float>((r + 1) * (i + 1) + step) / 3;
      }
      for (int64_t i = 0; i < kElements; ++i) exact[i] -= g[i] / 3;
      v1::PushPullRequest req;
      req.set_rank(r);
      req.set_chunk_id(0);
      req.set_step(step);
      req.set_encoding(v1::ENCODING_FP32);
      req.set_reply_encoding(r < 2 ? v1::ENCODING_BF16 : v1::ENCODING_FP32);
      req.set_payload(Bytes(g));
      ASSERT_TRUE(streams[r]->Write(req));
    }
    v1::PushPullResponse replies[3];
    for (uint32_t r = 0; r < 3; ++r) {
      if (!streams[r]->Read(&replies[r])) {
        FAIL() << "rank " << r << ": " << streams[r]->Finish().error_message();
      }
      streams[r]->WritesDone();
      const grpc::Status s = streams[r]->Finish();
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    // The FP32 reply is the shard's weights; the mean of the three
    // gradients, summed in rank order, moved them.
    const std::vector<float> weights = Values(replies[2].payload());
    ASSERT_EQ(weights.size(), static_cast<size_t>(kElements));
    for (int64_t i = 0; i < kElements; ++i) {
      EXPECT_NEAR(weights[i], exact[i], 1e-6f) << "element " << i;
    }
    std::vector<uint16_t> want(kElements);
    EncodeBf16(weights.data(), kElements, want.data());
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_EQ(replies[r].encoding(), v1::ENCODING_BF16);
      ASSERT_EQ(replies[r].payload().size(), kElements * 2);
      EXPECT_EQ(
          std::memcmp(replies[r].payload().data(), want.data(), kElements * 2),
          0)
          << "rank " << r;
    }
  }
}

// Rank 1 pushes a BF16 gradient with a NaN, which is refused, then a good
// one; rank 0 pushes before or after it. Refused or not, rank 1's first push
// must leave no trace: the weights are 1 - (g0 + g1) / 2 (SGD, lr 1, from
// ones; exact in these values). With rank 1 first its pushes come early:
// kept in the slices they arrived in and checked on arrival; otherwise
// decoded straight into rank 0's sum.
void ExpectARefusedBf16PushLeavesNoTrace(
    v1::ParameterServer::Stub* stub, bool rank1_first,
    const std::function<uint64_t()>& pushes_taken) {
  // Each push is taken (held early, or summed) before the next is sent.
  auto taken = [&](uint64_t n) {
    for (int i = 0; i < 500 && pushes_taken() < n; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(pushes_taken(), n);
  };
  const std::vector<float> g0 = {0.5f,  -0.25f, 1.0f, 2.0f,
                                 -4.0f, 0.125f, 8.0f, -1.0f};
  const std::vector<float> g1 = {1.5f, 0.25f,  -3.0f, 6.0f,
                                 4.0f, 0.375f, -8.0f, 1.0f};
  using Stream =
      grpc::ClientReaderWriter<v1::PushPullRequest, v1::PushPullResponse>;
  auto push = [&](grpc::ClientContext* ctx, uint32_t rank,
                  const std::string& payload) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(30));
    std::unique_ptr<Stream> stream = stub->PushPull(ctx);
    v1::PushPullRequest req;
    req.set_rank(rank);
    req.set_chunk_id(0);
    req.set_step(0);
    req.set_encoding(v1::ENCODING_BF16);
    req.set_reply_encoding(v1::ENCODING_FP32);
    req.set_payload(payload);
    EXPECT_TRUE(stream->Write(req));
    return stream;
  };
  grpc::ClientContext ctx0, bad_ctx, ctx1;
  std::unique_ptr<Stream> rank0;
  if (!rank1_first) {
    rank0 = push(&ctx0, 0, Encoded(v1::ENCODING_BF16, g0));
    taken(1);
  }
  std::string bad = Encoded(v1::ENCODING_BF16, g1);
  const uint16_t nan = 0x7fc0;
  std::memcpy(bad.data() + 3 * 2, &nan, 2);
  std::unique_ptr<Stream> refused = push(&bad_ctx, 1, bad);
  v1::PushPullResponse reply;
  EXPECT_FALSE(refused->Read(&reply));
  const grpc::Status s = refused->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << s.error_message();
  EXPECT_NE(s.error_message().find("rank 1"), std::string::npos)
      << s.error_message();
  std::unique_ptr<Stream> rank1 =
      push(&ctx1, 1, Encoded(v1::ENCODING_BF16, g1));
  if (rank1_first) {
    taken(1);
    rank0 = push(&ctx0, 0, Encoded(v1::ENCODING_BF16, g0));
  }
  v1::PushPullResponse replies[2];
  ASSERT_TRUE(rank0->Read(&replies[0]));
  ASSERT_TRUE(rank1->Read(&replies[1]));
  for (Stream* stream : {rank0.get(), rank1.get()}) {
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  for (const v1::PushPullResponse& r : replies) {
    const std::vector<float> w = Values(r.payload());
    ASSERT_EQ(w.size(), static_cast<size_t>(kElements));
    for (int64_t i = 0; i < kElements; ++i) {
      EXPECT_EQ(w[i], 1.0f - (g0[i] + g1[i]) / 2) << "element " << i;
    }
  }
}

TEST_F(CompressedPushTest, ARefusedPushAfterTheFirstRanksLeavesTheSumAlone) {
  Start(kAllGradientEncodings, /*num_workers=*/2);
  ExpectARefusedBf16PushLeavesNoTrace(stub_, /*rank1_first=*/false,
                                      [&] { return Status().pushes_total(); });
}

TEST_F(CompressedPushTest, ARefusedEarlyPushLeavesNoTraceAndAKeptOneIsSummed) {
  Start(kAllGradientEncodings, /*num_workers=*/2);
  ExpectARefusedBf16PushLeavesNoTrace(stub_, /*rank1_first=*/true,
                                      [&] { return Status().pushes_total(); });
}

TEST_F(CompressedPushTest, WeightsCannotBeAskedInALossyGradientEncoding) {
  Start();
  v1::PushPullResponse reply;
  const grpc::Status s =
      Push(v1::ENCODING_FP32, Bytes(std::vector<float>(kElements, 1)), 0,
           &reply, v1::ENCODING_INT8);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("ENCODING_INT8"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Status().max_version(), 0);
  grpc::ClientContext ctx;
  v1::PullRequest req;
  req.set_encoding(v1::ENCODING_TOPK);
  auto reader = stub_->Pull(&ctx, req);
  while (reader->Read(&reply)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CompressedPushTest, PayloadLengthThatDoesNotFitTheEncodingIsRefused) {
  Start();
  ExpectRefused(v1::ENCODING_BF16, std::string(2 * kElements - 2, '\0'),
                "ENCODING_BF16 of 8 elements needs 16");
  ExpectRefused(v1::ENCODING_FP16, std::string(2 * kElements + 2, '\0'),
                "ENCODING_FP16 of 8 elements needs 16");
  ExpectRefused(v1::ENCODING_INT8, std::string(kElements, '\0'),
                "ENCODING_INT8 of 8 elements needs 12");
  ExpectRefused(v1::ENCODING_TOPK, U32(1) + U32(0) + F32(1) + "x",
                "ENCODING_TOPK of 8 elements needs 4 + 8k");
}

TEST_F(CompressedPushTest, NonFiniteHalfPrecisionValuesAreRefused) {
  Start();
  std::string bf16;
  for (int i = 0; i < kElements; ++i) bf16 += U16(i == 5 ? 0x7fc0 : 0x3f80);
  ExpectRefused(v1::ENCODING_BF16, bf16, "element 5");
  std::string fp16;
  for (int i = 0; i < kElements; ++i) fp16 += U16(i == 2 ? 0x7c00 : 0x3c00);
  ExpectRefused(v1::ENCODING_FP16, fp16, "element 2");
  std::string fp16_nan;
  for (int i = 0; i < kElements; ++i) fp16_nan += U16(i == 7 ? 0xfe00 : 0);
  ExpectRefused(v1::ENCODING_FP16, fp16_nan, "element 7");
}

TEST_F(CompressedPushTest, BadInt8ScalesAreRefused) {
  Start();
  const std::string q(kElements, '\x01');
  for (float scale : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(scale);
    ExpectRefused(v1::ENCODING_INT8, F32(scale) + q, "scale");
  }
}

TEST_F(CompressedPushTest, MalformedTopkIndicesAreRefused) {
  Start();
  ExpectRefused(v1::ENCODING_TOPK, Topk({1, 8}, {1, 1}, 2), "8");  // range
  ExpectRefused(v1::ENCODING_TOPK, Topk({3, 3}, {1, 1}, 2), "3");  // twice
  ExpectRefused(v1::ENCODING_TOPK, Topk({4, 2}, {1, 1}, 2), "2");  // order
  // k over the chunk's elements, and a count the list does not hold.
  std::vector<uint32_t> idx(9);
  for (uint32_t i = 0; i < 9; ++i) idx[i] = i;
  ExpectRefused(v1::ENCODING_TOPK, Topk(idx, std::vector<float>(9, 1), 9),
                "4 + 8k");
  ExpectRefused(v1::ENCODING_TOPK, Topk({1, 2}, {1, 1}, 3), "k");
  ExpectRefused(v1::ENCODING_TOPK,
                Topk({1}, {std::numeric_limits<float>::infinity()}, 1),
                "entry 0");
  // After all that, a good push still applies.
  v1::PushPullResponse reply;
  ASSERT_TRUE(Push(v1::ENCODING_TOPK, Topk({6}, {0.5f}, 1), 0, &reply).ok());
  EXPECT_EQ(Values(reply.payload()),
            std::vector<float>({1, 1, 1, 1, 1, 1, 0.5f, 1}));
}

TEST_F(CompressedPushTest, AnEncodingTheShardWasNotStartedToAcceptIsRefused) {
  Start(EncodingBit(v1::ENCODING_FP32) | EncodingBit(v1::ENCODING_BF16));
  ExpectRefused(v1::ENCODING_INT8,
                Encoded(v1::ENCODING_INT8, std::vector<float>(kElements, 1)),
                "ENCODING_INT8 is not accepted here (this takes "
                "ENCODING_FP32, ENCODING_BF16)");
  const v1::GetStatusResponse status = Status();
  ASSERT_EQ(status.accepted_encodings_size(), 2);
  EXPECT_EQ(status.accepted_encodings(1), "ENCODING_BF16");
}

}  // namespace
}  // namespace shardps::server
