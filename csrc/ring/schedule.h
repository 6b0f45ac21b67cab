// The all-reduce schedules: reduce-scatter then all-gather over N chunks, each chunk
// cut into segments so that one segment is on the wire while the previous is reduced.
// They know only "send to a peer, receive from a peer" (transport.h) and walk steps,
// chunks and segments; what a payload holds and how it is added is the wire codec's
// (wire_codec.h), so every codec runs in both.
//
// Chunk c holds the partition units [c*U/N, (c+1)*U/N) of the U = ceil(n/unit) units
// (unit = the codec's: the block size for int8, 256 values otherwise).
//
//   ring    2(N-1) hops. Chunk c starts at the rank in ring position c, is summed
//           along the ring order, and the rank in position c-1 (its owner) computes
//           the final value, which the all-gather forwards verbatim around the ring.
//           Every hop re-encodes the partial sum.
//   direct  2 hops ("two-hop"). Rank c owns chunk c: every other rank sends it its
//           own values of chunk c, encoded once; the owner sums them in fp32 and
//           sends the encoded final value straight back to every rank.
//
// Both send every rank 2(N-1)/N of the tensor's encoded bytes; the ring pays 2(N-1)
// one-way delays in sequence, the direct schedule two.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "convert.h"
#include "timers.h"
#include "transport.h"

namespace prime::ring {

enum class ReduceOp : int { kSum = 0, kAvg = 1 };
enum class CodecKind : int { kNone = 0, kInt8 = 1, kFp4 = 2, kTopk = 3 };  // the frame descriptor's codec byte
enum class Schedule : int { kRing = 0, kDirect = 1 };

constexpr int64_t kExactUnit = 256;  // chunk/segment alignment of the exact codec (values)

// A collective on CUDA tensors (wire_codec_cuda.h; only CUDA builds make one): the
// ring's stream and staging on the tensor's GPU, and the event after which the input
// may be read.
struct CudaJob;
class WireCodec;

struct AllReduceSpec {
  const void* input = nullptr;  // n values of dtype; read only, and only during the reduce-scatter
  void* output = nullptr;       // unused by the schedule (write_result names its destination)
  // The caller's tensor (n values of dtype), or null. When set, the schedule writes each
  // final segment into it as soon as the segment is known, after saving the values it
  // overwrites, and puts those back before it returns with any failure (wire error,
  // close, non-finite input, overflow): the decode then overlaps the wire instead of
  // trailing it, and a failed collective still leaves the tensor as it was. The caller
  // must not read or write the tensor until the collective completed (as with NCCL).
  void* early_output = nullptr;
  int64_t n = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kAvg;
  CodecKind codec = CodecKind::kInt8;
  int64_t block = 64;  // values per block (int8, fp4) or per chunk (topk)
  // topk (docs/wire-format-sparse.md): values kept per chunk of each contribution (keep) and of
  // each owner's average (keep_average; 0: keep), and where the owner of a chunk adds what its
  // final encoding left out of the sum (n fp32 values; null: dropped). Added only once the
  // collective succeeded (WireCodec::commit), so a failed one leaves it as it was. Only the
  // direct schedule carries topk: a ring would select again at every hop.
  int64_t keep = 0;
  int64_t keep_average = 0;
  float* residual = nullptr;
  // The residual is the caller's scratch, zero on entry (prime.comm.Ring.all_reduce's `dropped`):
  // the GPU codec may write what was dropped into it during the collective instead of keeping
  // its own copy until commit (a failed collective then leaves it undefined).
  bool residual_scratch = false;
  Schedule schedule = Schedule::kRing;
  // int8: the codec adds its quantization error to ScheduleTimes (quant_err_sq, quant_in_sq).
  bool measure_error = true;
  // Set: input and output are device memory of that job's GPU, and the wire codec
  // (make_wire_codec) quantizes and reduces there; only payload bytes cross PCIe.
  std::shared_ptr<CudaJob> cuda;
};

struct RingGeometry {
  int rank = 0;
  int world_size = 1;
  int64_t segment_elems = 1 << 18;  // a multiple of every partition unit
  uint64_t job = 0;
  // The ring schedule's order: order[p] is the rank at position p (empty: 0, 1, ..., N-1).
  std::vector<int> order;
};

// What the schedule and its wire codec measured: the PRIME_RING_SCHEDULE_TIMERS of timers.h (which
// says what each counts), added to by ScopedTimer (wire_codec.h) and, for CUDA tensors, by the CUDA
// codec's finish(); Ring::execute copies them into WorkStats.
struct ScheduleTimes {
  PRIME_RING_SCHEDULE_TIMERS(PRIME_RING_TIMER_FIELD)
  // Not times: the int8 codecs' own quantization error (codec.h quantize_error_sq), summed
  // over every block this rank quantized (its input, each partial sum it re-encoded, the
  // final value it encoded as owner), float64. The CUDA codec adds them in finish().
  double quant_err_sq = 0;  // sum of (dequantize(quantize(x)) - x)^2
  double quant_in_sq = 0;   // sum of x^2
};

// One segment of the final result as it came off the wire (or, on its owner, as it
// went onto it): the wire codec's final payload (wire_codec.h).
struct FinalPiece {
  int64_t begin = 0;  // first value
  int64_t len = 0;    // values
  std::shared_ptr<const ByteBuffer> bytes;
};

struct ScheduleOutcome {
  uint64_t nonfinite_ranks = 0;  // bit r: rank r's input held NaN/Inf
  bool overflow = false;         // inputs finite, the sum (or its rounding to dtype) not
  // Every segment of the result, kept (not decoded) until every check passed, so that
  // write_result can decode straight into the caller's tensor: no staging tensor, no
  // commit copy (for int8 that is 16 MiB of wire bytes held instead of 64 MiB of fp32).
  std::vector<FinalPiece> pieces;
  // The codec that saw the pieces (a GPU codec already holds them on the device).
  std::shared_ptr<WireCodec> codec;
};

struct Span {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

Span chunk_span(int64_t n, int64_t unit, int world_size, int chunk);
uint32_t descriptor_of(const AllReduceSpec& spec);
const char* codec_name(CodecKind codec);
std::string describe_spec(const AllReduceSpec& spec);

// Writes the result (the n values of spec.dtype) into dst: decodes the pieces with
// the run's wire codec (every rank decodes the same bytes with the same code, so all
// end bit-identical; dst is device memory when spec.cuda is set). Allocates everything it needs before the first write,
// so it either throws before touching dst or writes all of it.
void write_result(const AllReduceSpec& spec, const ScheduleOutcome& outcome, void* dst, BufferPool& pool);

// Runs all-reduce number `seq` with spec.schedule. Writes nothing: returns the result's pieces and
// which ranks had non-finite input (the caller decides whether to write_result). Throws
// CommError on any wire failure.
ScheduleOutcome run_all_reduce(Transport& transport, BufferPool& pool, const RingGeometry& geometry, uint64_t seq,
                               const AllReduceSpec& spec, const std::shared_ptr<WireCounters>& counters,
                               ScheduleTimes& times);

}  // namespace prime::ring
