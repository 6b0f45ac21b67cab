#include "rendezvous.h"

#include "tcp/connection.h"

namespace prime::ring {
namespace {

// A stranger gets this long to finish its handshake before we move on to the
// next connection (the real neighbour needs a few round trips).
constexpr Millis kHandshakeLimit{10000};

}  // namespace

Rendezvous::Rendezvous(RendezvousOptions options)
    : opt_(std::move(options)),
      deadline_(Deadline::after(opt_.timeout)),
      left_((opt_.rank + opt_.world_size - 1) % opt_.world_size),
      right_((opt_.rank + 1) % opt_.world_size),
      listener_(opt_.bind_addr, 0) {
  left_streams_.resize(opt_.streams);
  acceptor_ = std::thread(&Rendezvous::accept_loop, this);
}

Rendezvous::~Rendezvous() { stop(); }

void Rendezvous::stop() {
  stop_ = true;
  if (acceptor_.joinable()) acceptor_.join();
  listener_.close();
}

std::vector<std::string> Rendezvous::rejected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejected_;
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

void Rendezvous::accept_loop() {
  for (;;) {
    Socket s;
    try {
      s = listener_.accept(deadline_, &stop_);
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (e.reason() != IoError::Reason::kStopped) accept_error_ = e.what();
      return;
    }
    const std::string who = s.peer_address();
    try {
      const Deadline d = deadline_.sooner(Deadline::after(kHandshakeLimit));
      const int stream = handshake_server(s, opt_.handshake, opt_.rank, left_, d);
      std::lock_guard<std::mutex> lock(mu_);
      if (left_streams_[stream].valid()) {
        rejected_.push_back("rejected connection from " + who + ": stream " + std::to_string(stream) +
                            " of rank " + std::to_string(left_) + " is already connected");
        continue;
      }
      configure_stream(s, opt_.socket_buffer_bytes);
      left_streams_[stream] = std::move(s);
      if (++accepted_ == opt_.streams) return;
    } catch (const HandshakeError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      rejected_.push_back("rejected connection from " + who + ": " + e.what());
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      rejected_.push_back("rejected connection from " + who + ": " + e.what());
    }
  }
}

Links Rendezvous::complete(const std::string& right_host, int right_port) {
  Links links;
  const std::string where = "rank " + std::to_string(right_) + " at " + right_host + ":" + std::to_string(right_port);
  for (int j = 0; j < opt_.streams; ++j) {
    Socket s;
    try {
      s = connect_to(right_host, right_port, deadline_);
      handshake_client(s, opt_.handshake, opt_.rank, right_, j, deadline_);
      configure_stream(s, opt_.socket_buffer_bytes);
    } catch (const HandshakeError& e) {
      stop();
      throw error(ErrorKind::kHandshake, right_, "handshake with " + where + " failed: " + e.what());
    } catch (const IoError& e) {
      stop();
      if (e.reason() == IoError::Reason::kTimeout) {
        throw error(ErrorKind::kTimeout, right_,
                    "timed out after " + std::to_string(opt_.timeout.count()) + " ms connecting to " + where + ": " +
                        e.what());
      }
      throw error(ErrorKind::kConnectionLost, right_, "could not connect to " + where + ": " + e.what());
    }
    links.right.push_back(std::move(s));
  }
  if (acceptor_.joinable()) acceptor_.join();
  listener_.close();  // the ring is formed: nothing listens any more
  std::lock_guard<std::mutex> lock(mu_);
  if (accepted_ < opt_.streams) {
    std::string cause = "timed out after " + std::to_string(opt_.timeout.count()) + " ms waiting for rank " +
                        std::to_string(left_) + " to connect (" + std::to_string(accepted_) + " of " +
                        std::to_string(opt_.streams) + " streams arrived)";
    if (accept_error_ && accept_error_->find("deadline") == std::string::npos) cause += ": " + *accept_error_;
    if (!rejected_.empty()) cause += "; meanwhile " + std::to_string(rejected_.size()) + " connection(s) were rejected, the last: " + rejected_.back();
    throw error(ErrorKind::kTimeout, left_, cause);
  }
  links.left = std::move(left_streams_);
  return links;
}

}  // namespace prime::ring
