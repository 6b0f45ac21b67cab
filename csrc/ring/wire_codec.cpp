#include "wire_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "../codec/codec.h"
#include "../codec/sparse.h"
#include "convert.h"
#ifdef PRIME_WITH_CUDA
#include "wire_codec_cuda.h"
#endif

namespace prime::ring {

void WireCodec::divide(float* acc, int64_t len, float d) { ring::divide(acc, len, d); }

void WireCodec::write_result(const std::vector<FinalPiece>& pieces, void* dst, size_t esize, BufferPool& pool) {
  int64_t longest = 0;
  for (const FinalPiece& p : pieces) longest = std::max(longest, p.len);
  Buffer scratch;  // before the first write
  if (const int64_t floats = scratch_floats(longest)) scratch = pool.acquire(static_cast<size_t>(floats) * 4);
  char* out = static_cast<char*>(dst);
  for (const FinalPiece& p : pieces) {
    if (p.len == 0) continue;
    decode_final(p.bytes->data(), p.len, out + p.begin * static_cast<int64_t>(esize),
                 scratch ? scratch->as<float>() : nullptr);
  }
}

void pack_int8_scales(const float* scales, int64_t nb, char* out) {
  if (nb <= 0) return;
  int32_t top = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const float s = scales[b];
    if (s > 0.f) top = std::max(top, codec::grid_index(float_bits(s)));  // NaN compares false
  }
  const uint16_t header = static_cast<uint16_t>(top);
  std::memcpy(out, &header, 2);  // little-endian hosts only, as the whole frame
  uint8_t* bytes = reinterpret_cast<uint8_t*>(out + codec::kPackedHeaderBytes);
  for (int64_t b = 0; b < nb; ++b) {
    const float s = scales[b];
    const int32_t steps = top - codec::grid_index(float_bits(s));
    bytes[b] = std::isnan(s)                                  ? codec::kPackedNaN
               : s > 0.f && steps <= codec::kPackedMaxSteps ? static_cast<uint8_t>(steps)
                                                             : codec::kPackedZero;
  }
}

void unpack_int8_scales(const char* in, int64_t nb, float* scales) {
  if (nb <= 0) return;  // an empty payload has no header
  uint16_t header;
  std::memcpy(&header, in, 2);
  const int32_t top = header;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(in + codec::kPackedHeaderBytes);
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t d = bytes[b];
    const int32_t k = top - d;
    uint32_t bits;
    if (d == codec::kPackedZero) {
      bits = 0;
    } else if (d == codec::kPackedNaN || k < codec::kGridSteps || k >= codec::kGridIndexEnd) {
      bits = 0x7fc00000u;
    } else {
      bits = codec::grid_value(k);
    }
    std::memcpy(scales + b, &bits, 4);
  }
}

namespace {

// The element codes of docs/wire-format.md's block formats, for BlockCodec.
struct Int8Format {
  using Code = int8_t;
  static constexpr bool kPackedScales = true;  // 1 byte a scale after a 2-byte header
  static int64_t scale_bytes(int64_t nb) { return int8_scale_bytes(nb); }
  static int64_t code_bytes(int64_t len) { return len; }
  static int64_t quantize(const void* x, codec::InputType type, int64_t len, int64_t block, Code* q, float* scales) {
    return codec::quantize(x, type, len, block, q, scales);
  }
  static void dequantize(const Code* q, const float* scales, int64_t len, int64_t block, float* y) {
    codec::dequantize(q, scales, len, block, y);
  }
  static void dequantize_add(float* acc, const Code* q, const float* scales, int64_t len, int64_t block) {
    codec::dequantize_add(acc, q, scales, len, block);
  }
  static void error_sq(const void* x, codec::InputType type, const Code* q, const float* scales, int64_t len,
                       int64_t block, double* err, double* ref) {
    codec::quantize_error_sq(x, type, q, scales, len, block, err, ref);
  }
};

struct Fp4Format {
  using Code = uint8_t;
  static constexpr bool kPackedScales = false;  // fp32 scales, read in place
  static int64_t scale_bytes(int64_t nb) { return 4 * nb; }
  static int64_t code_bytes(int64_t len) { return codec::fp4_bytes(len); }
  static int64_t quantize(const void* x, codec::InputType type, int64_t len, int64_t block, Code* q, float* scales) {
    return codec::quantize_fp4(x, type, len, block, q, scales);
  }
  static void dequantize(const Code* q, const float* scales, int64_t len, int64_t block, float* y) {
    codec::dequantize_fp4_as(q, scales, len, block, y, codec::InputType::kFloat32);
  }
  static void dequantize_add(float* acc, const Code* q, const float* scales, int64_t len, int64_t block) {
    codec::dequantize_add_fp4(acc, q, scales, len, block);
  }
  static void error_sq(const void* x, codec::InputType type, const Code* q, const float* scales, int64_t len,
                       int64_t block, double* err, double* ref) {
    codec::quantize_error_sq_fp4(x, type, q, scales, len, block, err, ref);
  }
};

// docs/wire-format.md's block codecs (Format: int8 or fp4). Every hop quantizes its fp32
// partial sum; the owner quantizes the final value once and every rank decodes those
// same bytes.
template <class Format>
class BlockCodec final : public WireCodec {
 public:
  BlockCodec(const AllReduceSpec& spec, BufferPool& pool, ScheduleTimes& times)
      : dtype_(spec.dtype), block_(spec.block), measure_(spec.measure_error), pool_(pool), times_(times) {}

