#include "tcp_transport.h"

#include <cxxabi.h>
#include <poll.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tcp/connection.h"
#include "str_builder.h"

namespace prime::ring {
namespace {

// Rate-limited writes go in pieces of this size so streams interleave smoothly.
constexpr size_t kLimitedPiece = 64 << 10;
// Frames below this size are copied next to their header and sent in one call.
constexpr size_t kCoalesceBytes = 64 << 10;
// Payloads are sealed piece by piece just before each piece is sent, and opened piece
// by piece as each arrives: the MAC runs on bytes still in cache and overlaps the wire,
// so a frame is ready one piece's MAC after its last byte (not a whole payload's).
// 256 KiB: four pieces per fp32 segment; a CPU-time sweep of 64 KiB-4 MiB on the loaded dev
// machine could not separate 64 from 256 KiB (benchmarks/RESULTS.md, cost of authenticated frames).
constexpr size_t kSealPiece = 256 << 10;
// How long shutdown() tries to deliver its abort/close frame per socket.
constexpr Millis kControlDeadline{1000};
// Frames received ahead of the consumer, per stream. A correct peer never gets
// near this (it is at most about a collective ahead); it bounds the memory a
// misbehaving one can make us hold. Reading stops (TCP pushes back) until the
// consumer catches up, so this cannot deadlock: the queue holds the next frames
// the consumer needs.
constexpr size_t kMaxQueuedBytes = size_t{512} << 20;
// How long a bare EOF waits for a peer's abort frame (which names the root cause) to
// arrive on another path before it is reported as the failure itself.
constexpr Millis kRootCauseGrace{250};
// learn() reads a link's TCP counters once it carried this much since the last time: a
// rate measured over less is mostly slow start and round trips.
constexpr uint64_t kLearnMinBytes = 4 << 20;
// A link whose streams waited on the receiver's window for more than this share of their
// busy time, or kept more than kHeldBackShare of what their send buffers allow in flight,
// was held back by them: its buffers grow, then it uses more streams.
constexpr double kLimitedShare = 0.1;
constexpr double kHeldBackShare = 0.75;
// sample_rate() reads the streams' delivery rates at most every half round trip, and at
// most this often (ns).
constexpr int64_t kRateSampleMin = 20'000'000;
// How long a paced link's writer sleeps, at least and at most, while its streams hold
// their share in flight (wait_inflight()).
constexpr int64_t kInflightPollMinUs = 200;
constexpr int64_t kInflightPollMaxUs = 5000;
// begin_collective() expects a collective to take at most this multiple of the last one's
// time (begin_collective() to learn()).
constexpr double kCollectiveSpan = 1.5;

std::string frame_name(const FrameHeader& h) {
  StrBuilder s;
  s << phase_name(h.phase) << " step " << h.step << ", segment " << h.segment << " of all_reduce #" << h.seq;
  return s.str();
}

std::string io_cause(const IoError& e) {
  switch (e.reason()) {
    case IoError::Reason::kEof: return "connection closed unexpectedly (EOF; did the process die?)";
    case IoError::Reason::kReset: return std::string("connection reset (") + e.what() + "; did the process die?)";
    default: return e.what();
  }
}

}  // namespace

TcpTransport::TcpTransport(TransportOptions options, std::vector<Link> links, std::shared_ptr<BufferPool> pool,
                           std::function<void()> on_failure)
    : opt_(std::move(options)),
      pool_(std::move(pool)),
      on_failure_(std::move(on_failure)),
      limits_(SocketLimits::of_host()),
      limiter_(opt_.max_rate, std::max<double>(kLimitedPiece, opt_.max_rate * 0.01)) {
  send_progress_ns_ = now_ns();
  out_.resize(links.size());
  in_.resize(links.size());
  for (size_t peer = 0; peer < links.size(); ++peer) {
    Link& l = links[peer];
    const int p = static_cast<int>(peer);
    if (!l.out.empty()) {
      out_[peer] = std::make_unique<OutLink>();
      OutLink& o = *out_[peer];
      for (size_t j = 0; j < l.out.size(); ++j) {
        send_.push_back(std::make_unique<SendStream>(p, static_cast<int>(j), std::move(l.out[j].socket),
                                                     l.out[j].keys, opt_.encrypt));
        send_.back()->bbr = runs_bbr(send_.back()->socket);
        o.streams.push_back(send_.back().get());
      }
      o.report.peer = p;
      o.report.streams = static_cast<int>(l.out.size());
      o.wanted = o.report.wanted = std::clamp(l.start_streams, 1, static_cast<int>(l.out.size()));
      o.active = o.span = static_cast<size_t>(o.wanted);
      o.report.handshake_rtt_s = l.rtt_s;
      o.rtt_s = l.rtt_s;
      o.report.needed_inflight = l.plan.needed_inflight;
      TcpStats st;
      if (read_tcp_stats(o.streams[0]->socket, &st)) o.report.sndbuf = st.sndbuf;
    }
    if (!l.in.empty()) {
      in_[peer] = std::make_unique<InLink>();
      for (size_t j = 0; j < l.in.size(); ++j) {
        recv_.push_back(std::make_unique<RecvStream>(p, static_cast<int>(j), std::move(l.in[j].socket), l.in[j].keys,
                                                     opt_.encrypt));
        recv_.back()->progress_ns = now_ns();
        in_[peer]->streams.push_back(recv_.back().get());
      }
    }
  }
  try {
    for (size_t j = 0; j < send_.size(); ++j) {
      send_[j]->thread = std::thread(&TcpTransport::guarded, this, &TcpTransport::sender_loop, static_cast<int>(j));
    }
    for (size_t j = 0; j < recv_.size(); ++j) {
      recv_[j]->thread = std::thread(&TcpTransport::guarded, this, &TcpTransport::receiver_loop, static_cast<int>(j));
    }
    watcher_ = std::thread(&TcpTransport::guarded, this, &TcpTransport::watcher_loop, 0);
  } catch (...) {
    // Out of threads: the members must not be destroyed with running threads (that is
    // std::terminate), so stop and join those that started before rethrowing.
    stop_and_join();
    throw;
  }
}

TcpTransport::~TcpTransport() {
  try {
    shutdown(FrameKind::kClose, opt_.rank, "rank " + std::to_string(opt_.rank) + " closed the ring");
  } catch (...) {  // allocating the message failed: still stop every thread
  }
  stop_and_join();  // nothing left to join after shutdown()
}

void TcpTransport::stop_and_join() noexcept {
  stop_ = true;
  send_cv_.notify_all();
  sent_cv_.notify_all();
  recv_cv_.notify_all();
  for (auto& s : send_) {
    if (s->thread.joinable()) s->thread.join();
  }
  for (auto& s : recv_) {
    s->socket.shutdown_both();
    if (s->thread.joinable()) s->thread.join();
  }
  if (watcher_.joinable()) watcher_.join();
}

void TcpTransport::guarded(void (TcpTransport::*loop)(int), int j) {
  try {
    (this->*loop)(j);
  } catch (const abi::__forced_unwind&) {
    throw;  // thread cancellation must unwind on
  } catch (const std::exception& e) {
    // Each loop handles the errors it expects; this is an allocation failure or a bug.
    // Recorded as the ring's failure rather than escaping the thread (std::terminate).
    try {
      record({ErrorKind::kInternal, -1, std::string("internal error on an I/O thread: ") + e.what()});
    } catch (...) {
    }
  } catch (...) {
    try {
      record({ErrorKind::kInternal, -1, "internal error on an I/O thread"});
    } catch (...) {
    }
  }
}

void TcpTransport::record(Failure f) {
  if (stop_) return;  // our own shutdown makes sockets fail: not news
  {
    std::lock_guard<std::mutex> lock(fail_mu_);
    if (failure_) return;
    failure_ = std::move(f);
    failed_ = true;
  }
  { std::lock_guard<std::mutex> lock(send_mu_); }
  send_cv_.notify_all();
  sent_cv_.notify_all();
  { std::lock_guard<std::mutex> lock(recv_mu_); }
  recv_cv_.notify_all();
  if (on_failure_) on_failure_();
}

void TcpTransport::record_lost(Failure f) {
  const auto until = Clock::now() + kRootCauseGrace;
  while (!failed_ && !stop_ && Clock::now() < until) std::this_thread::sleep_for(Millis(5));
  record(std::move(f));
}

ErrorInfo TcpTransport::error_from(const Failure& f, const Context& where) const {
  ErrorInfo e;
  e.kind = f.kind;
  e.rank = opt_.rank;
  e.peer = f.peer;
  e.origin = f.kind == ErrorKind::kPeerFailed ? f.origin : opt_.rank;
  e.where = where;
  e.cause = f.cause;
  e.origin_message = f.origin_message;
  return e;
}

ErrorInfo TcpTransport::local_error(ErrorKind kind, int peer, std::string cause, const Context& where) const {
  return error_from(Failure{kind, peer, std::move(cause)}, where);
}

std::optional<ErrorInfo> TcpTransport::failure(const Context& where) const {
  std::lock_guard<std::mutex> lock(fail_mu_);
  if (!failure_) return std::nullopt;
  return error_from(*failure_, where);
}

// ---------------------------------------------------------------------------
// sending

void TcpTransport::begin_collective(int concurrent) {
  std::lock_guard<std::mutex> lock(send_mu_);
  const int64_t now = now_ns();
  if (opt_.restart_bbr) restart_bbr_where_due(now);
  collective_start_ns_ = now;
  for (auto& o : out_) {
    if (!o) continue;
    const int share = opt_.tune ? (o->wanted + std::max(1, concurrent) - 1) / std::max(1, concurrent) : o->wanted;
    const size_t span = static_cast<size_t>(std::clamp(o->wanted, 1, static_cast<int>(o->streams.size())));
    const size_t active = std::min(span, static_cast<size_t>(std::max(share, 1)));
    // A collective that uses fewer streams than the link wants takes the ones after those
    // the last one used, so every stream the link wants carries data in turn and none is
    // cold (in slow start, a small window) when a collective needs them all.
    o->first = active < span ? (o->first + o->active) % span : 0;
    o->active = active;
    o->span = span;
    o->concurrent = std::max(1, concurrent);
    o->rate_ns = 0;
    o->peak_rate = 0;
    o->peak_srtt = 0;
    pace(*o);
  }
}

void TcpTransport::restart_bbr_where_due(int64_t now) {
  const int64_t last_start = collective_start_ns_, last_end = collective_end_ns_;
  // A restart must keep the window open to the collective's end: one expected to last
  // kBbrMinRttWindowNs or more cannot avoid ProbeRTT, and restarts nothing.
  const int64_t expected = last_end > last_start ? static_cast<int64_t>(kCollectiveSpan * (last_end - last_start)) : 0;
  if (expected >= kBbrMinRttWindowNs) return;
  // After a rest of a whole window every stream's window ran out while it was idle: the
  // first acknowledgement of its restart from idle starts a new one, without ProbeRTT.
  const bool rested = last_end > 0 && now - last_end >= kBbrMinRttWindowNs;
  for (auto& o : out_) {
    if (!o) continue;
    for (SendStream* s : o->streams) {
      if (!s->bbr) continue;
      // A window starts when BBR starts, and again at a lower round trip or at the end of
      // a ProbeRTT: never before the epoch kept here.
      if (rested) s->bbr_epoch_ns = now;
      if (s->bbr_epoch_ns > 0 && s->bbr_epoch_ns + kBbrMinRttWindowNs > now + expected) continue;
      // Those due restart together: BBR learns the path's rate again after a restart, and
      // a link's streams restarted a few at a time, ahead of time, ran slower than all of
      // them at once every ~8 s (benchmarks/RESULTS.md).
      if (!restart_bbr(s->socket)) {
        s->bbr = false;  // the host refused: leave the stream as it is
        continue;
      }
      s->bbr_epoch_ns = now;
      std::lock_guard<std::mutex> lock(report_mu_);
      ++o->report.bbr_restarts;
    }
  }
}

void TcpTransport::sample_rate(OutLink& link) {
  const int64_t now = now_ns();
  const int64_t every = std::max<int64_t>(kRateSampleMin, static_cast<int64_t>(link.rtt_s * 1e9 / 2));
  if (now - link.rate_ns < every) return;
  link.rate_ns = now;
  double rate = 0, srtt = -1;
  for (SendStream* s : link.streams) {
    if (s->bbr) {
      const bool probing = in_probe_rtt(s->socket);  // s->bbr: read once, at the start
      if (probing && !s->in_probe_rtt) ++link.probe_rtts;
      s->in_probe_rtt = probing;
    }
    TcpStats st;
    if (!opt_.tune || !read_tcp_stats(s->socket, &st)) continue;
    rate += st.delivery_rate;
    if (st.in_flight > 0) srtt = srtt < 0 ? st.rtt_s : std::min(srtt, st.rtt_s);
  }
  link.peak_rate = std::max(link.peak_rate, rate);
  link.peak_srtt = std::max(link.peak_srtt, srtt);
}

void TcpTransport::pace(OutLink& link) {
  std::lock_guard<std::mutex> lock(report_mu_);
  LinkReport& r = link.report;
  if (!opt_.tune || !r.paced || r.uplink_rate <= 0) return;
  const double rate = kPacingHeadroom * r.uplink_rate / link.concurrent;  // the link's share of the uplink
  if (r.pacing_rate > 0 && std::abs(rate - r.pacing_rate) < 0.05 * r.pacing_rate) return;
  link.pacer.set_rate(rate);
  r.pacing_rate = rate;
  const double rtt = r.rtt_s > 0 ? r.rtt_s : r.handshake_rtt_s;
  r.inflight_cap = kPacedInflight * r.uplink_rate / link.concurrent * rtt;
  link.inflight_cap = r.inflight_cap;
}

TcpTransport::SendStream& TcpTransport::pick_stream(OutLink& link) {
  const size_t n = std::min(link.span, link.streams.size());
  const size_t k = std::min(link.active, n);
  if (k == 1) return *link.streams[link.first % n];
  // The stream with the least still to deliver: its queue and what its socket holds
  // unacknowledged (SIOCOUTQ). A stream that TCP slows down drains later and so takes
  // fewer frames. Not weighted by the rate each stream paces at: the streams share one
  // path, and BBR's pacing rates are estimates that restarts, startup and idle periods
  // leave far apart (a stream the direct schedule left idle, or one just restarted, paces
  // slowly until it gets frames; weighted, it got few, and a ring collective after direct
  // ones ran 20% slower at RTT 200 ms; benchmarks/RESULTS.md). Ties go round.
  size_t best = link.next_pick % k;
  int64_t least = -1;
  for (size_t i = 0; i < k; ++i) {
    const size_t j = (link.next_pick + i) % k;
    const SendStream& s = *link.streams[(link.first + j) % n];
    const int64_t backlog = static_cast<int64_t>(s.queued_bytes) + unacked_bytes(s.socket);
    if (least < 0 || backlog < least) {
      least = backlog;
      best = j;
    }
  }
  link.next_pick = best + 1;
  return *link.streams[(link.first + best) % n];
}

void TcpTransport::send(int peer, OutFrame frame) {
  std::lock_guard<std::mutex> lock(send_mu_);
  OutLink& link = *out_.at(static_cast<size_t>(peer));
  frame.header.link_frame = link.next_frame++;
  sample_rate(link);
  SendStream& s = pick_stream(link);
  s.queued_bytes += frame.size;
  s.queue.push_back(std::move(frame));
  send_cv_.notify_all();
}

void TcpTransport::wait_inflight(OutLink& link, size_t len) {
  const double cap = link.inflight_cap.load();
  if (cap <= 0) return;
  const double rate = std::max(1.0, link.pacer.rate());
  const auto until = Clock::now() + opt_.timeout;  // past it the write itself times out
  for (;;) {
    double held = 0;
    for (SendStream* t : link.streams) held += static_cast<double>(unacked_bytes(t->socket));
    const double excess = held + static_cast<double>(len) - cap;
    if (held == 0 || excess <= 0 || Clock::now() > until) return;
    if (stop_) throw IoError(IoError::Reason::kStopped, "stopped");
    // about as long as the path takes to carry the excess away
    std::this_thread::sleep_for(std::chrono::microseconds(std::clamp<int64_t>(static_cast<int64_t>(excess / rate * 1e6),
                                                                              kInflightPollMinUs, kInflightPollMaxUs)));
  }
}

void TcpTransport::write_frame(SendStream& s, OutFrame& f) {
  f.header.payload_len = static_cast<uint32_t>(f.size);
  IoLimits limits;
  limits.idle = opt_.timeout;
  limits.stop = &stop_;
  limits.progress_ns = &send_progress_ns_;

  RateLimiter& pacer = out_[static_cast<size_t>(s.peer)]->pacer;
  const bool coalesce = !limiter_.limited() && f.size <= kCoalesceBytes && opt_.corrupt_after_bytes < 0;
  if (!coalesce && !limiter_.acquire(kHeaderBytes, &stop_)) throw IoError(IoError::Reason::kStopped, "stopped");
  // Nothing may throw between begin() and mid_frame: a begun frame is either sent
  // or ends the stream, so no later frame can reuse or skip its number.
  if (coalesce) {
    if (!pacer.acquire(kFrameOverhead + f.size, &stop_)) throw IoError(IoError::Reason::kStopped, "stopped");
    wait_inflight(*out_[static_cast<size_t>(s.peer)], kFrameOverhead + f.size);
    char joined[kFrameOverhead + kCoalesceBytes];
    auto* bytes = reinterpret_cast<uint8_t*>(joined);
    const int64_t a0 = now_ns();
    s.sealer.begin(f.header, bytes);
    s.mid_frame = true;
    const char* sealed = s.sealer.payload(f.data, joined + kHeaderBytes, f.size);
    if (sealed != joined + kHeaderBytes && f.size) std::memcpy(joined + kHeaderBytes, sealed, f.size);
    s.sealer.tag(bytes + kHeaderBytes + f.size);
    f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
    send_all(s.socket, joined, kFrameOverhead + f.size, limits);
    s.mid_frame = false;
    return;
  }
  // Unlimited, the header, the pieces and the tag go out as one stream of full segments
  // (MSG_MORE; the tag's send pushes): no small packets, no receiver woken for 64 or 16
  // bytes. Rate-limited, every piece leaves at once (it may wait for the limiter).
  const bool more = !limiter_.limited();
  uint8_t header[kHeaderBytes];
  int64_t a0 = now_ns();
  s.sealer.begin(f.header, header);
  s.mid_frame = true;
  f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
  send_all(s.socket, header, kHeaderBytes, limits, more);
  const size_t piece = limiter_.limited() ? kLimitedPiece : kSealPiece;
  if (s.sealer.encrypts() && s.scratch.size() < std::min(piece, f.size)) s.scratch = ByteBuffer(piece);
  for (size_t off = 0; off < f.size; off += piece) {
    const size_t len = std::min(piece, f.size - off);
    if (!limiter_.acquire(len, &stop_) || !pacer.acquire(len, &stop_)) {
      throw IoError(IoError::Reason::kStopped, "stopped");
    }
    wait_inflight(*out_[static_cast<size_t>(s.peer)], len);
    // The piece is sealed (tag updated, or encrypted) just before it leaves.
    a0 = now_ns();
    const char* sealed = s.sealer.payload(f.data + off, s.scratch.data(), len);
    f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
    const int64_t base = payload_bytes_sent_.fetch_add(static_cast<int64_t>(len));
    const int64_t target = opt_.corrupt_after_bytes;
    if (target >= base && target < base + static_cast<int64_t>(len)) {
      // Test hook: the bytes leave with one bit flipped, after they were sealed.
      ByteBuffer copy(len);
      std::memcpy(copy.data(), sealed, len);
      copy.data()[target - base] ^= 0x10;
      send_all(s.socket, copy.data(), len, limits, more);
    } else {
      send_all(s.socket, sealed, len, limits, more);
    }
  }
  uint8_t tag[kTagBytes];
  a0 = now_ns();
  s.sealer.tag(tag);
  f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
  send_all(s.socket, tag, kTagBytes, limits);
  s.mid_frame = false;
}

void TcpTransport::sender_loop(int j) {
  SendStream& s = *send_[static_cast<size_t>(j)];
  OutLink& link = *out_[static_cast<size_t>(s.peer)];
  const std::string to = "rank " + std::to_string(s.peer);
  for (;;) {
    OutFrame f;
    {
      std::unique_lock<std::mutex> lock(send_mu_);
      send_cv_.wait(lock, [&] { return stop_.load() || failed_.load() || !s.queue.empty(); });
      if (stop_.load() || failed_.load()) return;
      f = std::move(s.queue.front());
      s.queue.pop_front();
      s.busy = true;
    }
    try {
      write_frame(s, f);
    } catch (const IoError& e) {
      if (e.reason() == IoError::Reason::kStopped) return;
      Failure fail{ErrorKind::kConnectionLost, s.peer, ""};
      if (link.closed) {
        fail.kind = ErrorKind::kClosed;
        fail.cause = to + " closed the ring (it called close()) while this rank sent " + frame_name(f.header) + " to it";
      } else if (e.reason() == IoError::Reason::kTimeout) {
        fail.kind = ErrorKind::kTimeout;
        fail.cause = "timed out after " + std::to_string(opt_.timeout.count()) + " ms sending to " + to +
                     " (it stopped reading; while sending " + frame_name(f.header) + ")";
      } else {
        fail.cause = "send to " + to + " failed: " + io_cause(e) + " (while sending " + frame_name(f.header) + ")";
        // A peer that failed on its own wrote why on this socket's return path before
        // closing it: let the watcher read that first.
        record_lost(std::move(fail));
        return;
      }
      record(std::move(fail));
      return;
    } catch (const std::exception& e) {  // libcrypto failed
      record({ErrorKind::kInternal, s.peer, std::string("sealing a frame failed: ") + e.what()});
      return;
    }
    link.bytes += kFrameOverhead + f.size;
    s.bytes += kFrameOverhead + f.size;
    if (f.counters) {
      f.counters->bytes_sent += kFrameOverhead + f.size;
      f.counters->frames_sent += 1;
      f.counters->auth_ns += f.auth_ns;
    }
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      s.busy = false;
      s.queued_bytes -= f.size;
    }
    sent_cv_.notify_all();
  }
}

