// Flags of a job member (shardps-server, shardps-worker) that joins through
// the shardps-coordinator instead of static lists: --coordinator and
// --job_id. Only *_main.cc files include this.
#ifndef SHARDPS_COORDINATOR_CLIENT_MEMBER_FLAGS_H_
#define SHARDPS_COORDINATOR_CLIENT_MEMBER_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"

ABSL_DECLARE_FLAG(std::string, coordinator);
ABSL_DECLARE_FLAG(std::string, job_id);

namespace shardps::coordinator {

// True when --coordinator is set.
bool UseCoordinator();

// InvalidArgument naming the flag: --coordinator not host:port, or an empty
// --job_id while a coordinator is used.
absl::Status CheckMemberFlags();

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_CLIENT_MEMBER_FLAGS_H_
