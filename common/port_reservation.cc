#include "common/port_reservation.h"

#include <netdb.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace shardps {
namespace {

int PortOf(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6&>(addr).sin6_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PortReservation>> PortReservation::Reserve(
    const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", port, " is outside [0, 65535]"));
  }
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc = getaddrinfo(name.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host \"", host, "\": ", gai_strerror(rc)));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  std::string error;
  if (fd < 0) {
    error = absl::StrCat("socket: ", strerror(errno));
  } else if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
             setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0) {
    error = absl::StrCat("setsockopt: ", strerror(errno));
  } else if (bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
    error = absl::StrCat("bind: ", strerror(errno));
  }
  freeaddrinfo(found);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (error.empty() &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    error = absl::StrCat("getsockname: ", strerror(errno));
  }
  if (!error.empty()) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot reserve ", host, ":", port, " (", error, ")"));
  }
  return std::unique_ptr<PortReservation>(
      new PortReservation(fd, PortOf(bound)));
}

PortReservation::~PortReservation() { close(fd_); }

}  // namespace shardps
