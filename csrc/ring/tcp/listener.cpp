#include "listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <memory>

#include "connection.h"

namespace prime::ring {

Listener::Listener(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found);
  if (rc != 0) {
    throw IoError(IoError::Reason::kOther, "cannot resolve bind address " + host + ": " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  std::string last_error = "no address";
  for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!s.valid()) {
      last_error = errno_text(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), 128) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len);
    port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    socket_ = std::move(s);
    return;
  }
  throw IoError(IoError::Reason::kOther, "cannot listen on " + host + ":" + port_text + ": " + last_error);
}

Socket Listener::accept(Deadline deadline, const std::atomic<bool>* stop, int wake_fd) {
  for (;;) {
    if (stop && stop->load()) throw IoError(IoError::Reason::kStopped, "accept interrupted");
    if (deadline.expired()) throw IoError(IoError::Reason::kTimeout, "no connection before the deadline");
    pollfd p[2] = {{socket_.fd(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
    const int rc = ::poll(p, wake_fd >= 0 ? 2 : 1, deadline.poll_ms(kPollSliceMs));
    if (rc < 0 && errno != EINTR) throw IoError(IoError::Reason::kOther, "poll failed: " + errno_text(errno));
    if (rc <= 0) continue;
    if (wake_fd >= 0 && p[1].revents != 0) return Socket();
    if (p[0].revents == 0) continue;
    Socket s(::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (s.valid()) return s;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
    throw IoError(IoError::Reason::kOther, "accept failed: " + errno_text(errno));
  }
}

}  // namespace prime::ring
