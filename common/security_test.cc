#include "common/security.h"

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace shardps {
namespace {

// Contents that pass the PEM checks; no handshake uses them here.
constexpr char kCertPem[] =
    "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
constexpr char kKeyPem[] =
    "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n";

class SecurityOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = shardps::testing::MakeTempDir("security_test");
    cert_ = Write("tls.crt", kCertPem);
    key_ = Write("tls.key", kKeyPem);
    ca_ = Write("ca.crt", kCertPem);
    token_ = Write("token", "s3cret-token\n");
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  SecurityFiles Full() const {
    SecurityFiles f;
    f.tls_cert = cert_;
    f.tls_key = key_;
    f.tls_ca = ca_;
    f.auth_token_file = token_;
    return f;
  }

  std::string dir_, cert_, key_, ca_, token_;
};

TEST_F(SecurityOptionsTest, EmptyFilesMeanPlaintext) {
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(SecurityFiles());
  SHARDPS_ASSERT_OK(o);
  EXPECT_FALSE(o->client_tls());
  EXPECT_FALSE(o->server_tls());
  SHARDPS_EXPECT_OK(CheckServerSecurity(*o));
  EXPECT_EQ(DescribeServerSecurity(*o), "plaintext (no TLS, no token)");
}

TEST_F(SecurityOptionsTest, LoadsEverythingForMutualTlsWithToken) {
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(Full());
  SHARDPS_ASSERT_OK(o);
  EXPECT_TRUE(o->mutual_tls());
  EXPECT_EQ(o->cert_pem, kCertPem);
  EXPECT_EQ(o->key_pem, kKeyPem);
  EXPECT_EQ(o->token, "s3cret-token");  // the newline stripped
  SHARDPS_EXPECT_OK(CheckServerSecurity(*o));
  EXPECT_EQ(DescribeServerSecurity(*o),
            "TLS with client certificates required; bearer token required "
            "(health exempt)");
}

TEST_F(SecurityOptionsTest, RejectsBadFlagCombinationsNamingTheFlag) {
  struct Case {
    std::string name;
    SecurityFiles files;
    std::string want;  // in the message
  };
  std::vector<Case> cases;
  SecurityFiles f = Full();
  f.tls_key.clear();
  cases.push_back({"cert without key", f, "--tls_cert needs --tls_key"});
  f = Full();
  f.tls_cert.clear();
  cases.push_back({"key without cert", f, "--tls_key needs --tls_cert"});
  f = Full();
  f.tls_cert = dir_ + "/missing.crt";
  cases.push_back({"missing cert", f, "--tls_cert=" + dir_ + "/missing.crt"});
  f = Full();
  f.tls_ca = dir_ + "/missing-ca.crt";
  cases.push_back({"missing ca", f, "--tls_ca=" + dir_ + "/missing-ca.crt"});
  f = Full();
  f.tls_key = cert_;
  cases.push_back({"cert as key", f, "not a PEM file holding a PRIVATE KEY"});
  f = Full();
  f.tls_ca = token_;
  cases.push_back({"token as ca", f, "--tls_ca="});
  f = Full();
  f.auth_token_file = Write("empty-token", " \n");
  cases.push_back({"empty token", f, "the token is empty"});
  f = Full();
  f.auth_token_file = Write("two-words", "two words\n");
  cases.push_back({"token with a space", f, "printable ASCII"});
  f = SecurityFiles();
  f.auth_token_file = token_;
  cases.push_back({"token without TLS", f, "--auth_token_file needs TLS"});
  f = SecurityFiles();
  f.tls_server_name = "server-0";
  cases.push_back({"server name without TLS", f, "--tls_server_name needs"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(c.files);
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(o.status().message(), c.want)) << o.status();
  }
}

TEST_F(SecurityOptionsTest, ClientWithOnlyCaAndTokenIsNoServer) {
  SecurityFiles f;
  f.tls_ca = ca_;
  f.auth_token_file = token_;
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(f);
  SHARDPS_ASSERT_OK(o);
  EXPECT_TRUE(o->client_tls());
  EXPECT_FALSE(o->server_tls());
  const absl::Status server = CheckServerSecurity(*o);
  EXPECT_EQ(server.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(server.message(), "--tls_ca on a daemon"))
      << server;
}

TEST(BearerTokenTest, MatchesOnlyTheExactHeader) {
  EXPECT_TRUE(BearerTokenMatches("Bearer abc", "abc"));
  EXPECT_FALSE(BearerTokenMatches("Bearer abd", "abc"));
  EXPECT_FALSE(BearerTokenMatches("Bearer abcd", "abc"));
  EXPECT_FALSE(BearerTokenMatches("Bearer ab", "abc"));
  EXPECT_FALSE(BearerTokenMatches("bearer abc", "abc"));
  EXPECT_FALSE(BearerTokenMatches("abc", "abc"));
  EXPECT_FALSE(BearerTokenMatches("", "abc"));
}

}  // namespace
}  // namespace shardps
