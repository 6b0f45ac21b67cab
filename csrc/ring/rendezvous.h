// Forming the links: every rank links to every other (a mesh), so that any ring order
// and the two-hop schedule run without new connections. Each rank listens on the
// configured address and accepts its peers' streams in the background, from
// construction on (no rank waits for another to reach its accept loop); it connects
// its own streams to every peer, a thread per peer, and authenticates every stream
// (tcp/handshake.h). Connections that fail the handshake (wrong secret, job, rank,
// garbage, port scans) are dropped and listed in rejected(); accepting goes on until
// every peer's streams are in or the deadline passes.
//
// The client side of a link chooses its streams: the setting, or (setting 0) as many as
// the link's bandwidth-delay product may need (tcp/tuning.h: for kPoolLinkRate, of which
// it starts using those that kAssumedLinkRate needs), from the round trip of the link's
// first TCP connect; the handshake tells the server how many to expect.
//
// Handshakes run in parallel, one thread each, each with its own short deadline
// (min(kHandshakeLimit, timeout)); at most max_pending() at a time, the oldest dropped
// to make room for a new one. So connections that stay silent or dribble bytes cannot
// keep the real peers out: each is served as soon as it connects, and needs milliseconds.
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
#include "tcp/tuning.h"

namespace prime::ring {

// A stranger gets this long (or the rendezvous timeout, if shorter) to finish its
// handshake; a real peer needs a few round trips.
constexpr Millis kHandshakeLimit{5000};
// Handshakes served at once (a thread each) beyond what the peers need at once (their
// first streams): bounds what strangers can hold.
constexpr size_t kMaxPendingHandshakes = 32;
// rejected() lists this many connections, then counts the rest.
constexpr size_t kMaxRejectedLines = 256;

struct RendezvousOptions {
  int rank = 0;
  int world_size = 2;
  HandshakeConfig handshake;  // handshake.streams: the streams setting (0: chosen per link)
  std::string bind_addr = "127.0.0.1";
  int socket_buffer_bytes = 0;  // > 0: fixed send and receive buffers ($PRIME_RING_SOCKET_BUFFER)
  double link_rate = kAssumedLinkRate;  // bytes/s a link starts from (max_rate when set)
  double pool_rate = kPoolLinkRate;    // bytes/s the streams opened allow for
  Millis timeout{60000};
};

// An authenticated stream and its session keys.
struct Stream {
  Socket socket;
  SessionKeys keys;
};

// This rank's link with one peer.
struct Link {
  std::vector<Stream> out;  // streams we send on (we were the handshake's client)
  std::vector<Stream> in;   // streams we receive on (we were the server)
  double rtt_s = -1;        // the smallest round trip our connects and handshakes saw
  LinkPlan plan;            // how our streams were set up (enough for pool_rate)
  int start_streams = 1;    // how many of them to use at first (enough for link_rate)
};

struct Address {
  std::string host;
  int port = 0;
};

class Rendezvous {
 public:
  explicit Rendezvous(RendezvousOptions options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int port() const { return listener_.port(); }
  // Connects to every peer (addresses[r] for rank r; ours is ignored) and waits for
  // every peer's streams. Returns the links indexed by rank (ours empty). Throws
  // CommError (kind kTimeout, kHandshake, kConnectionLost) naming a peer that failed.
  std::vector<Link> complete(const std::vector<Address>& addresses);
  std::vector<std::string> rejected() const;
  // From another thread: complete() gives up (kClosed) as soon as it next checks (the
  // accept loop at once; a connection attempt within its deadline).
  void interrupt();

 private:
  struct Pending {
    Socket socket;  // moved out (under mu_) once it is a peer's stream
    std::string who;
    bool evicted = false;  // under mu_
    bool done = false;     // under mu_
    std::thread thread;
  };

  size_t max_pending() const;
  void accept_loop();  // the acceptor thread: accept_until_done(), then join the handshakes
  void accept_until_done();
  bool all_in() const;  // mu_ held
  void serve(Pending* p);  // a handshake thread: serve_one(), then mark it done (always)
  void serve_one(Pending* p);
  void reject(const std::string& line);  // mu_ held
  void wake() const;
  void stop();
  Link connect_link(int peer, const Address& a);
  // Stream `stream` of the link; the first one also sets link->plan (from its connect's round trip).
  Stream connect_stream(int peer, const Address& a, int stream, Link* link, double* rtt_s);
  CommError error(ErrorKind kind, int peer, const std::string& cause) const;

  const RendezvousOptions opt_;
  const SocketLimits limits_;
  const Deadline deadline_;
  const Millis handshake_limit_;
  Listener listener_;
  Socket wake_;  // an eventfd: a finished handshake wakes the accept loop
  std::atomic<bool> stop_{false};
  std::atomic<bool> interrupted_{false};
  std::thread acceptor_;
  std::list<std::unique_ptr<Pending>> pending_;  // the accept loop's

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a stream arrived, or the accept loop ended
  std::vector<std::vector<Stream>> in_;  // [peer][stream], sized by the peer's first stream
  std::vector<int> in_count_;            // streams in, per peer
  int links_in_ = 0;                     // peers whose streams are all in
  bool acceptor_done_ = false;
  std::optional<std::string> accept_error_;
  std::vector<std::string> rejected_;
  size_t rejected_unlisted_ = 0;  // beyond kMaxRejectedLines
};

}  // namespace prime::ring
