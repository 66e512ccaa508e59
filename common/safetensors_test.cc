#include "common/safetensors.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

// A path in this process's own directory: ctest runs tests of this binary in
// parallel processes, which must not share a file.
std::string TempPath(const std::string& name) {
  static const std::string* const dir =
      new std::string(testing::MakeTempDir("safetensors_test"));
  return absl::StrCat(*dir, "/", name);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file made of `header` (unpadded) and `data`, with a correct length field.
std::string FileBytes(const std::string& header, const std::string& data) {
  const uint64_t len = header.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  return bytes + header + data;
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     4 * values.size());
}

TEST(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  const std::vector<float> w = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  const std::vector<float> b = {0.5f, -0.5f};
  const std::map<std::string, std::string> metadata = {
      {"step", "42"},
      {"note", "quote \" backslash \\ newline \n tab \t \x01"},
      {"utf8", "\xc3\xa9t\xc3\xa9"}};
  const std::string path = TempPath("roundtrip.safetensors");
  SHARDPS_ASSERT_OK(WriteSafetensors(
      path, {{"fc1.weight", {2, 3}, w.data()}, {"fc1 \"bias\"", {2}, b.data()}},
      metadata));

  std::map<std::string, std::string> read_metadata;
  absl::StatusOr<std::vector<LoadedTensor>> tensors =
      ReadSafetensors(path, &read_metadata);
  SHARDPS_ASSERT_OK(tensors);
  ASSERT_EQ(tensors->size(), 2u);
  EXPECT_EQ((*tensors)[0].name, "fc1.weight");
  EXPECT_EQ((*tensors)[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*tensors)[0].data, w);
  EXPECT_EQ((*tensors)[1].name, "fc1 \"bias\"");
  EXPECT_EQ((*tensors)[1].shape, (std::vector<int64_t>{2}));
  EXPECT_EQ((*tensors)[1].data, b);
  EXPECT_EQ(read_metadata, metadata);
  EXPECT_FALSE(std::ifstream(path + ".tmp").good()) << "temporary file left";
}

TEST(SafetensorsTest, WritesStandardLayout) {
  const std::vector<float> a = {1.0f, 2.0f};
  const std::string path = TempPath("layout.safetensors");
  SHARDPS_ASSERT_OK(WriteSafetensors(path, {{"a", {2}, a.data()}}, {}));

  const std::string bytes = ReadBytes(path);
  const std::string json =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string header = json + std::string(8 - json.size() % 8, ' ');
  EXPECT_EQ(bytes, FileBytes(header, FloatBytes(a)));
}