void TcpTransport::flush(const Context& where) {
  std::unique_lock<std::mutex> lock(send_mu_);
  // The senders enforce the timeout on every write; this guard only catches a sender
  // that somehow stopped without recording why.
  const auto guard = opt_.timeout + Millis(5000);
  for (;;) {
    int waiting_for = -1;  // a peer whose frames are not out yet
    for (auto& s : send_) {
      if (!s->queue.empty() || s->busy) waiting_for = s->peer;
    }
    if (waiting_for < 0) return;
    if (auto e = failure(where)) throw CommError(*e);
    if (stop_) throw CommError(local_error(ErrorKind::kClosed, -1, "the ring was closed", where));
    const int64_t last = send_progress_ns_.load();
    if (now_ns() - last > std::chrono::duration_cast<std::chrono::nanoseconds>(guard).count()) {
      throw CommError(local_error(ErrorKind::kTimeout, waiting_for,
                                  "timed out after " + std::to_string(guard.count()) + " ms flushing frames to rank " +
                                      std::to_string(waiting_for),
                                  where));
    }
    sent_cv_.wait_for(lock, Millis(kPollSliceMs));
  }
}

// ---------------------------------------------------------------------------
// receiving

namespace {

// What is wrong with a received frame (read_frame).
struct FrameError {
  ErrorKind kind;
  std::string what;
};

}  // namespace

