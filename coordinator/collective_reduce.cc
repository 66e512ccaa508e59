#include "coordinator/collective_reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardps::coordinator {
namespace {

constexpr int64_t kMaxTimeoutMs = 3600 * 1000;

const char* OpName(v1::CollectiveOp op) {
  switch (op) {
    case v1::COLLECTIVE_OP_SUM:
      return "sum";
    case v1::COLLECTIVE_OP_MEAN:
      return "mean";
    case v1::COLLECTIVE_OP_MAX:
      return "max";
    case v1::COLLECTIVE_OP_MIN:
      return "min";
    case v1::COLLECTIVE_OP_BROADCAST:
      return "broadcast";
    case v1::COLLECTIVE_OP_BARRIER:
      return "barrier";
    default:
      return "unspecified";
  }
}

const char* DtypeName(v1::CollectiveDtype dtype) {
  switch (dtype) {
    case v1::COLLECTIVE_DTYPE_FLOAT32:
      return "float32";
    case v1::COLLECTIVE_DTYPE_FLOAT64:
      return "float64";
    case v1::COLLECTIVE_DTYPE_INT64:
      return "int64";
    default:
      return "no dtype";
  }
}

size_t ElementBytes(v1::CollectiveDtype dtype) {
  return dtype == v1::COLLECTIVE_DTYPE_FLOAT32 ? 4 : 8;
}

bool IsReduction(v1::CollectiveOp op) {
  return op == v1::COLLECTIVE_OP_SUM || op == v1::COLLECTIVE_OP_MEAN ||
         op == v1::COLLECTIVE_OP_MAX || op == v1::COLLECTIVE_OP_MIN;
}

// Element-wise over little-endian values of type T (this machine is
// little-endian, as the data path assumes). memcpy: `bytes` has no
// alignment guarantee.
template <typename T>
T Load(const std::string& bytes, size_t i) {
  T v;
  std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void Store(std::string* bytes, size_t i, T v) {
  std::memcpy(bytes->data() + i * sizeof(T), &v, sizeof(T));
}

template <typename T>
T Combine(v1::CollectiveOp op, T acc, T x) {
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case v1::COLLECTIVE_OP_MAX:
        return x > acc ? x : acc;
      case v1::COLLECTIVE_OP_MIN:
        return x < acc ? x : acc;
      default:  // SUM: two's complement wrap, without signed overflow
        return static_cast<T>(static_cast<uint64_t>(acc) +
                              static_cast<uint64_t>(x));
    }
  } else {
    switch (op) {
      case v1::COLLECTIVE_OP_MAX:
        // The first NaN in rank order stays, as torch.max propagates NaN.
        if (std::isnan(acc)) return acc;
        return std::isnan(x) || x > acc ? x : acc;
      case v1::COLLECTIVE_OP_MIN:
        if (std::isnan(acc)) return acc;
        return std::isnan(x) || x < acc ? x : acc;
      default:  // SUM and MEAN
        return acc + x;
    }
  }
}

template <typename T>
std::string Reduce(v1::CollectiveOp op,
                   const std::vector<const std::string*>& values) {
  std::string out = *values[0];
  const size_t n = out.size() / sizeof(T);
  for (size_t r = 1; r < values.size(); ++r) {
    for (size_t i = 0; i < n; ++i) {
      Store<T>(&out, i,
               Combine<T>(op, Load<T>(out, i), Load<T>(*values[r], i)));
    }
  }
  if constexpr (!std::is_integral_v<T>) {
    if (op == v1::COLLECTIVE_OP_MEAN) {
      const T count = static_cast<T>(values.size());
      for (size_t i = 0; i < n; ++i) Store<T>(&out, i, Load<T>(out, i) / count);
    }
  }
  return out;
}

}  // namespace

std::string DescribeCollective(const v1::CollectiveRequest& request) {
  const v1::CollectiveOp op = request.op();
  if (op == v1::COLLECTIVE_OP_BARRIER) return "barrier";
  std::string call =
      op == v1::COLLECTIVE_OP_BROADCAST
          ? absl::StrCat("broadcast(src ",
                         request.src() < 0 ? std::string("lowest rank")
                                           : absl::StrCat(request.src()),
                         ")")
          : absl::StrCat("all_reduce(", OpName(op), ")");
  return absl::StrCat(call, " ", DtypeName(request.dtype()), " [",
                      absl::StrJoin(request.shape(), ", "), "]");
}

