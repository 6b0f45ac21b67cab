// Forming the ring's links: listen on the configured address, accept the left
// neighbour's k streams (in the background, from construction on, so that no rank
// waits for another to reach its accept loop), connect k streams to the right
// neighbour, authenticate every stream (tcp/handshake.h). Connections that fail the
// handshake (wrong secret, job, rank, garbage, port scans) are dropped and listed
// in rejected(); accepting goes on until the real neighbour arrives or the deadline.
//
// Handshakes run in parallel, one thread each, each with its own short deadline
// (min(kHandshakeLimit, timeout)); at most kMaxPendingHandshakes at a time, the
// oldest dropped to make room for a new one. So connections that stay silent or
// dribble bytes cannot keep the real neighbour out: it is served as soon as it
// connects, and needs milliseconds.
#pragma once

#include <atomic>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "tcp/handshake.h"
#include "tcp/listener.h"

namespace prime::ring {

// A stranger gets this long (or the rendezvous timeout, if shorter) to finish its
// handshake; the real neighbour needs a few round trips.
constexpr Millis kHandshakeLimit{5000};
// Handshakes served at once (a thread each). The neighbour's streams connect one
// after another, so it needs one slot; the rest bounds what strangers can hold.
constexpr size_t kMaxPendingHandshakes = 32;
// rejected() lists this many connections, then counts the rest.
constexpr size_t kMaxRejectedLines = 256;

struct RendezvousOptions {
  int rank = 0;
  int world_size = 2;
  int streams = 1;
  HandshakeConfig handshake;
  std::string bind_addr = "127.0.0.1";
  int socket_buffer_bytes = 0;
  Millis timeout{60000};
};

// An authenticated stream and its session keys.
struct Stream {
  Socket socket;
  SessionKeys keys;
};

struct Links {
  std::vector<Stream> right;  // k streams we send on (we were the handshake's client)
  std::vector<Stream> left;   // k streams we receive on (we were the server)
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
  // From another thread: complete() gives up (kClosed) as soon as it next checks (the
  // accept loop at once; a connection attempt to the right within its deadline).
  void interrupt();

 private:
  struct Pending {
    Socket socket;  // moved out (under mu_) once it is a left stream
    std::string who;
    bool evicted = false;  // under mu_
    bool done = false;     // under mu_
    std::thread thread;
  };

  void accept_loop();        // the acceptor thread: accept_until_done(), then join the handshakes
  void accept_until_done();
  void serve(Pending* p);    // a handshake thread: serve_one(), then mark it done (always)
  void serve_one(Pending* p);
  void reject(const std::string& line);  // mu_ held
  void wake() const;
  void stop();
  Stream connect_right(const std::string& host, int port, int stream, const std::string& where);
  CommError error(ErrorKind kind, int peer, const std::string& cause) const;

  const RendezvousOptions opt_;
  const Deadline deadline_;
  const Millis handshake_limit_;
  const int left_;
  const int right_;
  Listener listener_;
  Socket wake_;  // an eventfd: a finished handshake wakes the accept loop
  std::atomic<bool> stop_{false};
  std::atomic<bool> interrupted_{false};
  std::thread acceptor_;
  std::list<std::unique_ptr<Pending>> pending_;  // the accept loop's

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a stream arrived, or the accept loop ended
  std::vector<Stream> left_streams_;  // index = stream
  int accepted_ = 0;
  bool acceptor_done_ = false;
  std::optional<std::string> accept_error_;
  std::vector<std::string> rejected_;
  size_t rejected_unlisted_ = 0;  // beyond kMaxRejectedLines
};

}  // namespace prime::ring
