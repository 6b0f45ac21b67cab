#include "schedule.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "crypto/crc32c.h"
#include "deadline.h"
#include "str_builder.h"
#include "wire_codec.h"

namespace prime::ring {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

using Timer = ScopedTimer;

// What both schedules share: the codec and the segment layout, framing and receiving
// with every check, the non-finite flags every frame carries, the deferred payload
// held back for the codec's device, and the early writes of final segments (with
// their undo). The schedules add only the order of sends and receives.
class Collective {
 public:
  Collective(Transport& transport, BufferPool& pool, const RingGeometry& g, uint64_t seq, const AllReduceSpec& spec,
             std::shared_ptr<WireCounters> counters, ScheduleTimes& times)
      : t_(transport),
        pool_(pool),
        g_(g),
        seq_(seq),
        spec_(spec),
        counters_(std::move(counters)),
        times_(times),
        n_(g.world_size),
        r_(g.rank),
        codec_(make_wire_codec(spec, pool, times)),
        unit_(codec_->unit()),
        seg_(round_up(std::max<int64_t>(g.segment_elems, 1), unit_)),
        esize_(dtype_size(spec.dtype)),
        desc_(descriptor_of(spec)),
        spec_text_(describe_spec(spec)) {}
  virtual ~Collective() = default;

  ScheduleOutcome run() {
    try {
      run_phases();
      return finish();
    } catch (...) {
      restore();  // the tensor as it was before any early write
      throw;
    }
  }

 protected:
  virtual void run_phases() = 0;

  ScheduleOutcome finish() {
    send_pending();
    {
      Timer wait(times_.wait_s);
      t_.flush(Context{static_cast<int64_t>(seq_)});
    }
    codec_->finish();
    ScheduleOutcome out;
    out.nonfinite_ranks = mask();
    out.overflow = overflow_;
    if (out.nonfinite_ranks || out.overflow) {
      restore();  // the caller reports the failure and writes nothing
    } else {
      out.pieces = std::move(pieces_);  // what was not written early (all of it without early_output)
      out.codec = codec_;
    }
    return out;
  }

  // Early writes cost a memory pass (saving what they overwrite), so they are done only
  // while this rank would otherwise wait for `peer`: on a slow link they hide the decode
  // in the waits; when the CPU is the bottleneck (loopback) frames are always ready and
  // the pieces are written once at the end, without the save. The schedules call it
  // only where every value a pending piece overwrites was read for the last time.
  void write_early_while_waiting(int peer) {
    while (!pieces_.empty() && !t_.frame_ready(peer) && write_early_one()) {
    }
  }

  // Writes the oldest pending final piece into early_output, saving what it overwrites;
  // false when there is nothing it may write (no early_output, or a rank's input is
  // known to be non-finite: the result will be discarded).
  bool write_early_one() {
    if (!spec_.early_output || mask() || overflow_ || pieces_.empty()) return false;
    Timer timer(times_.reduce_s);
    const FinalPiece p = pieces_.front();
    pieces_.erase(pieces_.begin());
    if (p.len == 0) return true;
    char* at = static_cast<char*>(spec_.early_output) + p.begin * static_cast<int64_t>(esize_);
    Buffer saved = pool_.acquire(static_cast<size_t>(p.len) * esize_);
    std::memcpy(saved->data(), at, saved->size());
    backups_.push_back(FinalPiece{p.begin, p.len, saved});
    Buffer scratch;
    if (const int64_t floats = codec_->scratch_floats(p.len)) scratch = pool_.acquire(static_cast<size_t>(floats) * 4);
    codec_->decode_final(p.bytes->data(), p.len, at, scratch ? scratch->as<float>() : nullptr);
    return true;
  }

  // Puts back every value an early write replaced (memcpy only: cannot fail).
  void restore() {
    char* out = static_cast<char*>(spec_.early_output);
    for (const FinalPiece& b : backups_) {
      std::memcpy(out + b.begin * static_cast<int64_t>(esize_), b.bytes->data(), static_cast<size_t>(b.len) * esize_);
    }
    backups_.clear();
  }

