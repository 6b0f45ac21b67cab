#include "ring.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "../codec/codec.h"
#include "crypto/sha256.h"

namespace prime::ring {
namespace {

ErrorInfo invalid(int rank, const std::string& cause) {
  ErrorInfo e;
  e.kind = ErrorKind::kInternal;
  e.rank = rank;
  e.origin = rank;
  e.cause = cause;
  return e;
}

}  // namespace

uint64_t job_hash(const std::string& job_id, int world_size) {
  const std::string text = job_id + '\0' + std::to_string(world_size);
  const Digest d = sha256(text.data(), text.size());
  uint64_t h = 0;
  for (int i = 0; i < 8; ++i) h |= static_cast<uint64_t>(d[i]) << (8 * i);
  return h;
}

Ring::Ring(RingOptions options) : opt_(std::move(options)), job_(job_hash(opt_.job_id, opt_.world_size)) {
  // prime.comm.Ring checks every option with a message for the user; these are the
  // invariants the C++ relies on (the 64-bit rank mask, whole codec blocks per segment).
  const bool valid = opt_.world_size >= 1 && opt_.world_size <= 64 && opt_.rank >= 0 &&
                     opt_.rank < opt_.world_size && opt_.streams >= 0 && opt_.streams <= kMaxLinkStreams &&
                     opt_.timeout_ms > 0 &&
                     opt_.rendezvous_timeout_ms > 0 && opt_.segment_elems >= codec::kMaxBlock &&
                     opt_.segment_elems % codec::kMaxBlock == 0 && opt_.segment_elems <= (int64_t{1} << 28);
  if (!valid) {
    throw std::invalid_argument("internal: RingOptions reached the ring unchecked (prime.comm.Ring checks them): rank " +
                                std::to_string(opt_.rank) + " of " + std::to_string(opt_.world_size) + ", streams " +
                                std::to_string(opt_.streams) + ", segment " + std::to_string(opt_.segment_elems));
  }
  if (opt_.world_size > 1) {
    RendezvousOptions r;
    r.rank = opt_.rank;
    r.world_size = opt_.world_size;
    r.handshake.secret = opt_.secret;
    r.handshake.job = job_;
    r.handshake.world_size = opt_.world_size;
    r.handshake.streams = opt_.streams;
    r.handshake.encrypt = opt_.encrypt;
    r.handshake.segment_elems = static_cast<uint64_t>(opt_.segment_elems);
    r.bind_addr = opt_.bind_addr;
    r.socket_buffer_bytes = opt_.socket_buffer_bytes;
    r.link_rate = opt_.max_rate > 0 ? opt_.max_rate : kAssumedLinkRate;
    r.pool_rate = opt_.max_rate > 0 ? opt_.max_rate : kPoolLinkRate;
    r.timeout = Millis(opt_.rendezvous_timeout_ms);
    try {
      rendezvous_ = std::make_unique<Rendezvous>(std::move(r));
    } catch (const IoError& e) {
      throw std::invalid_argument(std::string(e.what()) +
                                  " (check bind_addr / PRIME_RING_BIND_ADDR: it must be an address of this host)");
    }
  }
}

Ring::~Ring() {
  // A destructor must not throw (std::terminate): close() only allocates messages, but
  // should it fail, the worker is still stopped and joined here.
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prime ring rank %d: closing the ring failed: %s\n", opt_.rank, e.what());
  }
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    // Stops every I/O thread (the transport itself stays until the worker is joined), so
    // the worker's waits end.
    if (transport_) transport_->shutdown(FrameKind::kClose, opt_.rank, "closed");
    worker_.join();
  }
}

int Ring::port() const { return rendezvous_ ? rendezvous_->port() : 0; }

std::vector<std::string> Ring::rejected_connections() const {
  return rendezvous_ ? rendezvous_->rejected() : std::vector<std::string>{};
}

void Ring::connect(const std::vector<Address>& addresses) {
  std::lock_guard<std::mutex> life(lifecycle_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connecting_ || closed_) throw std::logic_error("connect() may be called once, before close()");
    connecting_ = true;
  }
  if (opt_.world_size > 1) {
    if (static_cast<int>(addresses.size()) != opt_.world_size) {
      throw std::invalid_argument("internal: connect() needs the address of every rank");
    }
    std::vector<Link> links = rendezvous_->complete(addresses);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) {  // close() ran meanwhile: start nothing (the links close with `links`)
        ErrorInfo e = invalid(opt_.rank, "the ring was closed while it was forming");
        e.kind = ErrorKind::kClosed;
        e.where.phase = Phase::kRendezvous;
        throw CommError(e);
      }
    }
    TransportOptions t;
    t.rank = opt_.rank;
    t.timeout = Millis(opt_.timeout_ms);
    t.max_rate = opt_.max_rate;
    t.encrypt = opt_.encrypt;
    t.job = job_;
    t.max_payload = static_cast<uint32_t>(opt_.segment_elems * 4);  // an fp32 segment, the largest payload
    t.corrupt_after_bytes = opt_.corrupt_after_bytes;
    t.restart_bbr = opt_.restart_bbr;
    t.tune = opt_.streams == 0 && opt_.socket_buffer_bytes == 0;  // the user chose neither
    // Idle frame buffers kept for reuse: a few chunks' worth at the default segment size.
    pool_ = BufferPool::create(size_t{256} << 20);
    transport_ = std::make_unique<TcpTransport>(std::move(t), std::move(links), pool_, [this] {
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    });
  }
  worker_ = std::thread(&Ring::worker_loop, this);
  std::lock_guard<std::mutex> lock(mu_);
  connected_ = true;  // only now may collectives be queued
}

