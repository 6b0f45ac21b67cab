#include "rendezvous.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cxxabi.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <system_error>

#include "tcp/connection.h"

namespace prime::ring {

Rendezvous::Rendezvous(RendezvousOptions options)
    : opt_(std::move(options)),
      limits_(SocketLimits::of_host()),
      deadline_(Deadline::after(opt_.timeout)),
      handshake_limit_(std::min(kHandshakeLimit, opt_.timeout)),
      listener_(opt_.bind_addr, 0),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      in_(static_cast<size_t>(opt_.world_size)),
      in_count_(static_cast<size_t>(opt_.world_size), 0) {
  if (!wake_.valid()) throw IoError(IoError::Reason::kOther, "eventfd failed: " + errno_text(errno));
  acceptor_ = std::thread(&Rendezvous::accept_loop, this);
}

Rendezvous::~Rendezvous() { stop(); }

size_t Rendezvous::max_pending() const {
  // Every peer's streams may arrive at once (a peer opens its streams in parallel).
  const int per_peer = opt_.handshake.streams > 0 ? opt_.handshake.streams : kMaxAutoStreams;
  return kMaxPendingHandshakes + static_cast<size_t>(std::max(0, opt_.world_size - 1) * per_peer);
}

void Rendezvous::stop() {
  stop_ = true;
  wake();
  if (acceptor_.joinable()) acceptor_.join();
  listener_.close();
}

void Rendezvous::interrupt() {
  interrupted_ = true;
  stop_ = true;
  wake();
  cv_.notify_all();
}

void Rendezvous::wake() const {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t rc = ::write(wake_.fd(), &one, sizeof(one));  // full counter: already awake
}

std::vector<std::string> Rendezvous::rejected() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out = rejected_;
  if (rejected_unlisted_ > 0) {
    out.push_back("... and " + std::to_string(rejected_unlisted_) + " more rejected connection(s)");
  }
  return out;
}

void Rendezvous::reject(const std::string& line) {
  if (rejected_.size() < kMaxRejectedLines) {
    rejected_.push_back(line);
  } else {
    ++rejected_unlisted_;
  }
}

CommError Rendezvous::error(ErrorKind kind, int peer, const std::string& cause) const {
  ErrorInfo e;
  e.kind = kind;
  e.rank = opt_.rank;
  e.peer = peer;
  e.origin = opt_.rank;
  e.where.phase = Phase::kRendezvous;
  e.cause = cause;
  return CommError(e);
}

bool Rendezvous::all_in() const { return links_in_ == opt_.world_size - 1; }

void Rendezvous::accept_loop() {
  try {
    accept_until_done();
  } catch (const abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {  // allocation failure: stop accepting, say why
    std::lock_guard<std::mutex> lock(mu_);
    accept_error_ = std::string("internal error while accepting: ") + e.what();
  }
  // Every peer is in, or the deadline passed, or we stop: interrupt the rest.
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : pending_) p->socket.shutdown_both();
  }
  for (auto& p : pending_) {
    if (p->thread.joinable()) p->thread.join();
  }
  pending_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    acceptor_done_ = true;
  }
  cv_.notify_all();
}

void Rendezvous::accept_until_done() {
  for (;;) {
    // Join the handshakes that finished.
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done;
      {
        std::lock_guard<std::mutex> lock(mu_);
        done = (*it)->done;
      }
      if (done) {
        (*it)->thread.join();
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (all_in()) break;
    }
    Socket s;
    try {
      s = listener_.accept(deadline_, &stop_, wake_.fd());
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (e.reason() != IoError::Reason::kStopped) accept_error_ = e.what();
      break;
    }
    if (!s.valid()) {  // woken
      uint64_t count;
      [[maybe_unused]] const ssize_t rc = ::read(wake_.fd(), &count, sizeof(count));
      continue;
    }
    if (pending_.size() >= max_pending()) {
      // Make room: drop the oldest (its thread sees EOF at once and ends).
      for (auto& p : pending_) {
        std::lock_guard<std::mutex> lock(mu_);
        if (p->done || p->evicted) continue;
        p->evicted = true;
        p->socket.shutdown_both();
        break;
      }
    }
    auto p = std::make_unique<Pending>();
    p->who = s.peer_address();
    p->socket = std::move(s);
    Pending* raw = p.get();
    // Listed before its thread starts: a Pending is never destroyed with a running thread.
    pending_.push_back(std::move(p));
    try {
      raw->thread = std::thread(&Rendezvous::serve, this, raw);
    } catch (const std::system_error& e) {  // out of threads: refuse this one, keep accepting
      std::lock_guard<std::mutex> lock(mu_);
      reject("rejected connection from " + raw->who + ": cannot start a handshake thread: " + e.what());
      pending_.pop_back();
      continue;
    }
  }
}