  int segments(int c) const {
    const Span span = chunk_span(spec_.n, unit_, n_, c);
    return static_cast<int>(std::max<int64_t>(1, (span.size() + seg_ - 1) / seg_));
  }
  Span segment(int c, int k) const {
    const Span span = chunk_span(spec_.n, unit_, n_, c);
    const int64_t b = std::min(span.end, span.begin + k * seg_);
    return Span{b, std::min(span.end, b + seg_)};
  }
  const char* in(int64_t i) const { return static_cast<const char*>(spec_.input) + i * esize_; }
  uint64_t mask() const {
    return received_mask_ | ((own_bad_ || !codec_->input_finite()) ? (uint64_t{1} << r_) : 0);
  }

  // Sends p to every rank in `peers` after every payload produced before it. A deferred
  // payload (wire_codec.h) waits here until the next one was produced or the worker
  // would block on the wire, so the codec's device works on segment k+1 while segment
  // k's bytes download.
  void send(std::vector<int> peers, Phase phase, int step, int k, const Payload& p, bool final = false) {
    send_pending();
    if (p.deferred) {
      pending_ = PendingSend{std::move(peers), phase, step, k, p, final};
      return;
    }
    for (int peer : peers) send_now(peer, phase, step, k, p.data, p.size, p.owner);
  }

  void send_pending() {
    if (!pending_) return;
    PendingSend p = std::move(*pending_);
    pending_.reset();
    bool finite = true;
    codec_->ready(p.payload, &finite);
    if (p.final) overflow_ |= !finite;
    for (int peer : p.peers) send_now(peer, p.phase, p.step, p.k, p.payload.data, p.payload.size, p.payload.owner);
  }

  void forward(int peer, Phase phase, int step, int k, const char* data, size_t size,
               std::shared_ptr<const ByteBuffer> owner) {
    send_pending();
    send_now(peer, phase, step, k, data, size, std::move(owner));
  }

  void send_now(int peer, Phase phase, int step, int k, const char* data, size_t size,
                std::shared_ptr<const ByteBuffer> owner) {
    OutFrame f;
    f.header.kind = FrameKind::kData;
    f.header.phase = phase;
    f.header.src_rank = static_cast<uint16_t>(r_);
    f.header.job = g_.job;
    f.header.seq = seq_;
    f.header.step = static_cast<uint32_t>(step);
    f.header.segment = static_cast<uint32_t>(k);
    f.header.desc = desc_;
    f.header.nonfinite_mask = mask();
    if (overflow_) f.header.flags |= kFlagOverflow;
    f.data = data;
    f.size = size;
    f.owner = std::move(owner);
    f.counters = counters_;
    t_.send(peer, std::move(f));
  }

  InFrame receive(int peer, Phase phase, int step, int k, int64_t expected_len) {
    const Context where{static_cast<int64_t>(seq_), phase, step, k};
    // Never block on the wire with a payload held back: a peer may need it first.
    if (pending_ && !t_.frame_ready(peer)) send_pending();
    InFrame f;
    {
      Timer wait(times_.wait_s);
      f = t_.recv(peer, where, *counters_);
    }
    const FrameHeader& h = f.header;
    const ExpectedFrame expected{seq_, desc_, phase, static_cast<uint32_t>(step), static_cast<uint32_t>(k),
                                 static_cast<uint64_t>(expected_len), peer, &spec_text_};
    const std::string wrong = check_expected(h, expected);
    if (!wrong.empty()) {
      ErrorInfo e;
      e.kind = ErrorKind::kProtocol;
      e.rank = r_;
      e.peer = peer;
      e.origin = r_;
      e.where = where;
      e.cause = "unexpected frame from rank " + std::to_string(peer) + ": " + wrong;
      throw CommError(e);
    }
    received_mask_ |= h.nonfinite_mask;
    overflow_ |= (h.flags & kFlagOverflow) != 0;
    return f;
  }

  // A final segment is known (the owner encoded it, or it arrived): kept as it is, and
  // decoded into the caller's tensor once every check passed (or early).
  void keep_final(const Span& sp, std::shared_ptr<const ByteBuffer> bytes, bool encoded_here) {
    pieces_.push_back(FinalPiece{sp.begin, sp.size(), std::move(bytes)});
    codec_->final_known(pieces_.back(), encoded_here);
  }