// Reads one frame (header, payload, tag) and opens it: on return it is authentic and
// comes from `expected_rank` of this job. Throws IoError from the socket, or
// FrameError saying what is wrong with the frame.
InFrame TcpTransport::read_frame(const Socket& socket, FrameOpener& opener, const IoLimits& limits,
                                 uint32_t max_data_payload, int expected_rank) {
  uint8_t raw[kHeaderBytes];
  InFrame f;
  recv_all(socket, raw, kHeaderBytes, limits);
  int64_t a0 = now_ns();
  const std::string bad = opener.begin(raw, &f.header, max_data_payload);
  f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
  if (!bad.empty()) throw FrameError{ErrorKind::kCorruptFrame, bad};
  const FrameHeader& h = f.header;
  f.payload = pool_->acquire(h.payload_len);
  char* data = f.payload->data();
  for (size_t off = 0; off < h.payload_len; off += kSealPiece) {
    const size_t len = std::min<size_t>(kSealPiece, h.payload_len - off);
    recv_all(socket, data + off, len, limits);
    a0 = now_ns();
    opener.payload(data + off, len);  // while the piece is in cache and the next one on its way
    f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
  }
  uint8_t tag[kTagBytes];
  recv_all(socket, tag, kTagBytes, limits);
  a0 = now_ns();
  const std::string forged = opener.finish(h, tag);
  f.auth_ns += static_cast<uint64_t>(now_ns() - a0);
  if (!forged.empty()) throw FrameError{ErrorKind::kCorruptFrame, forged + "; the frame claims to be " + frame_name(h)};
  const std::string stray = check_link(h, expected_rank, opt_.job, opt_.encrypt);
  if (!stray.empty()) throw FrameError{ErrorKind::kProtocol, stray};
  return f;
}

