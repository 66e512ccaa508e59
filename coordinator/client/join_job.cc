#include "coordinator/client/join_job.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace shardps::coordinator {

absl::StatusOr<std::unique_ptr<CoordinatorClient>> JoinJob(
    JoinOptions options) {
  options.client.on_retry = nullptr;
  if (options.on_retry) {
    options.client.on_retry = [note = options.on_retry](
                                  const absl::Status& reason,
                                  absl::Duration wait) {
      note(absl::StrFormat("not joined yet (%s); retrying in %s",
                           reason.ToString(), absl::FormatDuration(wait)));
    };
  }
  SHARDPS_ASSIGN_OR_RETURN(
      std::unique_ptr<CoordinatorClient> client,
      CoordinatorClient::Create(std::move(options.client)));
  SHARDPS_RETURN_IF_ERROR(client->Join(options.role, options.address,
                                       options.requested_index, options.job_id,
                                       absl::Now() + options.timeout));
  return client;
}

}  // namespace shardps::coordinator
