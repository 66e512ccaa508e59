#include "common/security_flags.h"

#include <filesystem>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) this process presents: a daemon serves "
          "TLS with it; a client presents it for mutual TLS. Needs "
          "--tls_key.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s): clients verify servers against them; a "
          "daemon with --tls_cert also requires client certificates signed "
          "by them (mutual TLS). A client with only this flag uses TLS "
          "without a client certificate.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token (one line). Daemons refuse calls "
          "without it (UNAUTHENTICATED; the gRPC health service is exempt); "
          "clients send it with every call. Needs TLS.");
ABSL_FLAG(std::string, tls_server_name, "",
          "Check the servers' certificates against this name instead of the "
          "host in each address (for addresses not in the certificate).");

namespace shardps {

absl::StatusOr<SecurityOptions> SecurityOptionsFromFlags() {
  SecurityFiles files;
  files.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  files.tls_key = absl::GetFlag(FLAGS_tls_key);
  files.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  files.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  files.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  return LoadSecurityOptions(files);
}

absl::StatusOr<SecurityOptions> ServerSecurityOptionsFromFlags() {
  SHARDPS_ASSIGN_OR_RETURN(SecurityOptions options, SecurityOptionsFromFlags());
  SHARDPS_RETURN_IF_ERROR(CheckServerSecurity(options));
  return options;
}

std::vector<std::string> SecurityFlagArgs() {
  std::vector<std::string> args;
  auto path = [&args](const char* name, const std::string& value) {
    if (value.empty()) return;
    std::error_code ec;
    std::filesystem::path absolute = std::filesystem::absolute(value, ec);
    args.push_back(
        absl::StrCat("--", name, "=", ec ? value : absolute.string()));
  };
  path("tls_cert", absl::GetFlag(FLAGS_tls_cert));
  path("tls_key", absl::GetFlag(FLAGS_tls_key));
  path("tls_ca", absl::GetFlag(FLAGS_tls_ca));
  path("auth_token_file", absl::GetFlag(FLAGS_auth_token_file));
  const std::string name = absl::GetFlag(FLAGS_tls_server_name);
  if (!name.empty()) args.push_back(absl::StrCat("--tls_server_name=", name));
  return args;
}

}  // namespace shardps
