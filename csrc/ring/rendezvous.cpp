#include "rendezvous.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cxxabi.h>

#include <cerrno>
#include <system_error>

#include "tcp/connection.h"

namespace prime::ring {

Rendezvous::Rendezvous(RendezvousOptions options)
    : opt_(std::move(options)),
      deadline_(Deadline::after(opt_.timeout)),
      handshake_limit_(std::min(kHandshakeLimit, opt_.timeout)),
      left_((opt_.rank + opt_.world_size - 1) % opt_.world_size),
      right_((opt_.rank + 1) % opt_.world_size),
      listener_(opt_.bind_addr, 0),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!wake_.valid()) throw IoError(IoError::Reason::kOther, "eventfd failed: " + errno_text(errno));
  left_streams_.resize(opt_.streams);
  acceptor_ = std::thread(&Rendezvous::accept_loop, this);
}

Rendezvous::~Rendezvous() { stop(); }

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

void Rendezvous::accept_loop() {
  try {
    accept_until_done();
  } catch (const abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {  // allocation failure: stop accepting, say why
    std::lock_guard<std::mutex> lock(mu_);
    accept_error_ = std::string("internal error while accepting: ") + e.what();
  }
  // The left neighbour is in, or the deadline passed, or we stop: interrupt the rest.
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
      if (accepted_ == opt_.streams) break;
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
    if (pending_.size() >= kMaxPendingHandshakes) {
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
    Accepted a = handshake_server(p->socket, opt_.handshake, opt_.rank, left_, d);
    std::lock_guard<std::mutex> lock(mu_);
    if (left_streams_[a.stream].socket.valid()) {
      failure = "stream " + std::to_string(a.stream) + " of rank " + std::to_string(left_) + " is already connected";
    } else if (p->evicted || stop_) {
      failure = "dropped after its handshake: the ring stopped forming";
    } else {
      configure_stream(p->socket, opt_.socket_buffer_bytes);
      left_streams_[a.stream] = Stream{std::move(p->socket), a.keys};
      ++accepted_;
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
        failure = "dropped to make room for new connections (" + std::to_string(kMaxPendingHandshakes) +
                  " handshakes were pending; this one had not finished): " + failure;
      }
      reject("rejected connection from " + p->who + ": " + failure);
    }
  }
}

Stream Rendezvous::connect_right(const std::string& host, int port, int stream, const std::string& where) {
  std::string last;
  for (;;) {
    if (stop_) throw IoError(IoError::Reason::kStopped, "stopped");
    Socket s = connect_to(host, port, deadline_);  // throws IoError at the deadline
    try {
      // Short per attempt: a server that dropped us to make room is tried again.
      const Deadline d = deadline_.sooner(Deadline::after(handshake_limit_));
      SessionKeys keys = handshake_client(s, opt_.handshake, opt_.rank, right_, stream, d);
      configure_stream(s, opt_.socket_buffer_bytes);
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

Links Rendezvous::complete(const std::string& right_host, int right_port) {
  Links links;
  const std::string where = "rank " + std::to_string(right_) + " at " + right_host + ":" + std::to_string(right_port);
  for (int j = 0; j < opt_.streams; ++j) {
    try {
      links.right.push_back(connect_right(right_host, right_port, j, where));
    } catch (const HandshakeError& e) {
      stop();
      throw error(ErrorKind::kHandshake, right_, "handshake with " + where + " failed: " + e.what());
    } catch (const IoError& e) {
      stop();
      if (interrupted_) throw error(ErrorKind::kClosed, -1, "the ring was closed while it was forming");
      if (e.reason() == IoError::Reason::kTimeout) {
        throw error(ErrorKind::kTimeout, right_,
                    "timed out after " + std::to_string(opt_.timeout.count()) + " ms connecting to " + where + ": " +
                        e.what());
      }
      throw error(ErrorKind::kConnectionLost, right_, "could not connect to " + where + ": " + e.what());
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return accepted_ == opt_.streams || acceptor_done_; });
  }
  stop();  // the ring is formed (or never will be): nothing listens any more
  if (interrupted_) throw error(ErrorKind::kClosed, -1, "the ring was closed while it was forming");
  std::lock_guard<std::mutex> lock(mu_);
  if (accepted_ < opt_.streams) {
    std::string cause = "timed out after " + std::to_string(opt_.timeout.count()) + " ms waiting for rank " +
                        std::to_string(left_) + " to connect (" + std::to_string(accepted_) + " of " +
                        std::to_string(opt_.streams) + " streams arrived)";
    if (accept_error_ && accept_error_->find("deadline") == std::string::npos) cause += ": " + *accept_error_;
    const size_t n_rejected = rejected_.size() + rejected_unlisted_;
    if (n_rejected > 0) {
      cause += "; meanwhile " + std::to_string(n_rejected) + " connection(s) were rejected, the last listed: " +
               rejected_.back();
    }
    throw error(ErrorKind::kTimeout, left_, cause);
  }
  links.left = std::move(left_streams_);
  return links;
}

}  // namespace prime::ring