void TcpTransport::receiver_loop(int j) {
  RecvStream& s = *recv_[static_cast<size_t>(j)];
  InLink& link = *in_[static_cast<size_t>(s.peer)];
  const std::string from = "rank " + std::to_string(s.peer);
  IoLimits limits;
  limits.stop = &stop_;
  limits.progress_ns = &s.progress_ns;
  for (;;) {
    InFrame f;
    try {
      if (!wait_readable(s.socket, limits)) return;  // stopped
      f = read_frame(s.socket, s.opener, limits, opt_.max_payload, s.peer);
    } catch (const IoError& e) {
      if (e.reason() == IoError::Reason::kStopped) return;
      if (link.closed && e.reason() == IoError::Reason::kEof) {
        {
          std::lock_guard<std::mutex> lock(recv_mu_);
          s.ended = true;
        }
        recv_cv_.notify_all();
        return;
      }
      record_lost({ErrorKind::kConnectionLost, s.peer, "connection from " + from + " lost: " + io_cause(e)});
      return;
    } catch (const FrameError& e) {
      record({e.kind, s.peer, (e.kind == ErrorKind::kCorruptFrame ? "corrupt frame from " : "unexpected frame from ") +
                                  from + " on stream " + std::to_string(s.index) + ": " + e.what});
      return;
    } catch (const std::exception& e) {  // libcrypto failed, allocation failure
      record({ErrorKind::kInternal, s.peer, "receiving from " + from + " failed: " + e.what()});
      return;
    }
    const FrameHeader& h = f.header;
    if (h.kind == FrameKind::kData) {
      {
        std::unique_lock<std::mutex> lock(recv_mu_);
        while (s.queued_bytes > 0 && s.queued_bytes + h.payload_len > kMaxQueuedBytes && !stop_) {
          recv_cv_.wait_for(lock, Millis(kPollSliceMs));
        }
        s.queued_bytes += h.payload_len;
        s.queue.push_back(std::move(f));
      }
      recv_cv_.notify_all();
      continue;
    }
    int origin = -1;
    std::string message;
    if (!decode_control(f.payload->data(), h.payload_len, &origin, &message)) {
      record({ErrorKind::kProtocol, s.peer, "malformed control frame from " + from});
      return;
    }
    if (h.kind == FrameKind::kAbort) {
      record({ErrorKind::kPeerFailed, s.peer, message, origin, message});
      return;
    }
    link.closed = true;  // kClose: frames already queued stay valid; EOF follows
  }
}

