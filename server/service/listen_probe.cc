// listen_probe.cc: getaddrinfo, then bind() of a socket that is closed at once.
#include "server/service/listen_probe.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hsx {

absl::Status ProbeListenAddress(absl::string_view flag, absl::string_view address) {
  if (absl::StartsWith(address, "unix:")) return absl::OkStatus();
  const size_t colon = address.rfind(':');
  std::string host(address.substr(0, colon));
  const std::string port(address.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int error = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", address, ": cannot resolve host '", host, "': ", gai_strerror(error)));
  }
  int last_errno = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));  // as gRPC binds
    const int bound = ::bind(fd, a->ai_addr, a->ai_addrlen);
    last_errno = bound == 0 ? 0 : errno;
    ::close(fd);
    if (bound == 0) {
      ::freeaddrinfo(found);
      return absl::OkStatus();
    }
  }
  ::freeaddrinfo(found);
  const char* why = last_errno == EADDRINUSE      ? "the port is in use"
                    : last_errno == EADDRNOTAVAIL ? "the host is not an address of this machine"
                    : last_errno == EACCES        ? "permission denied (a port below 1024 needs privileges)"
                                                  : "bind failed";
  return absl::UnavailableError(
      absl::StrCat("--", flag, " ", address, ": cannot listen: ", why, " (", std::strerror(last_errno), ")"));
}

}  // namespace hsx