  int64_t unit() const override { return block_; }
  int64_t partial_bytes(int64_t len) const override {
    return scales_bytes(len) + Format::code_bytes(len);
  }
  int64_t final_bytes(int64_t len) const override { return partial_bytes(len); }

  Payload encode_input(const void* own, int64_t len, bool* finite) override {
    int64_t bad = 0;
    Buffer buf = quantize(own, static_cast<codec::InputType>(dtype_), len, &bad);
    *finite = bad == 0;
    return Payload{buf->data(), buf->size(), buf};
  }

  bool accumulate(const void* own, const char* payload, int64_t len, float* acc) override {
    const bool finite = widen(own, dtype_, len, acc);
    Buffer hold;
    Format::dequantize_add(acc, codes(payload, len), scales(payload, len, &hold), len, block_);
    return finite;
  }

  void add_partial(const char* payload, int64_t len, float* acc) override {
    Buffer hold;
    Format::dequantize_add(acc, codes(payload, len), scales(payload, len, &hold), len, block_);
  }

  Payload encode_partial(const Buffer& acc, int64_t len) override {
    int64_t bad = 0;  // a non-finite partial sum needs non-finite input, already flagged
    Buffer buf = quantize(acc->data(), codec::InputType::kFloat32, len, &bad);
    return Payload{buf->data(), buf->size(), buf};
  }

  Payload encode_final(const Buffer& acc, int64_t len, bool* finite) override {
    int64_t bad = 0;
    Buffer buf = quantize(acc->data(), codec::InputType::kFloat32, len, &bad);
    ScopedTimer timer(times_.reduce_s);
    // Every rank writes decode(these bytes): check now, on that same decode, that it is
    // finite, so the flag reaches every rank in the all-gather headers before anyone
    // writes. `acc` is free once quantized.
    float* a = acc->as<float>();
    Buffer narrowed;
    if (dtype_ != DType::kFloat32) narrowed = pool_.acquire(static_cast<size_t>(len) * dtype_size(dtype_));
    void* out = narrowed ? static_cast<void*>(narrowed->data()) : a;
    decode_final(buf->data(), len, out, a);
    *finite = bad == 0 && all_finite(out, dtype_, len);
    return Payload{buf->data(), buf->size(), buf};
  }

  void decode_final(const char* payload, int64_t len, void* dst, float* scratch) const override {
    if (len == 0) return;
    Buffer hold;
    const float* s = scales(payload, len, &hold);
    if (dtype_ == DType::kFloat32) {
      Format::dequantize(codes(payload, len), s, len, block_, static_cast<float*>(dst));
    } else {
      Format::dequantize(codes(payload, len), s, len, block_, scratch);
      narrow(scratch, len, dtype_, dst);
    }
  }

  int64_t scratch_floats(int64_t len) const override { return dtype_ == DType::kFloat32 ? 0 : len; }

 private:
  using Code = typename Format::Code;