bool TcpTransport::frame_ready(int peer) {
  std::lock_guard<std::mutex> lock(recv_mu_);
  const InLink& link = *in_.at(static_cast<size_t>(peer));
  for (const RecvStream* s : link.streams) {
    if (!s->queue.empty() && s->queue.front().header.link_frame == link.next_frame) return true;
  }
  return false;
}

InFrame TcpTransport::recv(int peer, const Context& where, WireCounters& counters) {
  std::unique_lock<std::mutex> lock(recv_mu_);
  InLink& link = *in_.at(static_cast<size_t>(peer));
  const std::string from = "rank " + std::to_string(peer);
  const int64_t start = now_ns();
  const int64_t timeout_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(opt_.timeout).count();
  for (;;) {
    // Frames that arrived whole are used even after a failure was recorded: they
    // may be all this collective still needs (a peer that closed after its last
    // collective, for instance).
    bool all_ended = true, all_waiting = true;
    int64_t last = start;
    for (RecvStream* s : link.streams) {
      all_ended &= s->ended && s->queue.empty();
      all_waiting &= !s->queue.empty();
      last = std::max(last, s->progress_ns.load());
      if (s->queue.empty() || s->queue.front().header.link_frame != link.next_frame) continue;
      InFrame f = std::move(s->queue.front());
      s->queue.pop_front();
      s->queued_bytes -= f.header.payload_len;
      ++link.next_frame;
      recv_cv_.notify_all();  // a receiver may wait for room
      counters.bytes_received += kFrameOverhead + f.header.payload_len;
      counters.frames_received += 1;
      counters.auth_ns += f.auth_ns;
      return f;
    }
    if (all_waiting) {
      // Every stream holds a frame and none is the next: the peer numbered them wrong.
      throw CommError(local_error(ErrorKind::kProtocol, peer,
                                  "frames from " + from + " out of order: frame #" + std::to_string(link.next_frame) +
                                      " of the link is on none of its streams",
                                  where));
    }
    if (auto e = failure(where)) throw CommError(*e);
    if (stop_) throw CommError(local_error(ErrorKind::kClosed, -1, "the ring was closed", where));
    if (all_ended) {
      throw CommError(local_error(ErrorKind::kClosed, peer,
                                  from + " closed the ring (it called close()) while this rank waits for recv from it; "
                                         "did every rank call all_reduce the same number of times?",
                                  where));
    }
    const int64_t left_ns = last + timeout_ns - now_ns();
    if (left_ns <= 0) {
      throw CommError(local_error(ErrorKind::kTimeout, peer,
                                  "timed out after " + std::to_string(opt_.timeout.count()) +
                                      " ms waiting for recv from " + from,
                                  where));
    }
    recv_cv_.wait_for(lock, std::min<std::chrono::nanoseconds>(std::chrono::nanoseconds(left_ns), Millis(kPollSliceMs)));
  }
}

