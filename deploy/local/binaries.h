// Finding the daemons shardps-local runs: a path given on the command line,
// else the build tree or the directory of shardps-local itself.
#ifndef SHARDPS_DEPLOY_LOCAL_BINARIES_H_
#define SHARDPS_DEPLOY_LOCAL_BINARIES_H_

#include <string>

#include "absl/status/statusor.h"

namespace shardps::local {

// `given` if set; else <dir of this executable>/../../`subdir`/`name` (the
// build tree) or <dir of this executable>/`name` (installed side by side).
// NotFound, naming every path tried and `flag` (the flag that overrides the
// search), when none is an executable file.
absl::StatusOr<std::string> FindBinary(const std::string& given,
                                       const std::string& name,
                                       const std::string& subdir,
                                       const std::string& flag);

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_BINARIES_H_