  // The payload layout: scales first, then the codes.
  int64_t scales_bytes(int64_t len) const { return Format::scale_bytes(codec::num_blocks(len, block_)); }
  // The payload's scales as fp32: in place (fp4), or unpacked from their bytes into a pool
  // buffer that *hold keeps (int8; n/B values, cheap).
  const float* scales(const char* payload, int64_t len, Buffer* hold) const {
    if constexpr (!Format::kPackedScales) {
      return reinterpret_cast<const float*>(payload);
    } else {
      const int64_t nb = codec::num_blocks(len, block_);
      *hold = pool_.acquire(static_cast<size_t>(nb) * 4);
      unpack_int8_scales(payload, nb, (*hold)->as<float>());
      return (*hold)->as<float>();
    }
  }
  const Code* codes(const char* payload, int64_t len) const {
    return reinterpret_cast<const Code*>(payload + scales_bytes(len));
  }

  Buffer quantize(const void* x, codec::InputType type, int64_t len, int64_t* bad_blocks) {
    ScopedTimer timer(times_.quantize_s);
    Buffer buf = pool_.acquire(static_cast<size_t>(partial_bytes(len)));
    Code* q = reinterpret_cast<Code*>(buf->data() + scales_bytes(len));
    // fp32 scales go straight into the payload; packed ones through a pool buffer
    Buffer wide;
    float* s = buf->as<float>();
    if constexpr (Format::kPackedScales) {
      wide = pool_.acquire(static_cast<size_t>(codec::num_blocks(len, block_)) * 4);
      s = wide->as<float>();
    }
    *bad_blocks = Format::quantize(x, type, len, block_, q, s);
    // While x is still in cache: the error this encode makes (the ring reports it, so
    // DiLoCo needs no round-trip pass of its own). The codec's error, before packing sends
    // int8 blocks far below the payload's largest as zeros, as the GPU codec measures it.
    if (measure_) Format::error_sq(x, type, q, s, len, block_, &times_.quant_err_sq, &times_.quant_in_sq);
    if constexpr (Format::kPackedScales) pack_int8_scales(s, codec::num_blocks(len, block_), buf->data());
    return buf;
  }

  const DType dtype_;
  const int64_t block_;
  const bool measure_;  // add the quantization error to times_
  BufferPool& pool_;
  ScheduleTimes& times_;
};

// Exact values. Partial sums travel as fp32 whatever the dtype (bf16 / fp16 are
// widened: no rounding to 8 or 11 bits at every hop); the owner rounds the final
// sum to the dtype once.
class ExactCodec final : public WireCodec {
 public:
  ExactCodec(const AllReduceSpec& spec, BufferPool& pool, ScheduleTimes& times)
      : dtype_(spec.dtype), esize_(dtype_size(spec.dtype)), pool_(pool), times_(times) {}

  int64_t unit() const override { return kExactUnit; }
  int64_t partial_bytes(int64_t len) const override { return 4 * len; }
  int64_t final_bytes(int64_t len) const override { return len * static_cast<int64_t>(esize_); }

  Payload encode_input(const void* own, int64_t len, bool* finite) override {
    if (dtype_ == DType::kFloat32) {
      {
        ScopedTimer timer(times_.reduce_s);
        *finite = all_finite(own, dtype_, len);
      }
      // Zero copy: the input outlives the collective's final flush.
      return Payload{static_cast<const char*>(own), static_cast<size_t>(len) * 4, nullptr};
    }
    Buffer buf = pool_.acquire(static_cast<size_t>(len) * 4);
    {
      ScopedTimer timer(times_.reduce_s);
      *finite = widen(own, dtype_, len, buf->as<float>());
    }
    return Payload{buf->data(), buf->size(), buf};
  }

  bool accumulate(const void* own, const char* payload, int64_t len, float* acc) override {
    return add_widened(own, dtype_, reinterpret_cast<const float*>(payload), len, acc);
  }

  void add_partial(const char* payload, int64_t len, float* acc) override {
    // (A partial sum is finite unless some input was not, which its rank flagged.)
    add_widened(acc, DType::kFloat32, reinterpret_cast<const float*>(payload), len, acc);
  }

  Payload encode_partial(const Buffer& acc, int64_t len) override {
    return Payload{acc->data(), static_cast<size_t>(len) * 4, acc};
  }

  Payload encode_final(const Buffer& acc, int64_t len, bool* finite) override {
    Buffer fin = acc;  // fp32: the sum itself
    ScopedTimer timer(times_.reduce_s);
    if (dtype_ != DType::kFloat32) {
      fin = pool_.acquire(static_cast<size_t>(len) * esize_);
      narrow(acc->as<float>(), len, dtype_, fin->data());
    }
    *finite = all_finite(fin->data(), dtype_, len);
    return Payload{fin->data(), static_cast<size_t>(len) * esize_, fin};
  }

