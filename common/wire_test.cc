#include "common/wire.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "shardps/v1/parameter_server.pb.h"

namespace shardps {
namespace {

// Splits `bytes` into slices of `piece` bytes, as the transport may deliver.
grpc::ByteBuffer Sliced(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < bytes.size(); i += piece) {
    slices.emplace_back(bytes.substr(i, piece));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

v1::PushPullRequest Header() {
  v1::PushPullRequest h;
  h.set_rank(3);
  h.set_step(123456789);
  h.set_chunk_id(42);
  h.set_encoding(v1::ENCODING_FP32);
  return h;
}

TEST(WireTest, EncodedMessageIsOrdinaryProtobuf) {
  std::vector<float> payload = {1.5f, -2.0f, 3.25f};
  grpc::ByteBuffer buffer = EncodeWithPayload(
      Header(), grpc::Slice(payload.data(), payload.size() * 4));
  v1::PushPullRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(parsed.rank(), 3u);
  EXPECT_EQ(parsed.step(), 123456789);
  EXPECT_EQ(parsed.chunk_id(), 42u);
  ASSERT_EQ(parsed.payload().size(), 12u);
  EXPECT_EQ(std::memcmp(parsed.payload().data(), payload.data(), 12), 0);
}

TEST(WireTest, DecodesAcrossAnySliceBoundaries) {
  // A protobuf-serialized message (as any other client would send it), with
  // the payload before other fields, cut into slices of every size.
  v1::PushPullRequest msg = Header();
  std::string payload(4000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = char(i * 7);
  msg.set_payload(payload);
  msg.set_push_only(true);
  const std::string bytes = msg.SerializeAsString();
  for (size_t piece : {1, 2, 3, 7, 64, 1000, 5000}) {
    SCOPED_TRACE(piece);
    v1::PushPullRequest header;
    PayloadView view;
    SHARDPS_ASSERT_OK(DecodeWithPayload(Sliced(bytes, piece), &header, &view));
    EXPECT_EQ(header.rank(), 3u);
    EXPECT_EQ(header.step(), 123456789);
    EXPECT_TRUE(header.push_only());
    EXPECT_TRUE(header.payload().empty());
    ASSERT_EQ(view.size(), payload.size());
    std::string copy(view.size(), '\0');
    view.CopyTo(copy.data());
    EXPECT_EQ(copy, payload);
  }
}

TEST(WireTest, MissingPayloadDecodesAsEmpty) {
  v1::PushPullRequest header;
  PayloadView view;
  SHARDPS_ASSERT_OK(DecodeWithPayload(Sliced(Header().SerializeAsString(), 5),
                                      &header, &view));
  EXPECT_EQ(view.size(), 0u);
  EXPECT_EQ(header.chunk_id(), 42u);
}

TEST(WireTest, MalformedMessagesAreInvalidArgument) {
  std::vector<float> payload(16, 1.0f);
  std::string good = Flatten(EncodeWithPayload(
      Header(), grpc::Slice(payload.data(), payload.size() * 4)));
  struct Case {
    const char* what;
    std::string bytes;
  };
  std::vector<Case> cases = {
      {"truncated payload", good.substr(0, good.size() - 5)},
      {"truncated varint", std::string("\x18\xff", 2)},
      {"unknown wire type", std::string("\x1f\x01", 2)},
      {"length past the end", std::string("\x7a\x10\x01\x02", 4)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PushPullRequest header;
    PayloadView view;
    absl::Status s = DecodeWithPayload(Sliced(c.bytes, 3), &header, &view);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
}

}  // namespace
}  // namespace shardps