void Rendezvous::serve(Pending* p) {
  try {
    serve_one(p);
  } catch (const abi::__forced_unwind&) {
    throw;
  } catch (...) {  // only an allocation failure while reporting: still mark it done
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    p->done = true;
  }
  wake();
  cv_.notify_all();
}

void Rendezvous::serve_one(Pending* p) {
  std::string failure;
  try {
    const Deadline d = deadline_.sooner(Deadline::after(handshake_limit_));
    Accepted a = handshake_server(p->socket, opt_.handshake, opt_.rank, d);
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Stream>& link = in_[static_cast<size_t>(a.rank)];
    if (link.empty()) link.resize(static_cast<size_t>(a.link_streams));
    if (static_cast<int>(link.size()) != a.link_streams) {
      failure = "rank " + std::to_string(a.rank) + " announced " + std::to_string(a.link_streams) +
                " streams, and " + std::to_string(link.size()) + " before";
    } else if (link[static_cast<size_t>(a.stream)].socket.valid()) {
      failure = "stream " + std::to_string(a.stream) + " of rank " + std::to_string(a.rank) + " is already connected";
    } else if (p->evicted || stop_) {
      failure = "dropped after its handshake: the ring stopped forming";
    } else {
      configure_stream(p->socket, opt_.socket_buffer_bytes);
      link[static_cast<size_t>(a.stream)] = Stream{std::move(p->socket), a.keys};
      if (++in_count_[static_cast<size_t>(a.rank)] == a.link_streams) ++links_in_;
    }
  } catch (const HandshakeError& e) {
    failure = e.what();
  } catch (const IoError& e) {
    failure = e.what();
  } catch (const std::exception& e) {  // libcrypto missing, allocation failure
    failure = std::string("internal error: ") + e.what();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure.empty()) {
      if (p->evicted) {
        failure = "dropped to make room for new connections (" + std::to_string(max_pending()) +
                  " handshakes were pending; this one had not finished): " + failure;
      }
      reject("rejected connection from " + p->who + ": " + failure);
    }
  }
}

Stream Rendezvous::connect_stream(int peer, const Address& a, int stream, Link* link, double* rtt_s) {
  const std::string where = "rank " + std::to_string(peer) + " at " + a.host + ":" + std::to_string(a.port);
  std::string last;
  for (;;) {
    if (stop_) throw IoError(IoError::Reason::kStopped, "stopped");
    double connect_rtt = 0;
    Socket s = connect_to(a.host, a.port, deadline_, &connect_rtt);  // throws IoError at the deadline
    if (link->plan.streams == 0) {
      // The first stream's connect measured the round trip (SYN, SYN-ACK): its hello says
      // how many streams the link gets.
      if (opt_.handshake.streams > 0) {
        link->plan = LinkPlan{opt_.handshake.streams, 0, 0};
        link->start_streams = opt_.handshake.streams;
      } else {
        link->plan = plan_link(connect_rtt, std::max(opt_.pool_rate, opt_.link_rate), limits_);
        const LinkPlan start = plan_link(connect_rtt, opt_.link_rate, limits_);
        link->start_streams = start_streams_for(start.needed_inflight, link->plan.streams, limits_);
        // Each stream's buffer holds its share of the start's need (autotuning's when that
        // covers it): larger buffers would put several bandwidth-delay products in flight
        // and overflow the path's queues. A link shown to be held back grows its buffers
        // and then its streams (TcpTransport::learn).
        link->plan.sndbuf = sndbuf_for(start.needed_inflight / link->start_streams, limits_);
      }
    }
    try {
      // Short per attempt: a server that dropped us to make room is tried again.
      const Deadline d = deadline_.sooner(Deadline::after(handshake_limit_));
      double hs_rtt = 0;
      SessionKeys keys =
          handshake_client(s, opt_.handshake, opt_.rank, peer, stream, link->plan.streams, d, &hs_rtt);
      configure_stream(s, opt_.socket_buffer_bytes);
      *rtt_s = connect_rtt > 0 ? std::min(connect_rtt, hs_rtt) : hs_rtt;
      return Stream{std::move(s), keys};
    } catch (const HandshakeError& e) {
      if (!e.transient() || deadline_.expired()) throw;
      last = e.what();
    }
    if (stop_) throw IoError(IoError::Reason::kStopped, "stopped");
    std::this_thread::sleep_for(Millis(50));
    if (deadline_.expired()) {
      throw IoError(IoError::Reason::kTimeout, "no handshake with " + where + " succeeded; the last try: " + last);
    }
  }
}

