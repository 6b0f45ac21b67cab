#include "schedule.h"

#include <cstring>

#include "../codec/codec.h"
#include "crypto/crc32c.h"
#include "deadline.h"
#include "str_builder.h"

namespace prime::ring {

void decode_int8(const AllReduceSpec& spec, const char* payload, int64_t len, void* dst, float* scratch);

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

class Timer {
 public:
  explicit Timer(double& sink) : sink_(sink), t0_(Clock::now()) {}
  ~Timer() { sink_ += seconds_since(t0_); }

 private:
  double& sink_;
  Clock::time_point t0_;
};

class AllReduce {
 public:
  AllReduce(Transport& transport, BufferPool& pool, const RingGeometry& g, uint64_t seq, const AllReduceSpec& spec,
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
        left_((g.rank + n_ - 1) % n_),
        unit_(partition_unit(spec)),
        seg_(round_up(std::max<int64_t>(g.segment_elems, 1), unit_)),
        esize_(dtype_size(spec.dtype)),
        desc_(descriptor_of(spec)),
        spec_text_(describe_spec(spec)),
        int8_(spec.codec == CodecKind::kInt8) {}

  ScheduleOutcome run() {
    try {
      return run_phases();
    } catch (...) {
      restore();  // the tensor as it was before any early write
      throw;
    }
  }

 private:
  ScheduleOutcome run_phases() {
    send_own_chunk();
    for (int s = 0; s < n_ - 1; ++s) {
      const int c = (r_ - s - 1 + 2 * n_) % n_;
      for (int k = 0; k < segments(c); ++k) reduce_scatter_segment(s, c, k);
    }
    // The reduce-scatter read the input for the last time: from here on, final
    // segments may go into the caller's tensor (early_output) as they are known.
    // Early writes cost a memory pass (saving what they overwrite), so they are done
    // only while this rank would otherwise wait for the wire: on a slow link they hide
    // the decode in the waits; when the CPU is the bottleneck (loopback) frames are
    // always ready and the pieces are written once at the end, without the save.
    for (int s = 0; s < n_ - 1; ++s) {
      const int c = (r_ - s + n_) % n_;
      for (int k = 0; k < segments(c); ++k) {
        while (!pieces_.empty() && !t_.frame_ready() && write_early_one()) {
        }
        all_gather_segment(s, c, k);
      }
    }
    {
      Timer wait(times_.wait_s);
      t_.flush(Context{static_cast<int64_t>(seq_)});
    }
    ScheduleOutcome out;
    out.nonfinite_ranks = mask();
    out.overflow = overflow_;
    if (out.nonfinite_ranks || out.overflow) {
      restore();  // the caller reports the failure and writes nothing
    } else {
      out.pieces = std::move(pieces_);  // what was not written early (all of it without early_output)
    }
    return out;
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
    if (int8_) {
      Buffer scratch;
      if (spec_.dtype != DType::kFloat32) scratch = pool_.acquire(static_cast<size_t>(p.len) * 4);
      decode_int8(spec_, p.bytes->data(), p.len, at, scratch ? scratch->as<float>() : nullptr);
    } else {
      std::memcpy(at, p.bytes->data(), static_cast<size_t>(p.len) * esize_);
    }
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
  int64_t int8_bytes(int64_t len) const { return 4 * codec::num_blocks(len, spec_.block) + len; }
  const char* in(int64_t i) const { return static_cast<const char*>(spec_.input) + i * esize_; }
  uint64_t mask() const { return received_mask_ | (own_bad_ ? (uint64_t{1} << r_) : 0); }

  void send(Phase phase, int step, int k, const char* data, size_t size, std::shared_ptr<const ByteBuffer> owner) {
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
    t_.send(std::move(f));
  }

  // Quantizes `len` values of `type` into a fresh [scales | q] payload.
  Buffer quantize(const void* x, codec::InputType type, int64_t len, int64_t* bad_blocks) {
    Timer timer(times_.quantize_s);
    const int64_t nb = codec::num_blocks(len, spec_.block);
    Buffer buf = pool_.acquire(static_cast<size_t>(int8_bytes(len)));
    *bad_blocks = codec::quantize(x, type, len, spec_.block, reinterpret_cast<int8_t*>(buf->data() + 4 * nb),
                                  buf->as<float>());
    return buf;
  }

  // Step 0 of the reduce-scatter: this rank's own chunk, as it is.
  void send_own_chunk() {
    const int c = r_;
    for (int k = 0; k < segments(c); ++k) {
      const Span sp = segment(c, k);
      if (int8_) {
        int64_t bad = 0;
        auto buf = quantize(in(sp.begin), static_cast<codec::InputType>(spec_.dtype), sp.size(), &bad);
        own_bad_ |= bad > 0;
        send(Phase::kReduceScatter, 0, k, buf->data(), buf->size(), buf);
      } else if (spec_.dtype == DType::kFloat32) {
        {
          Timer timer(times_.reduce_s);
          own_bad_ |= !all_finite(in(sp.begin), spec_.dtype, sp.size());
        }
        // Zero copy: the input outlives the collective's final flush.
        send(Phase::kReduceScatter, 0, k, in(sp.begin), static_cast<size_t>(sp.size()) * 4, nullptr);
      } else {
        Buffer buf = pool_.acquire(static_cast<size_t>(sp.size()) * 4);
        {
          Timer timer(times_.reduce_s);
          own_bad_ |= !widen(in(sp.begin), spec_.dtype, sp.size(), buf->as<float>());
        }
        send(Phase::kReduceScatter, 0, k, buf->data(), buf->size(), buf);
      }
    }
  }

  InFrame receive(Phase phase, int step, int k, int64_t expected_len) {
    const Context where{static_cast<int64_t>(seq_), phase, step, k};
    InFrame f;
    {
      Timer wait(times_.wait_s);
      f = t_.recv(where, *counters_);
    }
    const FrameHeader& h = f.header;
    const ExpectedFrame expected{seq_, desc_, phase, static_cast<uint32_t>(step), static_cast<uint32_t>(k),
                                 static_cast<uint64_t>(expected_len), left_, &spec_text_};
    const std::string wrong = check_expected(h, expected);
    if (!wrong.empty()) {
      ErrorInfo e;
      e.kind = ErrorKind::kProtocol;
      e.rank = r_;
      e.peer = left_;
      e.origin = r_;
      e.where = where;
      e.cause = "unexpected frame from rank " + std::to_string(left_) + ": " + wrong;
      throw CommError(e);
    }
    received_mask_ |= h.nonfinite_mask;
    overflow_ |= (h.flags & kFlagOverflow) != 0;
    return f;
  }

  void reduce_scatter_segment(int s, int c, int k) {
    const Span sp = segment(c, k);
    const int64_t len = sp.size();
    const bool last = s == n_ - 2;  // this rank owns chunk c: the sum is complete here
    InFrame f = receive(Phase::kReduceScatter, s, k, int8_ ? int8_bytes(len) : len * 4);
    Buffer acc = pool_.acquire(static_cast<size_t>(len) * 4);
    float* a = acc->as<float>();
    {
      Timer timer(times_.reduce_s);
      if (int8_) {
        own_bad_ |= !widen(in(sp.begin), spec_.dtype, len, a);
        const int64_t nb = codec::num_blocks(len, spec_.block);
        codec::dequantize_add(a, reinterpret_cast<const int8_t*>(f.payload->data() + 4 * nb),
                              f.payload->as<float>(), len, spec_.block);
      } else {
        own_bad_ |= !add_widened(in(sp.begin), spec_.dtype, f.payload->as<float>(), len, a);
      }
      if (last && spec_.op == ReduceOp::kAvg) divide(a, len, static_cast<float>(n_));
    }
    if (!last) {
      if (int8_) {
        int64_t bad = 0;
        auto buf = quantize(a, codec::InputType::kFloat32, len, &bad);
        send(Phase::kReduceScatter, s + 1, k, buf->data(), buf->size(), buf);
      } else {
        send(Phase::kReduceScatter, s + 1, k, acc->data(), acc->size(), acc);
      }
      return;
    }
    // Owner: the final value is computed (and, for int8, quantized) once, here.
    if (int8_) {
      int64_t bad = 0;
      auto buf = quantize(a, codec::InputType::kFloat32, len, &bad);
      {
        Timer timer(times_.reduce_s);
        overflow_ |= bad > 0;
        // Every rank writes decode(these bytes) later (write_result): check now, on the
        // same decode, that it is finite, so the flag reaches every rank in the
        // all-gather headers before anyone writes. `a` is free once quantized.
        Buffer narrowed;
        if (spec_.dtype != DType::kFloat32) narrowed = pool_.acquire(static_cast<size_t>(len) * esize_);
        decode_int8(spec_, buf->data(), len, narrowed ? static_cast<void*>(narrowed->data()) : a, a);
        overflow_ |= !all_finite(narrowed ? static_cast<const void*>(narrowed->data()) : a, spec_.dtype, len);
      }
      pieces_.push_back(FinalPiece{sp.begin, len, buf});
      send(Phase::kAllGather, 0, k, buf->data(), buf->size(), buf);
    } else {
      Buffer fin = acc;  // fp32: the sum itself
      {
        Timer timer(times_.reduce_s);
        if (spec_.dtype != DType::kFloat32) {
          fin = pool_.acquire(static_cast<size_t>(len) * esize_);
          narrow(a, len, spec_.dtype, fin->data());
        }
        overflow_ |= !all_finite(fin->data(), spec_.dtype, len);
      }
      pieces_.push_back(FinalPiece{sp.begin, len, fin});
      send(Phase::kAllGather, 0, k, fin->data(), static_cast<size_t>(len) * esize_, fin);
    }
  }

  void all_gather_segment(int s, int c, int k) {
    const Span sp = segment(c, k);
    const int64_t len = sp.size();
    InFrame f = receive(Phase::kAllGather, s, k, int8_ ? int8_bytes(len) : len * static_cast<int64_t>(esize_));
    // Kept as it came; decoded into the caller's tensor once every check passed.
    pieces_.push_back(FinalPiece{sp.begin, len, f.payload});
    if (s < n_ - 2) {
      // Forward the owner's bytes verbatim (authenticated on arrival, sealed anew for the next link).
      Buffer buf = std::move(f.payload);
      send(Phase::kAllGather, s + 1, k, buf->data(), static_cast<size_t>(f.header.payload_len), buf);
    }
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
  const int left_;
  const int64_t unit_;
  const int64_t seg_;
  const size_t esize_;
  const uint32_t desc_;
  const std::string spec_text_;  // for the message when a neighbour's arguments differ
  const bool int8_;
  bool own_bad_ = false;
  uint64_t received_mask_ = 0;
  bool overflow_ = false;
  std::vector<FinalPiece> pieces_;   // final segments not yet written
  std::vector<FinalPiece> backups_;  // what the early writes replaced
};

}  // namespace

// Decodes one [scales | q] payload of `len` values into dst (len values of spec.dtype);
// non-fp32 dtypes go through `scratch` (len floats) and are rounded like narrow().
void decode_int8(const AllReduceSpec& spec, const char* payload, int64_t len, void* dst, float* scratch) {
  if (len == 0) return;
  const int64_t nb = codec::num_blocks(len, spec.block);
  const float* scales = reinterpret_cast<const float*>(payload);
  const int8_t* q = reinterpret_cast<const int8_t*>(payload + 4 * nb);
  if (spec.dtype == DType::kFloat32) {
    codec::dequantize(q, scales, len, spec.block, static_cast<float*>(dst));
  } else {
    codec::dequantize(q, scales, len, spec.block, scratch);
    narrow(scratch, len, spec.dtype, dst);
  }
}

void write_result(const AllReduceSpec& spec, const ScheduleOutcome& outcome, void* dst, BufferPool& pool) {
  const size_t esize = dtype_size(spec.dtype);
  const bool int8 = spec.codec == CodecKind::kInt8;
  Buffer scratch;
  if (int8 && spec.dtype != DType::kFloat32) {
    int64_t longest = 0;
    for (const FinalPiece& p : outcome.pieces) longest = std::max(longest, p.len);
    scratch = pool.acquire(static_cast<size_t>(longest) * 4);  // before the first write
  }
  char* out = static_cast<char*>(dst);
  for (const FinalPiece& p : outcome.pieces) {
    if (p.len == 0) continue;
    char* at = out + p.begin * static_cast<int64_t>(esize);
    if (int8) {
      decode_int8(spec, p.bytes->data(), p.len, at, scratch ? scratch->as<float>() : nullptr);
    } else {
      std::memcpy(at, p.bytes->data(), static_cast<size_t>(p.len) * esize);
    }
  }
}

int64_t partition_unit(const AllReduceSpec& spec) {
  return spec.codec == CodecKind::kInt8 ? spec.block : kExactUnit;
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
  const uint64_t block = spec.codec == CodecKind::kInt8 ? static_cast<uint64_t>(spec.block) : 0;
  std::memcpy(buf + 16, &block, 8);
  return crc32c(buf, sizeof(buf));
}

std::string describe_spec(const AllReduceSpec& spec) {
  StrBuilder s;
  s << "n=" << spec.n << ", dtype=" << dtype_name(spec.dtype) << ", op=" << (spec.op == ReduceOp::kSum ? "sum" : "avg")
    << ", codec=" << (spec.codec == CodecKind::kInt8 ? "int8" : "none");
  if (spec.codec == CodecKind::kInt8) s << ", block_size=" << spec.block;
  return s.str();
}

ScheduleOutcome run_all_reduce(Transport& transport, BufferPool& pool, const RingGeometry& geometry, uint64_t seq,
                               const AllReduceSpec& spec, const std::shared_ptr<WireCounters>& counters,
                               ScheduleTimes& times) {
  AllReduce job(transport, pool, geometry, seq, spec, counters, times);
  return job.run();
}

}  // namespace prime::ring
