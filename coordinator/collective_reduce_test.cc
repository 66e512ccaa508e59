#include "coordinator/collective_reduce.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardps::coordinator {
namespace {

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(T));
}

template <typename T>
std::vector<T> Values(const std::string& bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

template <typename T>
std::vector<T> Reduce(v1::CollectiveOp op, v1::CollectiveDtype dtype,
                      const std::vector<std::vector<T>>& ranks) {
  std::vector<std::string> bytes;
  for (const auto& r : ranks) bytes.push_back(Bytes(r));
  std::vector<const std::string*> in;
  for (const auto& b : bytes) in.push_back(&b);
  return Values<T>(ReduceInRankOrder(op, dtype, in));
}

v1::CollectiveRequest Request(v1::CollectiveOp op, v1::CollectiveDtype dtype,
                              std::vector<int64_t> shape, size_t bytes) {
  v1::CollectiveRequest r;
  r.set_sequence(1);
  r.set_op(op);
  r.set_dtype(dtype);
  for (int64_t d : shape) r.add_shape(d);
  r.set_values(std::string(bytes, '\0'));
  r.set_timeout_ms(1000);
  return r;
}

TEST(CollectiveReduceTest, SumsFloatsInRankOrder) {
  // 1e8 + 1 - 1e8 in float32: (1e8 + 1) rounds to 1e8, so rank order gives
  // 0, while 1e8 - 1e8 + 1 would give 1.
  const std::vector<float> got =
      Reduce<float>(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32,
                    {{1e8f, 2.0f}, {1.0f, 3.0f}, {-1e8f, 4.0f}});
  EXPECT_EQ(got, (std::vector<float>{0.0f, 9.0f}));
}

TEST(CollectiveReduceTest, MeanDividesTheRankOrderSumByTheCount) {
  const std::vector<double> got =
      Reduce<double>(v1::COLLECTIVE_OP_MEAN, v1::COLLECTIVE_DTYPE_FLOAT64,
                     {{0.1, 1.0}, {0.2, 2.0}, {0.3, 4.0}});
  EXPECT_EQ(got[0], ((0.1 + 0.2) + 0.3) / 3.0);
  EXPECT_EQ(got[1], 7.0 / 3.0);
}

TEST(CollectiveReduceTest, MaxAndMinKeepTheFirstNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (v1::CollectiveOp op : {v1::COLLECTIVE_OP_MAX, v1::COLLECTIVE_OP_MIN}) {
    SCOPED_TRACE(op);
    const std::vector<float> got =
        Reduce<float>(op, v1::COLLECTIVE_DTYPE_FLOAT32,
                      {{1.0f, 5.0f}, {nan, -2.0f}, {3.0f, 7.0f}});
    EXPECT_TRUE(std::isnan(got[0]));
    EXPECT_EQ(got[1], op == v1::COLLECTIVE_OP_MAX ? 7.0f : -2.0f);
  }
}

TEST(CollectiveReduceTest, Int64SumWrapsAndMaxIsExact) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(Reduce<int64_t>(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_INT64,
                            {{big, 5}, {1, (int64_t{1} << 60)}}),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min(),
                                  (int64_t{1} << 60) + 5}));
  EXPECT_EQ(Reduce<int64_t>(v1::COLLECTIVE_OP_MAX, v1::COLLECTIVE_DTYPE_INT64,
                            {{big - 1, -3}, {big, -4}}),
            (std::vector<int64_t>{big, -3}));
}

