// An owned socket file descriptor (RAII) and the low-level I/O error.
#pragma once

#include <stdexcept>
#include <string>

namespace prime::ring {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close() noexcept;
  // Wakes any thread blocked in poll() on this socket and tells the peer (FIN);
  // the descriptor stays open (and its number reserved) until close().
  void shutdown_both() const noexcept;
  void shutdown_write() const noexcept;
  std::string peer_address() const;  // "host:port", or "?" when unknown

 private:
  int fd_ = -1;
};

// A failed socket operation, before the ring adds who and where.
class IoError : public std::runtime_error {
 public:
  enum class Reason { kTimeout, kEof, kReset, kStopped, kOther };
  IoError(Reason reason, const std::string& what) : std::runtime_error(what), reason_(reason) {}
  Reason reason() const { return reason_; }

 private:
  Reason reason_;
};

std::string errno_text(int err);

}  // namespace prime::ring
