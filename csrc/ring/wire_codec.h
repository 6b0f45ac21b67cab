// What travels in a data frame's payload, and how a rank folds it into its sums:
// the ring's one seam for the data format. schedule.cpp walks steps, chunks and
// segments and asks a WireCodec for every byte it sends and every value it adds,
// so it never branches on the codec (as gloo injects its reduction).
//
// Four implementations (make_wire_codec picks one from the spec):
//   int8   docs/wire-format.md's int8 block codec. Payload of `len` values:
//          [2 bytes: the largest grid index K of its scales, little-endian][ceil(len/B)
//          1-byte scales: K - k for a scale of grid index k][len int8 values], in both phases.
//   fp4    its fp4 block codec: [ceil(len/B) fp32 scales][ceil(len/2) bytes, two E2M1
//          codes each, value 2j in the low nibble], in both phases.
//   topk   docs/wire-format-sparse.md's sparse records, in both phases, direct schedule
//          only: every contribution is selected once by its sender, each sum once by its
//          owner (fp32 input only).
//   exact  reduce-scatter: `len` fp32 partial sums; all-gather: `len` values of the
//          tensor's dtype (the owner rounds the final sum once).
//
// Accumulation is always in fp32: the schedule hands the codec an fp32 buffer.
//
// CUDA builds add one more, for CUDA tensors (spec.cuda set; wire_codec_cuda.h): the
// same bytes, computed on the tensor's GPU. Its accumulator lives on the device (the
// schedule's host `acc` buffers are then only placeholders), which is why dividing by
// the world size and writing the result are the codec's too.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "../codec/scale_grid.h"
#include "buffer_pool.h"
#include "deadline.h"
#include "schedule.h"

namespace prime::ring {

// Adds the lifetime of the scope to a seconds counter of ScheduleTimes.
class ScopedTimer {
 public:
  explicit ScopedTimer(double& sink) : sink_(sink), t0_(Clock::now()) {}
  ~ScopedTimer() { sink_ += seconds_since(t0_); }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  double& sink_;
  Clock::time_point t0_;
};

// Bytes to send: `data` stays valid while `owner` lives (owner null: memory the
// collective keeps alive until its final flush, i.e. the caller's input).
struct Payload {
  const char* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const ByteBuffer> owner;
  // The bytes are still being produced (a GPU codec's download in flight): the schedule
  // calls the codec's ready() before the payload is sent, and meanwhile reads and
  // enqueues the next segment, so the GPU works while this one waits for the wire.
  bool deferred = false;
};

class WireCodec {
 public:
  virtual ~WireCodec() = default;

  // Chunks and segments start at multiples of this many values.
  virtual int64_t unit() const = 0;
  // Payload bytes of `len` values: a partial sum (reduce-scatter), the final value (all-gather).
  virtual int64_t partial_bytes(int64_t len) const = 0;
  virtual int64_t final_bytes(int64_t len) const = 0;

  // Reduce-scatter step 0: this rank's own `len` values (of the spec's dtype).
  // *finite is false when they hold NaN or Inf.
  virtual Payload encode_input(const void* own, int64_t len, bool* finite) = 0;
  // acc[0, len) = own values + decode(payload). Returns false when the own values
  // hold NaN or Inf.
  virtual bool accumulate(const void* own, const char* payload, int64_t len, float* acc) = 0;
  // acc[0, len) += decode(payload), a partial-format payload: another rank's contribution
  // to a sum accumulate() started (the direct schedule's owner adds N-1 of them).
  virtual void add_partial(const char* payload, int64_t len, float* acc) = 0;
  // A partial sum (acc holds `len` fp32 values) for the next hop.
  virtual Payload encode_partial(const Buffer& acc, int64_t len) = 0;
  // The owner's final value (acc, `len` fp32 values, may be overwritten) as every rank
  // will decode it. *finite is false when that decoded result is not finite (overflow).
  virtual Payload encode_final(const Buffer& acc, int64_t len, bool* finite) = 0;

  // Writes the `len` values of a final payload into dst (the spec's dtype). `scratch`
  // holds scratch_floats(len) floats (null when that is 0).
  virtual void decode_final(const char* payload, int64_t len, void* dst, float* scratch) const = 0;
  virtual int64_t scratch_floats(int64_t len) const = 0;

  // Hooks with host defaults (the GPU codec overrides them):
  // the schedule is about to encode_input these own values (one call per segment, in
  // the order of the encode_input calls that follow): the codec may start early.
  virtual void prefetch_input(const void* own, int64_t len) {}
  // Waits until a deferred payload's bytes exist (encode_partial and encode_final may
  // return one). *finite: false when the final value it carries is not finite (what
  // encode_final reports otherwise; encode_final then says true).
  virtual void ready(const Payload& p, bool* finite) {}
  // acc[0, len) /= d (the average, on the owner).
  virtual void divide(float* acc, int64_t len, float d);
  // False once this rank's own input was seen to hold NaN or Inf by work that
  // accumulate() only started (the host codecs report it through return values).
  virtual bool input_finite() const { return true; }
  // A final segment is known: `encoded_here` (the owner's encode_final just made it)
  // or received in the all-gather.
  virtual void final_known(const FinalPiece& piece, bool encoded_here) {}
  // Every frame was sent: the collective's work on this rank is done (the GPU codec
  // waits for its stream and adds its GPU times). The ScheduleTimes are not touched after.
  virtual void finish() {}
  // The collective succeeded and its result is about to be written: commit what the codec
  // keeps beside it (the topk codec's residual, AllReduceSpec::residual).
  virtual void commit() {}
  // Writes the result into dst (the n values of the spec's dtype, `esize` bytes each)
  // from every final piece. The default decodes each piece with decode_final.
  virtual void write_result(const std::vector<FinalPiece>& pieces, void* dst, size_t esize, BufferPool& pool);
};

// int8 payload scales (docs/wire-format.md, "On the wire"; the byte codes in
// ../codec/scale_grid.h): bytes of the scales of nb blocks (none for an empty payload).
inline int64_t int8_scale_bytes(int64_t nb) { return nb > 0 ? codec::kPackedHeaderBytes + nb : 0; }
// out[0, int8_scale_bytes(nb)) = the scales (nothing for nb = 0). A scale more than 253 steps below K
// (a block whose largest value is below about 2^-14 of the payload's largest) travels as 0;
// the owner decodes its final value from these bytes too, so it sees what its peers see.
void pack_int8_scales(const float* scales, int64_t nb, char* out);
// scales[b] = the fp32 scale of block b of packed scales `in`, b < nb; an index outside the
// grid (a header no encoder writes) decodes as the NaN flag.
void unpack_int8_scales(const char* in, int64_t nb, float* scales);

// The codec of spec.codec for spec's dtype and block size (on the GPU when spec.cuda is
// set). Encoding time is added to times.quantize_s, widening, narrowing and checks to
// times.reduce_s.
std::unique_ptr<WireCodec> make_wire_codec(const AllReduceSpec& spec, BufferPool& pool, ScheduleTimes& times);

}  // namespace prime::ring