// ---------------------------------------------------------------------------
// the peers' reports, what the links learned, and shutting down

void TcpTransport::watcher_loop(int) {
  std::vector<bool> open(send_.size(), true);
  while (!stop_) {
    std::vector<pollfd> fds;
    std::vector<size_t> index;
    for (size_t j = 0; j < send_.size(); ++j) {
      if (open[j]) {
        fds.push_back({send_[j]->socket.fd(), POLLIN, 0});
        index.push_back(j);
      }
    }
    if (fds.empty()) return;
    const int rc = ::poll(fds.data(), fds.size(), kPollSliceMs);
    if (rc <= 0 || stop_) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      const size_t j = index[i];
      SendStream& s = *send_[j];
      OutLink& link = *out_[static_cast<size_t>(s.peer)];
      const std::string from = "rank " + std::to_string(s.peer);
      open[j] = false;  // one report per stream is all a peer sends
      IoLimits limits;
      limits.deadline = Deadline::after(kControlDeadline);
      limits.stop = &stop_;
      try {
        const InFrame f = read_frame(s.socket, s.reports, limits, 0, s.peer);
        const FrameHeader& h = f.header;
        int origin = -1;
        std::string message;
        if (h.kind == FrameKind::kData || !decode_control(f.payload->data(), h.payload_len, &origin, &message)) {
          record({ErrorKind::kProtocol, s.peer, "unexpected bytes from " + from + " on the return path"});
          return;
        }
        if (h.kind == FrameKind::kAbort) {
          record({ErrorKind::kPeerFailed, s.peer, message, origin, message});
          return;
        }
        link.closed = true;  // a clean close: only later sends to it are errors
      } catch (const IoError& e) {
        if (e.reason() == IoError::Reason::kStopped) return;
        if (link.closed) continue;
        record_lost({ErrorKind::kConnectionLost, s.peer, "connection to " + from + " lost: " + io_cause(e)});
        return;
      } catch (const FrameError& e) {
        record({e.kind, s.peer, "bad report from " + from + " on the return path: " + e.what});
        return;
      } catch (const std::exception& e) {
        record({ErrorKind::kInternal, s.peer, "reading the return path from " + from + " failed: " + e.what()});
        return;
      }
    }
  }
}