  Transport& t_;
  BufferPool& pool_;
  const RingGeometry g_;
  const uint64_t seq_;
  const AllReduceSpec spec_;
  std::shared_ptr<WireCounters> counters_;
  ScheduleTimes& times_;
  const int n_;
  const int r_;
  const std::shared_ptr<WireCodec> codec_;
  const int64_t unit_;
  const int64_t seg_;
  const size_t esize_;
  const uint32_t desc_;
  const std::string spec_text_;  // for the message when a peer's arguments differ
  bool own_bad_ = false;
  uint64_t received_mask_ = 0;
  bool overflow_ = false;

 private:
  struct PendingSend {
    std::vector<int> peers;
    Phase phase;
    int step;
    int k;
    Payload payload;
    bool final;  // carries a final value: ready() reports its finiteness
  };
  std::optional<PendingSend> pending_;  // a deferred payload not yet sent (at most one)
  std::vector<FinalPiece> pieces_;   // final segments not yet written
  std::vector<FinalPiece> backups_;  // what the early writes replaced
};

// The ring: positions 0..N-1 in g.order; chunk c starts at position c and is owned by
// position c-1. Each rank talks to its two neighbours only.
class RingAllReduce final : public Collective {
 public:
  using Collective::Collective;

 private:
  void run_phases() override {
    const std::vector<int>& order = g_.order;
    pos_ = r_;
    if (!order.empty()) pos_ = static_cast<int>(std::find(order.begin(), order.end(), r_) - order.begin());
    right_ = order.empty() ? (r_ + 1) % n_ : order[static_cast<size_t>((pos_ + 1) % n_)];
    left_ = order.empty() ? (r_ + n_ - 1) % n_ : order[static_cast<size_t>((pos_ + n_ - 1) % n_)];
    send_own_chunk();
    for (int s = 0; s < n_ - 1; ++s) {
      const int c = (pos_ - s - 1 + 2 * n_) % n_;
      for (int k = 0; k < segments(c); ++k) reduce_scatter_segment(s, c, k);
    }
    // The reduce-scatter read the input for the last time: from here on, final
    // segments may go into the caller's tensor (early_output) as they are known.
    for (int s = 0; s < n_ - 1; ++s) {
      const int c = (pos_ - s + n_) % n_;
      for (int k = 0; k < segments(c); ++k) {
        write_early_while_waiting(left_);
        all_gather_segment(s, c, k);
      }
    }
  }

  // Step 0 of the reduce-scatter: this rank's own chunk, as it is.
  void send_own_chunk() {
    const int c = pos_;
    for (int k = 0; k < segments(c); ++k) codec_->prefetch_input(in(segment(c, k).begin), segment(c, k).size());
    for (int k = 0; k < segments(c); ++k) {
      const Span sp = segment(c, k);
      bool finite = true;
      const Payload p = codec_->encode_input(in(sp.begin), sp.size(), &finite);
      own_bad_ |= !finite;
      send({right_}, Phase::kReduceScatter, 0, k, p);
    }
  }

  void reduce_scatter_segment(int s, int c, int k) {
    const Span sp = segment(c, k);
    const int64_t len = sp.size();
    const bool last = s == n_ - 2;  // this rank owns chunk c: the sum is complete here
    InFrame f = receive(left_, Phase::kReduceScatter, s, k, codec_->partial_bytes(len));
    Buffer acc = pool_.acquire(static_cast<size_t>(len) * 4);
    {
      Timer timer(times_.reduce_s);
      own_bad_ |= !codec_->accumulate(in(sp.begin), f.payload->data(), len, acc->as<float>());
      if (last && spec_.op == ReduceOp::kAvg) codec_->divide(acc->as<float>(), len, static_cast<float>(n_));
    }
    if (!last) {
      send({right_}, Phase::kReduceScatter, s + 1, k, codec_->encode_partial(acc, len));
      return;
    }
    // Owner: the final value is computed (and encoded) once, here.
    bool finite = true;
    const Payload fin = codec_->encode_final(acc, len, &finite);
    overflow_ |= !finite;
    keep_final(sp, fin.owner, true);
    send({right_}, Phase::kAllGather, 0, k, fin, true);
  }

