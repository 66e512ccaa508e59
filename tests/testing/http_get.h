// A minimal HTTP/1.0 GET over a plain socket, for tests that scrape a
// daemon's /metrics endpoint without depending on curl. Test-only.
#ifndef SHARDPS_TESTS_TESTING_HTTP_GET_H_
#define SHARDPS_TESTS_TESTING_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardps::testing {

// GETs http://127.0.0.1:port/path and returns the body of a 200 response.
// Unavailable when the connection fails, Internal for another status code,
// DeadlineExceeded when the answer takes longer than `timeout`.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(10));

}  // namespace shardps::testing

#endif  // SHARDPS_TESTS_TESTING_HTTP_GET_H_
