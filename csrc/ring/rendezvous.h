// Forming the ring's links: listen on the configured address, accept the left
// neighbour's k streams (in the background, from construction on, so that no rank
// waits for another to reach its accept loop), connect k streams to the right
// neighbour, authenticate every stream (tcp/handshake.h). Connections that fail the
// handshake (wrong secret, job, rank, garbage, port scans) are dropped and listed
// in rejected(); accepting goes on until the real neighbour arrives or the deadline.
#pragma once

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "tcp/handshake.h"
#include "tcp/listener.h"

namespace prime::ring {

struct RendezvousOptions {
  int rank = 0;
  int world_size = 2;
  int streams = 1;
  HandshakeConfig handshake;
  std::string bind_addr = "127.0.0.1";
  int socket_buffer_bytes = 0;
  Millis timeout{60000};
};

struct Links {
  std::vector<Socket> right;  // k streams we send on
  std::vector<Socket> left;   // k streams we receive on
};

class Rendezvous {
 public:
  explicit Rendezvous(RendezvousOptions options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int port() const { return listener_.port(); }
  // Connects to the right neighbour and waits for the left one. Throws CommError
  // (kind kTimeout or kHandshake) naming the neighbour that did not come.
  Links complete(const std::string& right_host, int right_port);
  std::vector<std::string> rejected() const;

 private:
  void accept_loop();
  void stop();
  CommError error(ErrorKind kind, int peer, const std::string& cause) const;

  const RendezvousOptions opt_;
  const Deadline deadline_;
  const int left_;
  const int right_;
  Listener listener_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;

  mutable std::mutex mu_;
  std::vector<Socket> left_streams_;  // index = stream
  int accepted_ = 0;
  std::optional<std::string> accept_error_;
  std::vector<std::string> rejected_;
};

}  // namespace prime::ring
