// A listening TCP socket on a configured address (port 0: the kernel picks one).
#pragma once

#include <atomic>
#include <string>

#include "../deadline.h"
#include "socket.h"

namespace prime::ring {

class Listener {
 public:
  Listener(const std::string& host, int port);
  int port() const { return port_; }
  // The next connection, configured non-blocking; throws IoError(kTimeout) at the
  // deadline. Returns an invalid Socket early when `wake_fd` (>= 0) becomes readable.
  Socket accept(Deadline deadline, const std::atomic<bool>* stop, int wake_fd = -1);
  void close() { socket_.close(); }

 private:
  Socket socket_;
  int port_ = 0;
};

}  // namespace prime::ring