void TcpTransport::learn() {
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    collective_end_ns_ = now_ns();
  }
  for (auto& o : out_) {
    if (!o) continue;
    OutLink& link = *o;
    const uint64_t bytes = link.bytes.load();
    if (bytes - link.bytes_at_learn < kLearnMinBytes) continue;
    link.bytes_at_learn = bytes;
    double acked = 0, busy = 0, rwnd_limited = 0, min_rtt = -1;
    uint64_t retransmits = 0;
    int sndbuf = 0;
    for (SendStream* s : link.streams) {
      TcpStats now;
      if (!read_tcp_stats(s->socket, &now)) continue;
      const TcpStats& before = s->seen;
      acked += static_cast<double>(now.bytes_acked - before.bytes_acked);
      retransmits += now.retransmits - before.retransmits;
      busy = std::max(busy, now.busy_s - before.busy_s);  // the streams overlap: the link was busy this long
      rwnd_limited = std::max(rwnd_limited, now.rwnd_limited_s - before.rwnd_limited_s);
      if (now.min_rtt_s > 0) min_rtt = min_rtt < 0 ? now.min_rtt_s : std::min(min_rtt, now.min_rtt_s);
      sndbuf = std::max(sndbuf, now.sndbuf);
      s->seen = now;
    }
    if (busy <= 0 || acked <= 0) continue;
    size_t active;
    int concurrent;
    double peak, peak_srtt;
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      active = link.active;
      concurrent = link.concurrent;
      peak = link.peak_rate;
      peak_srtt = link.peak_srtt;
    }
    std::lock_guard<std::mutex> lock(report_mu_);
    LinkReport& r = link.report;
    r.rtt_s = min_rtt;
    r.rate = acked / busy;
    r.limited_share = std::min(1.0, rwnd_limited / busy);
    r.sndbuf = sndbuf;
    const double rtt = min_rtt > 0 ? min_rtt : r.handshake_rtt_s;
    // What the streams it used could keep in flight, against what it kept: a link that
    // kept close to all of it (or waited on the receiver's window) may be faster than it
    // showed, and asks for twice as much.
    const double inflight = r.rate * rtt;
    const double room = static_cast<double>(active) * limits_.inflight_of(sndbuf);
    // (A path whose bandwidth-delay product autotuning covers needs nothing: there a full
    // receiver window is the receiver being slow, not too few buffers.)
    const bool long_path = 2 * inflight > limits_.autotuned_inflight();
    r.peak_rate = peak;
    r.peak_srtt_s = peak_srtt;
    r.retransmits += retransmits;
    // At the rate it reached, one autotuned stream could not fill the link's path.
    const bool long_link = 2 * peak * rtt > limits_.autotuned_inflight();
    // What the uplink carried, from collectives that sent on this link alone (the ring
    // schedule): with N-1 links sharing the uplink (the direct schedule) each link's
    // streams' samples summed read up to 3x the uplink's rate. Only ever raised: a
    // collective held back by something else (the CPU, a peer) must not slow the next.
    if (long_link && concurrent == 1) r.uplink_rate = std::max(r.uplink_rate, peak);
    // A long link that lost packets to its own queue is paced from its next collective on
    // (and stays so): a path whose queue holds a collective's bursts loses none, and one
    // that loses packets at random runs as TCP sends.
    if (long_link && lost_to_own_queue(retransmits, peak_srtt, rtt)) r.paced = true;
    const bool held_back = long_path && (inflight >= kHeldBackShare * room || r.limited_share > kLimitedShare);
    r.needed_inflight = held_back ? 2 * inflight : kInflightHeadroom * inflight;
    if (!opt_.tune || rtt <= 0 || !held_back) continue;
    // First larger buffers (sndbuf is what the kernel granted, twice the ask), then, at the
    // host's limit, more of its streams (a stream used for the first time starts slowly,
    // so they are added only when the link showed it needs them).
    const int ask = sndbuf_for(r.needed_inflight / static_cast<double>(active), limits_);
    if (ask > 0 && 2 * static_cast<int64_t>(ask) > sndbuf) {
      for (SendStream* s : link.streams) set_send_buffer(s->socket, ask);
      TcpStats after;
      if (read_tcp_stats(link.streams[0]->socket, &after)) r.sndbuf = after.sndbuf;
      ++r.changes;
    } else if (link.wanted < static_cast<int>(link.streams.size())) {
      link.wanted = std::min(static_cast<int>(link.streams.size()), link.wanted + std::max(1, link.wanted / 2));
      r.wanted = link.wanted;
      ++r.changes;
    }
  }
}