TEST(CollectiveReduceTest, RefusesMalformedCalls) {
  struct Case {
    const char* name;
    v1::CollectiveRequest request;
    absl::StatusCode code;
    const char* says;
  };
  v1::CollectiveRequest zero_seq =
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {2}, 8);
  zero_seq.set_sequence(0);
  v1::CollectiveRequest no_timeout =
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {2}, 8);
  no_timeout.set_timeout_ms(0);
  v1::CollectiveRequest sum_src =
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {2}, 8);
  sum_src.set_src(1);
  v1::CollectiveRequest barrier_values = Request(
      v1::COLLECTIVE_OP_BARRIER, v1::COLLECTIVE_DTYPE_UNSPECIFIED, {}, 4);
  std::vector<Case> cases = {
      {"sequence 0", zero_seq, absl::StatusCode::kInvalidArgument, "from 1"},
      {"timeout 0", no_timeout, absl::StatusCode::kInvalidArgument, "timeout"},
      {"no op",
       Request(v1::COLLECTIVE_OP_UNSPECIFIED, v1::COLLECTIVE_DTYPE_FLOAT32, {2},
               8),
       absl::StatusCode::kInvalidArgument, "not one of"},
      {"no dtype",
       Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_UNSPECIFIED, {2}, 8),
       absl::StatusCode::kInvalidArgument, "dtype"},
      {"int mean",
       Request(v1::COLLECTIVE_OP_MEAN, v1::COLLECTIVE_DTYPE_INT64, {2}, 16),
       absl::StatusCode::kInvalidArgument, "not exact"},
      {"short values",
       Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT64, {2, 3}, 40),
       absl::StatusCode::kInvalidArgument, "40 bytes of values, want 48"},
      {"negative dim",
       Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {-1}, 0),
       absl::StatusCode::kInvalidArgument, "negative"},
      {"over 1 MiB",
       Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {262145},
               1048580),
       absl::StatusCode::kResourceExhausted, "1 MiB"},
      {"huge shape",
       Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_INT64,
               {int64_t{1} << 40, int64_t{1} << 40}, 0),
       absl::StatusCode::kResourceExhausted, "1 MiB"},
      {"src on sum", sum_src, absl::StatusCode::kInvalidArgument, "no src"},
      {"barrier values", barrier_values, absl::StatusCode::kInvalidArgument,
       "barrier"},
      // Off the source, a broadcast's values are none or the full size.
      {"broadcast values off src",
       Request(v1::COLLECTIVE_OP_BROADCAST, v1::COLLECTIVE_DTYPE_INT64, {2}, 8),
       absl::StatusCode::kInvalidArgument, "or none"},
      {"broadcast from src without values",
       Request(v1::COLLECTIVE_OP_BROADCAST, v1::COLLECTIVE_DTYPE_INT64, {2}, 0),
       absl::StatusCode::kInvalidArgument, "want 16"},
  };
  cases.back().request.set_rank(1);  // the src
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status s = ValidateCollective(c.request, /*src_rank=*/1);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.says)) << s;
  }
  SHARDPS_EXPECT_OK(ValidateCollective(
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {}, 4), 0));
  SHARDPS_EXPECT_OK(ValidateCollective(
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {262144},
              1 << 20),
      0));
}

TEST(CollectiveReduceTest, AMismatchNamesBothCalls) {
  v1::CollectiveRequest a =
      Request(v1::COLLECTIVE_OP_SUM, v1::COLLECTIVE_DTYPE_FLOAT32, {3}, 12);
  v1::CollectiveRequest b = a;
  b.set_rank(1);
  b.set_op(v1::COLLECTIVE_OP_MAX);
  SHARDPS_EXPECT_OK(MatchCollective(a, a));
  const absl::Status s = MatchCollective(a, b);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "collective 1: rank 1 calls all_reduce(max) float32 [3] but rank "
            "0 called all_reduce(sum) float32 [3]: every rank must call the "
            "same collectives in the same order");
  b = a;
  b.add_shape(1);
  EXPECT_FALSE(MatchCollective(a, b).ok());
  b = a;
  b.set_dtype(v1::COLLECTIVE_DTYPE_FLOAT64);
  EXPECT_FALSE(MatchCollective(a, b).ok());
}

}  // namespace
}  // namespace shardps::coordinator