void Ring::set_order(std::vector<int> order) {
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int>(order.size()) == opt_.world_size;
  for (int i = 0; permutation && i < opt_.world_size; ++i) permutation = sorted[static_cast<size_t>(i)] == i;
  if (!permutation) throw std::invalid_argument("internal: a ring order must be a permutation of the ranks");
  std::lock_guard<std::mutex> lock(mu_);
  order_ = std::move(order);
}

std::vector<int> Ring::order() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!order_.empty()) return order_;
  std::vector<int> identity(static_cast<size_t>(opt_.world_size));
  for (int i = 0; i < opt_.world_size; ++i) identity[static_cast<size_t>(i)] = i;
  return identity;
}

std::vector<LinkReport> Ring::links() const {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  return transport_ ? transport_->link_reports() : std::vector<LinkReport>{};
}

std::shared_ptr<Work> Ring::all_reduce(AllReduceJob job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!connected_ || closing_) {
    throw std::logic_error(closing_ ? "all_reduce on a closed ring" : "all_reduce before the ring was connected");
  }
  auto work = std::make_shared<Work>(next_seq_++);
  job.order = order_;  // the order when it was issued (every rank issues in the same order)
  job.spec.measure_error = opt_.measure_quant_error && job.spec.codec != CodecKind::kNone;
  queue_.push_back(Pending{std::move(job), work, Clock::now()});
  cv_.notify_all();
  return work;
}

ErrorInfo Ring::broken_error(int64_t seq) const {
  ErrorInfo e = *broken_;
  e.where = Context{seq};
  if (e.kind != ErrorKind::kPeerFailed) {
    e.cause = "the ring is broken since an earlier failure (" + broken_->message() +
              "); close it and build a new ring with a new job_id";
  }
  return e;
}

void Ring::break_ring(const ErrorInfo& e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    broken_ = e;
  }
  if (!transport_) return;
  // Forward the origin's own words, so every rank reports the root cause.
  if (e.kind == ErrorKind::kPeerFailed) {
    transport_->shutdown(FrameKind::kAbort, e.origin, e.origin_message);
  } else {
    transport_->shutdown(FrameKind::kAbort, opt_.rank, e.message());
  }
}

void Ring::worker_loop() {
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return closing_ || !queue_.empty() || (transport_ && transport_->failed() && !broken_);
      });
      if (queue_.empty()) {
        if (transport_ && transport_->failed() && !broken_) {
          // A neighbour failed between collectives: tear down now, so the rest of
          // the ring hears of it without waiting for the next collective.
          lock.unlock();
          if (auto e = transport_->failure(Context{})) break_ring(*e);
          continue;
        }
        if (closing_) return;
        continue;
      }
      p = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    execute_guarded(p);
  }
}

void Ring::execute_guarded(Pending& p) {
  try {
    execute(p);
    return;
  } catch (const abi::__forced_unwind&) {
    throw;  // thread cancellation must unwind on
  } catch (const std::exception& e) {
    try {
      ErrorInfo info = invalid(opt_.rank, std::string("internal error: ") + e.what());
      info.where = Context{p.work->seq()};
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_ = false;
      }
      break_ring(info);
      if (!p.work->completed()) p.work->finish(info, WorkStats{});
      return;
    } catch (...) {
    }
  } catch (...) {
  }
  // Not even the error could be built (out of memory): fail the job with what exists.
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  if (!p.work->completed()) p.work->finish(ErrorInfo{}, WorkStats{});
}

