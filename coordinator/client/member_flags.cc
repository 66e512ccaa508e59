#include "coordinator/client/member_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of the shardps-coordinator to join; it assigns the index "
          "and tells the job's shape and addresses. Empty: static mode.");
ABSL_FLAG(std::string, job_id, "shardps",
          "Job to join; must equal the coordinator's --job_id.");

namespace shardps::coordinator {

bool UseCoordinator() { return !absl::GetFlag(FLAGS_coordinator).empty(); }

absl::Status CheckMemberFlags() {
  if (!UseCoordinator()) return absl::OkStatus();
  const std::string address = absl::GetFlag(FLAGS_coordinator);
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--coordinator=", address, " is not host:port"));
  }
  if (absl::GetFlag(FLAGS_job_id).empty()) {
    return absl::InvalidArgumentError("--job_id is empty");
  }
  return absl::OkStatus();
}

}  // namespace shardps::coordinator