std::vector<LinkReport> TcpTransport::link_reports() const {
  std::lock_guard<std::mutex> lock(report_mu_);
  std::vector<LinkReport> out;
  for (const auto& o : out_) {
    if (!o) continue;
    out.push_back(o->report);
    out.back().bytes_sent = o->bytes.load();
    out.back().probe_rtts = o->probe_rtts.load();
    for (const SendStream* s : o->streams) out.back().stream_bytes.push_back(s->bytes.load());
  }
  return out;
}

void TcpTransport::send_control(const Socket& s, FrameSealer& sealer, FrameKind kind, int origin,
                                const std::string& message) {
  const std::string payload = encode_control(origin, message);
  FrameHeader h;
  h.kind = kind;
  h.src_rank = static_cast<uint16_t>(opt_.rank);
  h.job = opt_.job;
  h.payload_len = static_cast<uint32_t>(payload.size());
  char buf[kFrameOverhead + kMaxControlPayload];
  auto* bytes = reinterpret_cast<uint8_t*>(buf);
  IoLimits limits;
  limits.deadline = Deadline::after(kControlDeadline);
  try {
    sealer.begin(h, bytes);
    const char* sealed = sealer.payload(payload.data(), buf + kHeaderBytes, payload.size());
    if (sealed != buf + kHeaderBytes) std::memcpy(buf + kHeaderBytes, sealed, payload.size());
    sealer.tag(bytes + kHeaderBytes + payload.size());
    send_all(s, buf, kFrameOverhead + payload.size(), limits);
  } catch (const std::exception&) {
    // Best effort: the neighbour may be gone already.
  }
}

void TcpTransport::shutdown(FrameKind kind, int origin, const std::string& message) {
  std::lock_guard<std::mutex> guard(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  stop_ = true;
  { std::lock_guard<std::mutex> lock(send_mu_); }
  send_cv_.notify_all();
  sent_cv_.notify_all();
  { std::lock_guard<std::mutex> lock(recv_mu_); }
  recv_cv_.notify_all();
  for (auto& s : send_) {
    if (s->thread.joinable()) s->thread.join();
  }
  // Senders are stopped: a stream that is between frames can carry our report.
  for (auto& s : send_) {
    if (!s->mid_frame) send_control(s->socket, s->sealer, kind, origin, message);
    s->socket.shutdown_write();
  }
  for (auto& s : recv_) send_control(s->socket, s->reports, kind, origin, message);  // the return paths
  for (auto& s : recv_) {
    s->socket.shutdown_both();
    if (s->thread.joinable()) s->thread.join();
  }
  if (watcher_.joinable()) watcher_.join();
  for (auto& s : send_) s->socket.close();
  for (auto& s : recv_) s->socket.close();
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    for (auto& s : send_) s->queue.clear();  // releases payload owners
  }
}

}  // namespace prime::ring