absl::Status ValidateCollective(const v1::CollectiveRequest& request,
                                uint32_t src_rank) {
  const v1::CollectiveOp op = request.op();
  if (request.sequence() == 0) {
    return absl::InvalidArgumentError(
        "collective sequence 0: they count from 1");
  }
  if (request.timeout_ms() < 1 || request.timeout_ms() > kMaxTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("collective timeout of ", request.timeout_ms(),
                     " ms is not in [1, ", kMaxTimeoutMs, "]"));
  }
  if (!IsReduction(op) && op != v1::COLLECTIVE_OP_BROADCAST &&
      op != v1::COLLECTIVE_OP_BARRIER) {
    return absl::InvalidArgumentError(
        absl::StrCat("collective op ", static_cast<int>(op),
                     " is not one of "
                     "sum, mean, max, min, broadcast, barrier"));
  }
  if (op != v1::COLLECTIVE_OP_BROADCAST && request.src() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(op), " takes no src (got ", request.src(), ")"));
  }
  if (op == v1::COLLECTIVE_OP_BROADCAST && request.src() < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast src ", request.src(),
                     " must be a rank, or -1 (the lowest)"));
  }
  if (op == v1::COLLECTIVE_OP_BARRIER) {
    if (request.dtype() != v1::COLLECTIVE_DTYPE_UNSPECIFIED ||
        request.shape_size() > 0 || !request.values().empty()) {
      return absl::InvalidArgumentError(
          "a barrier carries no dtype, shape or values");
    }
    return absl::OkStatus();
  }
  const v1::CollectiveDtype dtype = request.dtype();
  if (dtype != v1::COLLECTIVE_DTYPE_FLOAT32 &&
      dtype != v1::COLLECTIVE_DTYPE_FLOAT64 &&
      dtype != v1::COLLECTIVE_DTYPE_INT64) {
    return absl::InvalidArgumentError(absl::StrCat(
        DescribeCollective(request), ": dtype ", static_cast<int>(dtype),
        " is not float32, float64 or int64"));
  }
  if (op == v1::COLLECTIVE_OP_MEAN && dtype == v1::COLLECTIVE_DTYPE_INT64) {
    return absl::InvalidArgumentError(
        "all_reduce(mean) of int64 is not exact: reduce with sum and divide");
  }
  // Bounded before multiplying, so a huge shape cannot overflow.
  uint64_t elements = 1;
  for (int64_t d : request.shape()) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          DescribeCollective(request), ": negative dimension ", d));
    }
    elements =
        d == 0 ? 0 : std::min<uint64_t>(elements * d, kMaxCollectiveBytes + 1);
  }
  const uint64_t bytes = elements * ElementBytes(dtype);
  if (bytes > kMaxCollectiveBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(DescribeCollective(request),
                     " is over the collectives' limit of ", kMaxCollectiveBytes,
                     " bytes (1 MiB): they are for metrics, flags, "
                     "seeds and buffers"));
  }
  // A broadcast's other ranks may send nothing, or a tensor that is ignored
  // (so that a rank need not know whether it is the lowest).
  const bool sends =
      op != v1::COLLECTIVE_OP_BROADCAST || request.rank() == src_rank;
  if (request.values().size() != bytes &&
      (sends || !request.values().empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        DescribeCollective(request), " from rank ", request.rank(), ": ",
        request.values().size(), " bytes of values, want ", bytes,
        sends ? "" : " or none (it is not the broadcast's src)"));
  }
  return absl::OkStatus();
}

absl::Status MatchCollective(const v1::CollectiveRequest& a,
                             const v1::CollectiveRequest& b) {
  const bool same = a.op() == b.op() && a.dtype() == b.dtype() &&
                    a.src() == b.src() &&
                    std::equal(a.shape().begin(), a.shape().end(),
                               b.shape().begin(), b.shape().end());
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "collective ", b.sequence(), ": rank ", b.rank(), " calls ",
      DescribeCollective(b), " but rank ", a.rank(), " called ",
      DescribeCollective(a),
      ": every rank must call the same collectives in the same order"));
}

std::string ReduceInRankOrder(v1::CollectiveOp op, v1::CollectiveDtype dtype,
                              const std::vector<const std::string*>& values) {
  switch (dtype) {
    case v1::COLLECTIVE_DTYPE_FLOAT32:
      return Reduce<float>(op, values);
    case v1::COLLECTIVE_DTYPE_FLOAT64:
      return Reduce<double>(op, values);
    default:
      return Reduce<int64_t>(op, values);
  }
}

}  // namespace shardps::coordinator