Link Rendezvous::connect_link(int peer, const Address& a) {
  Link link;
  link.plan.streams = 0;  // chosen by the first stream's connect
  double rtt = -1;
  link.out.push_back(connect_stream(peer, a, 0, &link, &rtt));
  const int k = link.plan.streams;
  link.out.resize(static_cast<size_t>(k));
  std::vector<double> rtts(static_cast<size_t>(k), -1);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(k));
  {
    std::vector<std::thread> threads;
    for (int j = 1; j < k; ++j) {
      threads.emplace_back([&, j] {
        try {
          link.out[static_cast<size_t>(j)] = connect_stream(peer, a, j, &link, &rtts[static_cast<size_t>(j)]);
        } catch (...) {
          errors[static_cast<size_t>(j)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (double r : rtts) {
    if (r > 0) rtt = rtt > 0 ? std::min(rtt, r) : r;
  }
  link.rtt_s = rtt;
  for (Stream& s : link.out) set_send_buffer(s.socket, link.plan.sndbuf);
  return link;
}

std::vector<Link> Rendezvous::complete(const std::vector<Address>& addresses) {
  const int n = opt_.world_size;
  std::vector<Link> links(static_cast<size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  {
    std::vector<std::thread> threads;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == opt_.rank) continue;
      threads.emplace_back([&, peer] {
        try {
          links[static_cast<size_t>(peer)] = connect_link(peer, addresses[static_cast<size_t>(peer)]);
        } catch (...) {
          errors[static_cast<size_t>(peer)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int peer = 0; peer < n; ++peer) {
    if (!errors[static_cast<size_t>(peer)]) continue;
    const Address& a = addresses[static_cast<size_t>(peer)];
    const std::string where = "rank " + std::to_string(peer) + " at " + a.host + ":" + std::to_string(a.port);
    try {
      std::rethrow_exception(errors[static_cast<size_t>(peer)]);
    } catch (const HandshakeError& e) {
      stop();
      throw error(ErrorKind::kHandshake, peer, "handshake with " + where + " failed: " + e.what());
    } catch (const IoError& e) {
      stop();
      if (interrupted_) throw error(ErrorKind::kClosed, -1, "the ring was closed while it was forming");
      if (e.reason() == IoError::Reason::kTimeout) {
        throw error(ErrorKind::kTimeout, peer,
                    "timed out after " + std::to_string(opt_.timeout.count()) + " ms connecting to " + where + ": " +
                        e.what());
      }
      throw error(ErrorKind::kConnectionLost, peer, "could not connect to " + where + ": " + e.what());
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return all_in() || acceptor_done_; });
  }
  stop();  // the links are formed (or never will be): nothing listens any more
  if (interrupted_) throw error(ErrorKind::kClosed, -1, "the ring was closed while it was forming");
  std::lock_guard<std::mutex> lock(mu_);
  if (!all_in()) {
    int missing = -1;
    for (int peer = 0; peer < n && missing < 0; ++peer) {
      if (peer == opt_.rank) continue;
      const auto& l = in_[static_cast<size_t>(peer)];
      if (l.empty() || in_count_[static_cast<size_t>(peer)] < static_cast<int>(l.size())) missing = peer;
    }
    const auto& l = in_[static_cast<size_t>(missing)];
    std::string cause = "timed out after " + std::to_string(opt_.timeout.count()) + " ms waiting for rank " +
                        std::to_string(missing) + " to connect (" + std::to_string(in_count_[static_cast<size_t>(missing)]) +
                        " of " + (l.empty() ? std::string("its") : std::to_string(l.size())) + " streams arrived)";
    if (accept_error_ && accept_error_->find("deadline") == std::string::npos) cause += ": " + *accept_error_;
    const size_t n_rejected = rejected_.size() + rejected_unlisted_;
    if (n_rejected > 0) {
      cause += "; meanwhile " + std::to_string(n_rejected) + " connection(s) were rejected, the last listed: " +
               rejected_.back();
    }
    throw error(ErrorKind::kTimeout, missing, cause);
  }
  for (int peer = 0; peer < n; ++peer) links[static_cast<size_t>(peer)].in = std::move(in_[static_cast<size_t>(peer)]);
  return links;
}

}  // namespace prime::ring
