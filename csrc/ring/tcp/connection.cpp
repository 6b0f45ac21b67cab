#include "connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

namespace prime::ring {
namespace {

IoError::Reason reason_of(int err) {
  switch (err) {
    case ECONNRESET:
    case EPIPE:
    case ECONNABORTED:
    case ENOTCONN:
      return IoError::Reason::kReset;
    default:
      return IoError::Reason::kOther;
  }
}

Deadline effective(const IoLimits& limits, Clock::time_point last_progress) {
  Deadline d = limits.deadline;
  if (limits.idle.count() > 0) d = d.sooner(Deadline{last_progress + limits.idle});
  return d;
}

// Waits for `events` on the socket. Returns the revents, or throws at the deadline / stop.
short wait_for(const Socket& s, short events, const IoLimits& limits, Clock::time_point last_progress,
               const char* what) {
  for (;;) {
    if (limits.stop && limits.stop->load(std::memory_order_relaxed)) {
      throw IoError(IoError::Reason::kStopped, std::string(what) + " interrupted: the ring is shutting down");
    }
    const Deadline d = effective(limits, last_progress);
    if (d.expired()) {
      throw IoError(IoError::Reason::kTimeout, std::string(what) + " made no progress before its deadline");
    }
    pollfd p{s.fd(), events, 0};
    const int rc = ::poll(&p, 1, d.poll_ms(kPollSliceMs));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw IoError(IoError::Reason::kOther, std::string("poll failed: ") + errno_text(errno));
    }
    if (rc > 0) return p.revents;
  }
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw IoError(IoError::Reason::kOther, "fcntl(O_NONBLOCK) failed: " + errno_text(errno));
  }
}

}  // namespace

void send_all(const Socket& s, const void* data, size_t n, const IoLimits& limits, bool more) {
  const char* p = static_cast<const char*>(data);
  auto last_progress = Clock::now();
  const int flags = MSG_NOSIGNAL | (more ? MSG_MORE : 0);  // MSG_NOSIGNAL: EPIPE, not SIGPIPE
  while (n > 0) {
    const ssize_t k = ::send(s.fd(), p, n, flags);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      last_progress = Clock::now();
      if (limits.progress_ns) limits.progress_ns->store(now_ns(), std::memory_order_relaxed);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const short ev = wait_for(s, POLLOUT, limits, last_progress, "send");
      if ((ev & (POLLERR | POLLNVAL)) && !(ev & POLLOUT)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        throw IoError(reason_of(err ? err : ECONNRESET), "send failed: " + errno_text(err ? err : ECONNRESET));
      }
      continue;
    }
    const int err = errno;
    throw IoError(reason_of(err), "send failed: " + errno_text(err));
  }
}

void recv_all(const Socket& s, void* data, size_t n, const IoLimits& limits) {
  char* p = static_cast<char*>(data);
  auto last_progress = Clock::now();
  while (n > 0) {
    const ssize_t k = ::recv(s.fd(), p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      last_progress = Clock::now();
      if (limits.progress_ns) limits.progress_ns->store(now_ns(), std::memory_order_relaxed);
      continue;
    }
    if (k == 0) throw IoError(IoError::Reason::kEof, "connection closed by the peer (EOF)");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_for(s, POLLIN, limits, last_progress, "recv");
      continue;
    }
    const int err = errno;
    throw IoError(reason_of(err), "recv failed: " + errno_text(err));
  }
}

bool wait_readable(const Socket& s, const IoLimits& limits) {
  try {
    wait_for(s, POLLIN, limits, Clock::now(), "recv");
    return true;
  } catch (const IoError& e) {
    if (e.reason() == IoError::Reason::kTimeout || e.reason() == IoError::Reason::kStopped) return false;
    throw;
  }
}

void configure_stream(const Socket& s, int buffer_bytes) {
  set_nonblocking(s.fd());
  const int one = 1;
  ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    // The FORCE variants pass net.core.{w,r}mem_max when we are allowed to (root);
    // otherwise the plain ones are capped by it.
    if (::setsockopt(s.fd(), SOL_SOCKET, SO_SNDBUFFORCE, &buffer_bytes, sizeof(buffer_bytes)) != 0) {
      ::setsockopt(s.fd(), SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    }
    if (::setsockopt(s.fd(), SOL_SOCKET, SO_RCVBUFFORCE, &buffer_bytes, sizeof(buffer_bytes)) != 0) {
      ::setsockopt(s.fd(), SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
    }
  }
}

Socket connect_to(const std::string& host, int port, Deadline deadline, double* rtt_s) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found);
  if (rc != 0) {
    throw IoError(IoError::Reason::kOther, "cannot resolve " + host + ": " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  std::string last_error = "no address";
  int backoff_ms = 20;
  while (!deadline.expired()) {
    for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
      Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (!s.valid()) {
        last_error = "socket() failed: " + errno_text(errno);
        continue;
      }
      set_nonblocking(s.fd());
      const auto t0 = Clock::now();
      if (rtt_s) *rtt_s = 0;
      if (::connect(s.fd(), ai->ai_addr, ai->ai_addrlen) == 0) return s;
      if (errno != EINPROGRESS) {
        last_error = errno_text(errno);
        continue;
      }
      pollfd p{s.fd(), POLLOUT, 0};
      int prc;
      do {
        prc = ::poll(&p, 1, deadline.poll_ms(kPollSliceMs));
      } while ((prc == 0 && !deadline.expired()) || (prc < 0 && errno == EINTR));
      if (prc <= 0) {
        last_error = "connect timed out";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) {
        if (rtt_s) *rtt_s = seconds_since(t0);
        return s;
      }
      last_error = errno_text(err);
    }
    // Refused or unreachable: the peer may not listen yet. Retry with backoff.
    std::this_thread::sleep_for(Millis(std::min(backoff_ms, std::max(1, deadline.poll_ms(backoff_ms)))));
    backoff_ms = std::min(backoff_ms * 2, 500);
  }
  throw IoError(IoError::Reason::kTimeout, "could not connect to " + host + ":" + port_text + " (" + last_error + ")");
}

}  // namespace prime::ring