TEST(SafetensorsTest, RoundTripsEmptyAndScalarTensors) {
  const float scalar = 3.0f;
  const std::string path = TempPath("empty.safetensors");
  SHARDPS_ASSERT_OK(WriteSafetensors(
      path, {{"empty", {0, 4}, nullptr}, {"scalar", {}, &scalar}}, {}));
  absl::StatusOr<std::vector<LoadedTensor>> tensors = ReadSafetensors(path);
  SHARDPS_ASSERT_OK(tensors);
  ASSERT_EQ(tensors->size(), 2u);
  EXPECT_EQ((*tensors)[0].shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE((*tensors)[0].data.empty());
  EXPECT_EQ((*tensors)[1].data, std::vector<float>{3.0f});
}

TEST(SafetensorsTest, ReadsForeignHeaderWithWhitespaceAndEscapes) {
  // Whitespace, \u escapes (one a surrogate pair), an extra key, and tensors
  // listed out of offset order, as other writers may produce.
  const std::string header =
      "{ \"__metadata__\" : {\"format\" : \"pt\"},\n"
      "  \"b\\u00e9\\ud83d\\ude00\" : {\"dtype\":\"F32\", \"shape\":[1],"
      " \"data_offsets\":[8, 12], \"extra\": [true, null, -1.5e3]},\n"
      "  \"a\" : {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]} }  ";
  const std::string path = TempPath("foreign.safetensors");
  WriteBytes(path, FileBytes(header, FloatBytes({1.0f, 2.0f, 3.0f})));

  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::vector<LoadedTensor>> tensors =
      ReadSafetensors(path, &metadata);
  SHARDPS_ASSERT_OK(tensors);
  ASSERT_EQ(tensors->size(), 2u);
  EXPECT_EQ((*tensors)[0].name, "a");
  EXPECT_EQ((*tensors)[0].data, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ((*tensors)[1].name, "b\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ((*tensors)[1].data, std::vector<float>{3.0f});
  EXPECT_EQ(metadata.at("format"), "pt");
}

TEST(SafetensorsTest, RejectsCorruptFiles) {
  const std::string one = FloatBytes({1.0f});
  const auto tensor = [](const std::string& dtype, const std::string& shape,
                         const std::string& offsets) {
    return absl::StrCat(R"({"t":{"dtype":")", dtype, R"(","shape":)", shape,
                        R"(,"data_offsets":)", offsets, "}}");
  };
  struct Case {
    std::string name;
    std::string bytes;
    std::string want;  // substring of the error message
  };
  const std::string good = FileBytes(tensor("F32", "[1]", "[0,4]"), one);
  std::string huge_len = good;
  huge_len[5] = 0x7f;
  const std::vector<Case> cases = {
      {"empty", "", "truncated: 0 bytes"},
      {"short_length", good.substr(0, 5), "truncated: 5 bytes"},
      {"short_header", good.substr(0, 20), "truncated: header length"},
      {"short_data", good.substr(0, good.size() - 1),
       "truncated: tensor \"t\""},
      {"huge_header_length", huge_len, "exceeds"},
      {"bf16", FileBytes(tensor("BF16", "[2]", "[0,4]"), one),
       "unsupported dtype BF16"},
      {"size_mismatch", FileBytes(tensor("F32", "[2]", "[0,4]"), one),
       "do not hold the 8 bytes"},
      {"reversed_offsets", FileBytes(tensor("F32", "[0]", "[4,0]"), one),
       "data_offsets"},
      {"gap", FileBytes(tensor("F32", "[1]", "[4,8]"), one + one),
       "expected 0"},
      {"extra_data", FileBytes(tensor("F32", "[1]", "[0,4]"), one + one),
       "cover 4"},
      {"negative_dim", FileBytes(tensor("F32", "[-1]", "[0,4]"), one),
       "shape entries"},
      {"bad_json", FileBytes("{\"t\":", one), "malformed JSON"},
      {"trailing_json", FileBytes("{} x", ""), "trailing"},
      {"not_object", FileBytes("[1]", ""), "not a JSON object"},
      {"bad_metadata", FileBytes(R"({"__metadata__":{"k":1}})", ""),
       "not a string"},
      {"deep", FileBytes(std::string(100, '[') + std::string(100, ']'), ""),
       "too deep"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = TempPath(c.name + ".safetensors");
    WriteBytes(path, c.bytes);
    absl::StatusOr<std::vector<LoadedTensor>> got = ReadSafetensors(path);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find(path), std::string::npos)
        << got.status();
    EXPECT_NE(got.status().message().find(c.want), std::string::npos)
        << got.status();
  }
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadSafetensors(TempPath("does_not_exist")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, RejectsBadTensorsOnWrite) {
  const float x = 1.0f;
  const std::string path = TempPath("bad_write.safetensors");
  const std::vector<std::vector<SafetensorsTensor>> cases = {
      {{"a", {1}, &x}, {"a", {1}, &x}},
      {{"__metadata__", {1}, &x}},
      {{"", {1}, &x}},
      {{"a", {-1}, &x}},
      {{"a", {2}, nullptr}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(WriteSafetensors(path, cases[i], {}).code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(std::ifstream(path).good());
}

TEST(SafetensorsTest, UnwritableDirectoryIsInternal) {
  const float x = 1.0f;
  const absl::Status status = WriteSafetensors(
      TempPath("no_such_dir/x.safetensors"), {{"a", {1}, &x}}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
}

}  // namespace
}  // namespace shardps
