// The TLS and token flags of every shardps binary that serves or calls
// gRPC (--tls_cert, --tls_key, --tls_ca, --auth_token_file,
// --tls_server_name), loaded into SecurityOptions. Only *_main.cc files
// include this.
#ifndef SHARDPS_COMMON_SECURITY_FLAGS_H_
#define SHARDPS_COMMON_SECURITY_FLAGS_H_

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/security.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, auth_token_file);
ABSL_DECLARE_FLAG(std::string, tls_server_name);

namespace shardps {

// The files named by the flags, read and checked (LoadSecurityOptions).
absl::StatusOr<SecurityOptions> SecurityOptionsFromFlags();
// The same, with the rules of a process that serves (CheckServerSecurity).
absl::StatusOr<SecurityOptions> ServerSecurityOptionsFromFlags();

// The flags that are set, as "--name=value" with absolute paths, to hand to
// child processes started from another directory.
std::vector<std::string> SecurityFlagArgs();

}  // namespace shardps

#endif  // SHARDPS_COMMON_SECURITY_FLAGS_H_