  void all_gather_segment(int s, int c, int k) {
    const Span sp = segment(c, k);
    InFrame f = receive(left_, Phase::kAllGather, s, k, codec_->final_bytes(sp.size()));
    keep_final(sp, f.payload, false);
    if (s < n_ - 2) {
      // Forward the owner's bytes verbatim (authenticated on arrival, sealed anew for the next link).
      Buffer buf = std::move(f.payload);
      forward(right_, Phase::kAllGather, s + 1, k, buf->data(), static_cast<size_t>(f.header.payload_len), buf);
    }
  }

  int pos_ = 0;
  int right_ = 0;
  int left_ = 0;
};

// Two hops: rank c owns chunk c. Every rank sends each owner its own values of the
// owner's chunk, encoded once (segment by segment, going round the owners so that all
// of them can start); the owner adds them to its own values in fp32, in a fixed order
// (its own, then ranks c+1, c+2, ...), encodes the result once and sends it to every
// rank. On each link all reduce-scatter frames precede all all-gather frames.
class DirectAllReduce final : public Collective {
 public:
  using Collective::Collective;

 private:
  void run_phases() override {
    send_contributions();
    for (int k = 0; k < segments(r_); ++k) reduce_own_segment(k);
    // Every rank's input was read for the last time (its contributions were encoded and
    // this rank's own chunk summed): final segments may go into the tensor early.
    int most = 0;
    for (int j = 1; j < n_; ++j) most = std::max(most, segments((r_ + j) % n_));
    for (int k = 0; k < most; ++k) {
      for (int j = 1; j < n_; ++j) {
        const int c = (r_ + j) % n_;
        if (k >= segments(c)) continue;
        write_early_while_waiting(c);
        const Span sp = segment(c, k);
        InFrame f = receive(c, Phase::kAllGather, 0, k, codec_->final_bytes(sp.size()));
        keep_final(sp, f.payload, false);
      }
    }
  }

  void send_contributions() {
    std::vector<std::pair<int, int>> order;  // (chunk, segment), round the owners
    int most = 0;
    for (int j = 1; j < n_; ++j) most = std::max(most, segments((r_ + j) % n_));
    for (int k = 0; k < most; ++k) {
      for (int j = 1; j < n_; ++j) {
        const int c = (r_ + j) % n_;
        if (k < segments(c)) order.emplace_back(c, k);
      }
    }
    // The codec may start encoding a round of owners ahead (a GPU codec queues the work).
    const size_t ahead = static_cast<size_t>(n_ - 1);
    size_t prefetched = 0;
    auto prefetch_to = [&](size_t end) {
      for (; prefetched < std::min(end, order.size()); ++prefetched) {
        const Span sp = segment(order[prefetched].first, order[prefetched].second);
        codec_->prefetch_input(in(sp.begin), sp.size());
      }
    };
    for (size_t i = 0; i < order.size(); ++i) {
      prefetch_to(i + 1 + ahead);
      const auto [c, k] = order[i];
      const Span sp = segment(c, k);
      bool finite = true;
      const Payload p = codec_->encode_input(in(sp.begin), sp.size(), &finite);
      own_bad_ |= !finite;
      send({c}, Phase::kReduceScatter, 0, k, p);
    }
  }

  void reduce_own_segment(int k) {
    const Span sp = segment(r_, k);
    const int64_t len = sp.size();
    Buffer acc = pool_.acquire(static_cast<size_t>(len) * 4);
    for (int j = 1; j < n_; ++j) {
      const int from = (r_ + j) % n_;
      write_early_while_waiting(from);
      InFrame f = receive(from, Phase::kReduceScatter, 0, k, codec_->partial_bytes(len));
      Timer timer(times_.reduce_s);
      if (j == 1) {
        own_bad_ |= !codec_->accumulate(in(sp.begin), f.payload->data(), len, acc->as<float>());
      } else {
        codec_->add_partial(f.payload->data(), len, acc->as<float>());
      }
    }
    if (spec_.op == ReduceOp::kAvg) {
      Timer timer(times_.reduce_s);
      codec_->divide(acc->as<float>(), len, static_cast<float>(n_));
    }
    bool finite = true;
    const Payload fin = codec_->encode_final(acc, len, &finite);
    overflow_ |= !finite;
    keep_final(sp, fin.owner, true);
    std::vector<int> everyone;
    for (int j = 1; j < n_; ++j) everyone.push_back((r_ + j) % n_);
    send(std::move(everyone), Phase::kAllGather, 0, k, fin, true);
  }
};

}  // namespace