void Ring::execute(Pending& p) {
  WorkStats stats;
  stats.seq = p.work->seq();
  stats.n = p.job.spec.n;
  stats.stage_s = p.job.stage_s;
  const auto t0 = Clock::now();
  stats.queue_s = std::chrono::duration<double>(t0 - p.submitted).count();
  auto done = [&](std::optional<ErrorInfo> error) {
    stats.total_s = seconds_since(t0);
    {
      // Before finish(): a caller woken by it may close() the ring at once, and must
      // then see an idle ring (a clean close, not an abort of its neighbours).
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    p.work->finish(std::move(error), stats);
  };
  std::optional<ErrorInfo> refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) {
      refused = broken_error(p.work->seq());
    } else if (closing_) {
      ErrorInfo e;
      e.kind = ErrorKind::kClosed;
      e.rank = e.origin = opt_.rank;
      e.where = Context{p.work->seq()};
      e.cause = "the ring was closed before this collective ran";
      refused = e;
    }
  }
  if (refused) return done(refused);
  const AllReduceSpec& spec = p.job.spec;
  ScheduleOutcome outcome;
  if (opt_.world_size == 1) {
    // The sum (and mean) of one tensor is itself: nothing to send, nothing to write.
    if (!all_finite(spec.input, spec.dtype, spec.n)) outcome.nonfinite_ranks = 1;
  } else {
    auto counters = std::make_shared<WireCounters>();
    ScheduleTimes times;
    RingGeometry g{opt_.rank, opt_.world_size, opt_.segment_elems, job_, p.job.order};
    std::optional<ErrorInfo> failure;
    try {
      transport_->begin_collective(spec.schedule == Schedule::kDirect ? opt_.world_size - 1 : 1);
      outcome = run_all_reduce(*transport_, *pool_, g, static_cast<uint64_t>(p.work->seq()), spec, counters, times);
    } catch (const CommError& e) {
      failure = e.info();
    } catch (const std::exception& e) {
      failure = invalid(opt_.rank, std::string("internal error: ") + e.what());
      failure->where = Context{p.work->seq()};
    }
    stats.bytes_sent = counters->bytes_sent;
    stats.bytes_received = counters->bytes_received;
    stats.frames_sent = counters->frames_sent;
    stats.frames_received = counters->frames_received;
    // The transport counts nanoseconds (an atomic its threads add to); the other timers
    // measured around the schedule are set where they are measured.
    stats.auth_s = static_cast<double>(counters->auth_ns.load()) * 1e-9;
#define PRIME_RING_COPY_TIMER(name, description) stats.name = times.name;
    PRIME_RING_SCHEDULE_TIMERS(PRIME_RING_COPY_TIMER)
#undef PRIME_RING_COPY_TIMER
    stats.gpu = spec.cuda != nullptr;
    stats.quant_measured = spec.measure_error;
    stats.quant_err_sq = times.quant_err_sq;
    stats.quant_in_sq = times.quant_in_sq;
    stats.direct = spec.schedule == Schedule::kDirect;
    if (failure) {
      // Stops every I/O thread (and with them every pointer into this job's buffers)
      // before the job, and the tensors it keeps alive, go away.
      break_ring(*failure);
      return done(failure);
    }
  }
  if (outcome.nonfinite_ranks || outcome.overflow) {
    ErrorInfo e;
    e.kind = ErrorKind::kNonFinite;
    e.rank = e.origin = opt_.rank;
    e.where = Context{p.work->seq()};
    e.nonfinite_ranks = outcome.nonfinite_ranks;
    e.overflow = outcome.overflow && !outcome.nonfinite_ranks;
    if (outcome.nonfinite_ranks) {
      std::string list;
      for (int r : ranks_of_mask(outcome.nonfinite_ranks)) list += (list.empty() ? "" : ", ") + std::to_string(r);
      e.cause = "non-finite input (NaN or Inf) on rank(s) [" + list + "]; no tensor was modified";
    } else {
      e.cause = std::string("the ") + (spec.op == ReduceOp::kSum ? "sum" : "average") +
                " overflowed to Inf although every input was finite (dtype " + dtype_name(spec.dtype) +
                "); no tensor was modified";
    }
    return done(e);
  }
  if (opt_.world_size > 1) {
    transport_->learn();  // between collectives: nothing is on the wire of this one any more
    const auto c0 = Clock::now();
    try {
      // Only now is the caller's tensor written: decoded straight from the wire bytes
      // when it can be (no staging pass), else through the staging buffer.
      write_result(spec, outcome, spec.output ? spec.output : p.job.direct, *pool_);
      outcome.pieces.clear();  // back to the pool
      if (spec.output && p.job.commit) {
        const auto b0 = Clock::now();
        p.job.commit();
        stats.copy_back_s = seconds_since(b0);
      }
    } catch (const std::exception& ex) {
      ErrorInfo e = invalid(opt_.rank, std::string("copying the result into the tensor failed: ") + ex.what());
      e.where = Context{p.work->seq()};
      return done(e);
    }
    stats.commit_s = seconds_since(c0);
  }
  done(std::nullopt);
}

void Ring::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    closing_ = true;
  }
  cv_.notify_all();
  // A connect() in another thread gives up its rendezvous; then wait until it returned.
  if (rendezvous_) rendezvous_->interrupt();
  std::lock_guard<std::mutex> life(lifecycle_mu_);
  bool was_running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_running = running_ || !queue_.empty();
  }
  if (transport_) {
    // Interrupts a running collective (its waits see the stop and fail with kClosed)
    // and tells the neighbours why.
    const std::string why = "rank " + std::to_string(opt_.rank) + " closed the ring";
    if (was_running) {
      transport_->shutdown(FrameKind::kAbort, opt_.rank, why + " while a collective was in flight");
    } else {
      transport_->shutdown(FrameKind::kClose, opt_.rank, why);
    }
  }
  if (worker_.joinable()) worker_.join();
  {
    // Jobs queued behind the one that was running.
    std::deque<Pending> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(queue_);
    }
    for (auto& p : left) execute_guarded(p);
  }
  rendezvous_.reset();
}

}  // namespace prime::ring
