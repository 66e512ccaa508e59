// TLS, mutual TLS and bearer-token settings of a shardps process, read from
// their files once at start, and the gRPC credentials built from them: server
// credentials that check the token before any handler runs, and channels that
// present the client certificate and attach the token to every call.
// SecurityOptions is plain data; the credentials are thread-safe.
#ifndef SHARDPS_COMMON_SECURITY_H_
#define SHARDPS_COMMON_SECURITY_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace shardps {

// Where the material comes from (the flags of the same names).
struct SecurityFiles {
  std::string tls_cert;         // PEM certificate (chain) this process presents
  std::string tls_key;          // PEM private key of tls_cert
  std::string tls_ca;           // PEM CA certificates that sign the peers'
  std::string auth_token_file;  // the bearer token, one line
  // Name to check the servers' certificates against instead of the host in
  // the address (for addresses that are not in the certificate).
  std::string tls_server_name;
};

// The loaded material. Default-constructed: plaintext, no token.
struct SecurityOptions {
  SecurityFiles files;
  std::string cert_pem;
  std::string key_pem;
  std::string ca_pem;
  std::string token;
  std::string server_name;

  // Channels use TLS when a CA or a client certificate is given.
  bool client_tls() const { return !ca_pem.empty() || !cert_pem.empty(); }
  // Servers use TLS when they have a certificate; with a CA too they require
  // and verify client certificates (mutual TLS).
  bool server_tls() const { return !cert_pem.empty(); }
  bool mutual_tls() const { return server_tls() && !ca_pem.empty(); }
};

// Reads and checks the files. InvalidArgument naming the flag and the path
// for a file that is missing, unreadable, empty or not PEM; for --tls_cert
// without --tls_key or the reverse; for an empty token; and for a token
// without TLS (--auth_token_file needs --tls_ca or --tls_cert), since a token
// must never travel in plaintext.
absl::StatusOr<SecurityOptions> LoadSecurityOptions(const SecurityFiles& files);

// The extra rules of a process that serves: InvalidArgument when --tls_ca or
// --auth_token_file is given without --tls_cert and --tls_key.
absl::Status CheckServerSecurity(const SecurityOptions& options);

// Credentials for a listening port: plaintext, TLS, or mutual TLS (see
// SecurityOptions). With a token, every call but the gRPC health service's
// must carry "authorization: Bearer <token>"; others end UNAUTHENTICATED
// before any handler sees them. REQUIRES: CheckServerSecurity(options) is OK.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const SecurityOptions& options);

// Credentials for a channel: plaintext, or TLS verifying the server against
// the CA (the system's roots without one), presenting the client certificate
// when there is one, and sending the token with every call.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const SecurityOptions& options);

// A channel to `target` with `args` and the credentials above; sets the TLS
// name override when options.server_name is not empty.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const SecurityOptions& options,
                                           grpc::ChannelArguments args);

// One line for a daemon's start-up log, e.g. "TLS with client certificates
// required; bearer token required (health exempt)".
std::string DescribeServerSecurity(const SecurityOptions& options);
std::string DescribeClientSecurity(const SecurityOptions& options);

// True when `header` (an authorization metadata value) is
// "Bearer <token>". Takes the same time for every header of a given length,
// whatever the token.
bool BearerTokenMatches(absl::string_view header, absl::string_view token);

}  // namespace shardps

#endif  // SHARDPS_COMMON_SECURITY_H_
