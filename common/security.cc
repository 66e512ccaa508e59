#include "common/security.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace shardps {
namespace {

constexpr char kBearerPrefix[] = "Bearer ";
// Health checks stay open to callers without the token (still behind TLS
// and client certificates): probes and `shardps-ctl health` need no secret,
// and the answer tells nothing about the job.
constexpr char kHealthPathPrefix[] = "/grpc.health.v1.Health/";

absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag,
                                         const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", path, ": cannot read: ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": read error"));
  }
  return text.str();
}

// Reads a PEM file whose blocks must include `block` ("CERTIFICATE",
// "PRIVATE KEY"), so that a swapped or truncated file fails at start rather
// than in the first handshake.
absl::StatusOr<std::string> ReadPem(absl::string_view flag,
                                    const std::string& path,
                                    absl::string_view block) {
  absl::StatusOr<std::string> text = ReadFlagFile(flag, path);
  if (!text.ok()) return text.status();
  if (!absl::StrContains(*text, "-----BEGIN ") ||
      !absl::StrContains(*text, absl::StrCat(block, "-----"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", path, ": not a PEM file holding a ", block));
  }
  return text;
}

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFlagFile("auth_token_file", path);
  if (!text.ok()) return text.status();
  const std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_token_file=", path, ": the token is empty"));
  }
  // The token travels as an HTTP/2 header value.
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file=", path,
                       ": the token must be one line of printable ASCII "
                       "without spaces"));
    }
  }
  return token;
}

// Rejects calls without the bearer token. Runs in the server's auth filter,
// before the call reaches any service, so a refused call changes nothing.
class BearerTokenProcessor : public grpc::AuthMetadataProcessor {
 public:
  explicit BearerTokenProcessor(std::string token) : token_(std::move(token)) {}

  // A string compare: cheap enough for the network thread.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata,
                       grpc::AuthContext* /*context*/,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* /*response_metadata*/) override {
    const auto path = auth_metadata.find(":path");
    if (path != auth_metadata.end() &&
        absl::StartsWith(
            absl::string_view(path->second.data(), path->second.size()),
            kHealthPathPrefix)) {
      return grpc::Status::OK;
    }
    const auto header = auth_metadata.find("authorization");
    if (header == auth_metadata.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing bearer token");
    }
    const absl::string_view value(header->second.data(), header->second.size());
    if (!BearerTokenMatches(value, token_)) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "wrong bearer token");
    }
    // Handlers have no use for the secret.
    consumed_auth_metadata->emplace("authorization", std::string(value));
    return grpc::Status::OK;
  }

 private:
  const std::string token_;
};

}  // namespace

bool BearerTokenMatches(absl::string_view header, absl::string_view token) {
  const std::string expected = absl::StrCat(kBearerPrefix, token);
  if (header.size() != expected.size()) return false;
  // Every byte is compared, so the time does not tell how much matched.
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(header[i]) ^
            static_cast<unsigned char>(expected[i]);
  }
  return diff == 0;
}

absl::StatusOr<SecurityOptions> LoadSecurityOptions(
    const SecurityFiles& files) {
  SecurityOptions o;
  o.files = files;
  o.server_name = files.tls_server_name;
  if (files.tls_cert.empty() != files.tls_key.empty()) {
    return absl::InvalidArgumentError(files.tls_cert.empty()
                                          ? "--tls_key needs --tls_cert"
                                          : "--tls_cert needs --tls_key");
  }
  if (!files.tls_cert.empty()) {
    absl::StatusOr<std::string> cert =
        ReadPem("tls_cert", files.tls_cert, "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key =
        ReadPem("tls_key", files.tls_key, "PRIVATE KEY");
    if (!key.ok()) return key.status();
    o.cert_pem = *std::move(cert);
    o.key_pem = *std::move(key);
  }
  if (!files.tls_ca.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPem("tls_ca", files.tls_ca, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    o.ca_pem = *std::move(ca);
  }
  if (!files.auth_token_file.empty()) {
    if (!o.client_tls()) {
      return absl::InvalidArgumentError(
          "--auth_token_file needs TLS (--tls_cert and --tls_key on a "
          "daemon, at least --tls_ca on a client): the token is never sent "
          "in plaintext");
    }
    absl::StatusOr<std::string> token = ReadToken(files.auth_token_file);
    if (!token.ok()) return token.status();
    o.token = *std::move(token);
  }
  if (!o.server_name.empty() && !o.client_tls()) {
    return absl::InvalidArgumentError(
        "--tls_server_name needs --tls_ca or --tls_cert");
  }
  return o;
}

absl::Status CheckServerSecurity(const SecurityOptions& options) {
  if (options.server_tls()) return absl::OkStatus();
  if (!options.ca_pem.empty()) {
    return absl::InvalidArgumentError(
        "--tls_ca on a daemon needs --tls_cert and --tls_key (its own "
        "certificate)");
  }
  if (!options.token.empty()) {
    return absl::InvalidArgumentError(
        "--auth_token_file on a daemon needs --tls_cert and --tls_key: the "
        "token is never sent in plaintext");
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const SecurityOptions& options) {
  if (!options.server_tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      options.mutual_tls()
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_root_certs = options.ca_pem;
  ssl.pem_key_cert_pairs.push_back({options.key_pem, options.cert_pem});
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::SslServerCredentials(ssl);
  if (!options.token.empty()) {
    credentials->SetAuthMetadataProcessor(
        std::make_shared<BearerTokenProcessor>(options.token));
  }
  return credentials;
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const SecurityOptions& options) {
  if (!options.client_tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.ca_pem;
  ssl.pem_private_key = options.key_pem;
  ssl.pem_cert_chain = options.cert_pem;
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::SslCredentials(ssl);
  if (options.token.empty()) return credentials;
  // Sends "authorization: Bearer <token>"; gRPC attaches it only to calls on
  // a secure channel.
  return grpc::CompositeChannelCredentials(
      credentials, grpc::AccessTokenCredentials(options.token));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const SecurityOptions& options,
                                           grpc::ChannelArguments args) {
  if (!options.server_name.empty()) {
    args.SetSslTargetNameOverride(options.server_name);
  }
  return grpc::CreateCustomChannel(target, MakeChannelCredentials(options),
                                   args);
}

std::string DescribeServerSecurity(const SecurityOptions& options) {
  if (!options.server_tls()) return "plaintext (no TLS, no token)";
  return absl::StrCat(
      options.mutual_tls() ? "TLS with client certificates required"
                           : "TLS without client certificates",
      options.token.empty() ? "; no bearer token"
                            : "; bearer token required (health exempt)");
}

std::string DescribeClientSecurity(const SecurityOptions& options) {
  if (!options.client_tls()) return "plaintext";
  return absl::StrCat(
      "TLS", options.ca_pem.empty() ? " (system roots)" : "",
      options.cert_pem.empty() ? "" : " with a client certificate",
      options.token.empty() ? "" : ", bearer token",
      options.server_name.empty()
          ? ""
          : absl::StrCat(", server name ", options.server_name));
}

}  // namespace shardps