const char* codec_name(CodecKind codec) {
  switch (codec) {
    case CodecKind::kInt8: return "int8";
    case CodecKind::kFp4: return "fp4";
    case CodecKind::kTopk: return "topk";
    default: return "none";
  }
}

void write_result(const AllReduceSpec& spec, const ScheduleOutcome& outcome, void* dst, BufferPool& pool) {
  if (outcome.codec) outcome.codec->commit();
  if (outcome.pieces.empty()) return;
  outcome.codec->write_result(outcome.pieces, dst, dtype_size(spec.dtype), pool);
}

Span chunk_span(int64_t n, int64_t unit, int world_size, int chunk) {
  const int64_t units = (n + unit - 1) / unit;
  const int64_t u0 = units * chunk / world_size;
  const int64_t u1 = units * (chunk + 1) / world_size;
  return Span{std::min(n, u0 * unit), std::min(n, u1 * unit)};
}

uint32_t descriptor_of(const AllReduceSpec& spec) {
  uint8_t buf[24] = {};
  const uint64_t n = static_cast<uint64_t>(spec.n);
  std::memcpy(buf, &n, 8);
  buf[8] = static_cast<uint8_t>(spec.dtype);
  buf[9] = static_cast<uint8_t>(spec.op);
  buf[10] = static_cast<uint8_t>(spec.codec);
  buf[11] = static_cast<uint8_t>(spec.schedule);  // 0 for the ring: its descriptors are unchanged
  // topk: k in the low 16 bits, the average's k in the high ones where it differs (k <= 4096);
  // 0 for the other codecs: their descriptors, and those of a topk with one k, are unchanged.
  uint32_t keep = 0;
  if (spec.codec == CodecKind::kTopk) {
    keep = static_cast<uint32_t>(spec.keep);
    if (spec.keep_average && spec.keep_average != spec.keep) keep |= static_cast<uint32_t>(spec.keep_average) << 16;
  }
  std::memcpy(buf + 12, &keep, 4);
  const uint64_t block = spec.codec != CodecKind::kNone ? static_cast<uint64_t>(spec.block) : 0;
  std::memcpy(buf + 16, &block, 8);
  return crc32c(buf, sizeof(buf));
}

std::string describe_spec(const AllReduceSpec& spec) {
  StrBuilder s;
  s << "n=" << spec.n << ", dtype=" << dtype_name(spec.dtype) << ", op=" << (spec.op == ReduceOp::kSum ? "sum" : "avg")
    << ", codec=" << codec_name(spec.codec);
  if (spec.codec == CodecKind::kTopk) {
    s << ", chunk=" << spec.block << ", k=" << spec.keep;
    if (spec.keep_average && spec.keep_average != spec.keep) s << ", k of the average=" << spec.keep_average;
  } else if (spec.codec != CodecKind::kNone) {
    s << ", block_size=" << spec.block;
  }
  s << ", schedule=" << (spec.schedule == Schedule::kDirect ? "direct" : "ring");
  return s.str();
}

ScheduleOutcome run_all_reduce(Transport& transport, BufferPool& pool, const RingGeometry& geometry, uint64_t seq,
                               const AllReduceSpec& spec, const std::shared_ptr<WireCounters>& counters,
                               ScheduleTimes& times) {
  if (spec.codec == CodecKind::kTopk && spec.schedule != Schedule::kDirect) {
    throw std::invalid_argument("the topk codec runs only in the direct schedule (a ring would select again at every hop)");
  }
  if (spec.schedule == Schedule::kDirect) {
    return DirectAllReduce(transport, pool, geometry, seq, spec, counters, times).run();
  }
  return RingAllReduce(transport, pool, geometry, seq, spec, counters, times).run();
}

}  // namespace prime::ring