  void decode_final(const char* payload, int64_t len, void* dst, float*) const override {
    std::memcpy(dst, payload, static_cast<size_t>(len) * esize_);
  }

  int64_t scratch_floats(int64_t) const override { return 0; }

 private:
  const DType dtype_;
  const size_t esize_;
  BufferPool& pool_;
  ScheduleTimes& times_;
};

// docs/wire-format-sparse.md's records (fp32 only), in the direct schedule: each rank selects
// its own values of every other rank's chunk once; the owner adds them to its own values in
// fp32, divides, selects the result once (keep_average values a chunk). AllReduceSpec::residual
// gets what this rank's contribution lost: what each selection of its values left out, and for
// the chunk it owns what the selection of the average left out (times the divisor: in the
// units of the contributions). Every payload read is checked to be well formed before it is decoded.
class SparseCodec final : public WireCodec {
 public:
  SparseCodec(const AllReduceSpec& spec, BufferPool& pool, ScheduleTimes& times)
      : chunk_(spec.block), k_(spec.keep), k_avg_(spec.keep_average ? spec.keep_average : spec.keep),
        input_(static_cast<const float*>(spec.input)), residual_(spec.residual), measure_(spec.measure_error),
        pool_(pool), times_(times) {
    if (spec.dtype != DType::kFloat32) throw std::invalid_argument("the topk codec takes float32 tensors only");
    if (!codec::sparse::valid_chunk(chunk_) || !codec::sparse::valid_keep(chunk_, k_) ||
        !codec::sparse::valid_keep(chunk_, k_avg_)) {
      throw std::invalid_argument("topk: chunk must be a power of two from 16 to 4096 and k in [1, chunk]");
    }
  }

  int64_t unit() const override { return chunk_; }
  int64_t partial_bytes(int64_t len) const override { return codec::sparse::payload_bytes(len, chunk_, k_); }
  int64_t final_bytes(int64_t len) const override { return codec::sparse::payload_bytes(len, chunk_, k_avg_); }

  Payload encode_input(const void* own, int64_t len, bool* finite) override {
    const float* x = static_cast<const float*>(own);
    Buffer buf = encode(x, len, k_, finite);
    if (*finite && len && residual_ && input_) {
      // What the selection left out of this rank's values (none of an input that is already
      // a decoded payload), kept beside the owners' drops until the collective succeeded.
      ScopedTimer timer(times_.quantize_s);
      Buffer dec = pool_.acquire(static_cast<size_t>(len) * 4);
      float* d = dec->as<float>();
      codec::sparse::decode(reinterpret_cast<const uint8_t*>(buf->data()), len, chunk_, k_, d);
      for (int64_t i = 0; i < len; ++i) d[i] = x[i] - d[i];
      dropped_.push_back(FinalPiece{x - input_, len, std::move(dec)});
    }
    return Payload{buf->data(), buf->size(), buf};
  }

  bool accumulate(const void* own, const char* payload, int64_t len, float* acc) override {
    const bool finite = all_finite(own, DType::kFloat32, len);
    if (len) std::memcpy(acc, own, static_cast<size_t>(len) * 4);
    add_partial(payload, len, acc);
    return finite;
  }

  void add_partial(const char* payload, int64_t len, float* acc) override {
    const uint8_t* p = bytes(payload, len, k_);
    codec::sparse::decode_add(p, len, chunk_, k_, acc);
  }

  Payload encode_partial(const Buffer&, int64_t) override {
    throw std::logic_error("internal: the topk codec has no partial sums (direct schedule only)");
  }

  Payload encode_final(const Buffer& acc, int64_t len, bool* finite) override {
    Buffer buf = encode(acc->as<float>(), len, k_avg_, finite);
    if (*finite && len && (measure_ || residual_)) {
      // What every rank will decode, beside what it stands for: the error the ring reports
      // (quant_err_sq / quant_in_sq: the contributions' encodes are not counted, with error
      // feedback they lose nothing) and what this owner's residual keeps. One decode for both.
      ScopedTimer timer(times_.reduce_s);
      Buffer dec = pool_.acquire(static_cast<size_t>(len) * 4);
      float* d = dec->as<float>();
      codec::sparse::decode(reinterpret_cast<const uint8_t*>(buf->data()), len, chunk_, k_avg_, d);
      const float* a = acc->as<float>();
      if (measure_) {
        double err = 0, ref = 0;
        for (int64_t i = 0; i < len; ++i) {
          const double e = static_cast<double>(d[i]) - static_cast<double>(a[i]);
          err += e * e;
          ref += static_cast<double>(a[i]) * static_cast<double>(a[i]);
        }
        times_.quant_err_sq += err;
        times_.quant_in_sq += ref;
      }
      if (residual_) {
        for (int64_t i = 0; i < len; ++i) d[i] = (a[i] - d[i]) * divisor_;
        pending_ = std::move(dec);
      }
    }
    return Payload{buf->data(), buf->size(), buf};
  }

