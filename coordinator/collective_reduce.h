// The arithmetic of the coordinator's collectives (rpc Collective in
// coordinator.proto): what a well-formed call is, and the reduction of the
// participants' values in rank order, so that every rank gets bitwise the
// same result whatever the order in which the calls arrived. Pure
// functions.
#ifndef SHARDPS_COORDINATOR_COLLECTIVE_REDUCE_H_
#define SHARDPS_COORDINATOR_COLLECTIVE_REDUCE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shardps/v1/coordinator.pb.h"

namespace shardps::coordinator {

// The largest CollectiveRequest.values: collectives carry metrics, flags,
// seeds and buffers, not models (gradients go to the servers).
inline constexpr size_t kMaxCollectiveBytes = size_t{1} << 20;

// "all_reduce(sum) float32 [2, 3]", "broadcast(src 1) int64 [4]",
// "barrier": how error messages name a call.
std::string DescribeCollective(const v1::CollectiveRequest& request);

// Checks one call on its own: op, dtype, shape, the size of values (for
// its op and whether the caller is the broadcast's `src`), src and
// timeout. InvalidArgument names what is wrong; ResourceExhausted for
// values over kMaxCollectiveBytes. `src_rank` is the broadcast's resolved
// source (src, or the lowest participant for -1).
absl::Status ValidateCollective(const v1::CollectiveRequest& request,
                                uint32_t src_rank);

// Whether `b` is the same collective as `a` (op, dtype, shape, src); an
// InvalidArgument naming both calls otherwise.
absl::Status MatchCollective(const v1::CollectiveRequest& a,
                             const v1::CollectiveRequest& b);

// The result of reducing `values` (one per participant, in ascending rank
// order, each valid for `op` and `dtype` and of equal size) element by
// element: SUM and MEAN add in rank order (MEAN then divides by the
// count), MAX and MIN keep the first NaN, else the first extreme value.
// REQUIRES: op is SUM, MEAN, MAX or MIN; values is not empty.
std::string ReduceInRankOrder(v1::CollectiveOp op, v1::CollectiveDtype dtype,
                              const std::vector<const std::string*>& values);

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_COLLECTIVE_REDUCE_H_