  void final_known(const FinalPiece& piece, bool encoded_here) override {
    if (encoded_here) {
      if (pending_) dropped_.push_back(FinalPiece{piece.begin, piece.len, std::move(pending_)});
      pending_.reset();
    } else {
      bytes(piece.bytes->data(), piece.len, k_avg_);  // checked now, decoded when the result is written
    }
  }

  void decode_final(const char* payload, int64_t len, void* dst, float*) const override {
    codec::sparse::decode(reinterpret_cast<const uint8_t*>(payload), len, chunk_, k_avg_, static_cast<float*>(dst));
  }
  int64_t scratch_floats(int64_t) const override { return 0; }

  void divide(float* acc, int64_t len, float d) override {
    divisor_ = d;
    WireCodec::divide(acc, len, d);
  }

  void commit() override {
    for (const FinalPiece& p : dropped_) {
      const float* d = p.bytes->as<float>();
      float* r = residual_ + p.begin;
      for (int64_t i = 0; i < p.len; ++i) r[i] += d[i];
    }
    dropped_.clear();
  }

 private:
  // The payload of x[0, len); on input that is not finite, or whose chunk overflows bf16, a
  // well-formed payload of zeros (the frame's flags say why the result will be discarded).
  Buffer encode(const float* x, int64_t len, int64_t k, bool* finite) {
    ScopedTimer timer(times_.quantize_s);
    Buffer buf = pool_.acquire(static_cast<size_t>(codec::sparse::payload_bytes(len, chunk_, k)));
    uint8_t* out = reinterpret_cast<uint8_t*>(buf->data());
    *finite = codec::sparse::encode(x, len, chunk_, k, out) == codec::sparse::EncodeStatus::kOk;
    if (!*finite) {
      std::vector<float> zeros(static_cast<size_t>(len), 0.f);
      codec::sparse::encode(zeros.data(), len, chunk_, k, out);
    }
    return buf;
  }

  // A received payload, checked: positions ascending inside every chunk.
  const uint8_t* bytes(const char* payload, int64_t len, int64_t k) const {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(payload);
    if (!codec::sparse::well_formed(p, len, chunk_, k)) {
      throw std::runtime_error("a topk payload has positions that are not ascending inside a chunk");
    }
    return p;
  }

  const int64_t chunk_;
  const int64_t k_;
  const int64_t k_avg_;  // values kept per chunk of the owner's average
  const float* const input_;  // the schedule's input (where encode_input's pieces sit)
  float* const residual_;
  const bool measure_;  // add the error of the owner's selections to times_
  BufferPool& pool_;
  ScheduleTimes& times_;
  float divisor_ = 1.f;
  std::shared_ptr<const ByteBuffer> pending_;  // the dropped values of the last encode_final
  std::vector<FinalPiece> dropped_;            // (begin, len, fp32 values) for commit()
};

}  // namespace

std::unique_ptr<WireCodec> make_wire_codec(const AllReduceSpec& spec, BufferPool& pool, ScheduleTimes& times) {
#ifdef PRIME_WITH_CUDA
  if (spec.cuda) return make_cuda_wire_codec(spec, times);
#else
  if (spec.cuda) throw std::logic_error("internal: a collective on CUDA memory in a build without CUDA");
#endif
  if (spec.codec == CodecKind::kInt8) return std::make_unique<BlockCodec<Int8Format>>(spec, pool, times);
  if (spec.codec == CodecKind::kFp4) return std::make_unique<BlockCodec<Fp4Format>>(spec, pool, times);
  if (spec.codec == CodecKind::kTopk) return std::make_unique<SparseCodec>(spec, pool, times);
  return std::make_unique<ExactCodec>(spec, pool, times);
}

}  // namespace prime::ring
