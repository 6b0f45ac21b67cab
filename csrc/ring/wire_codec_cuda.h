// The wire codec for CUDA tensors: the bytes of wire_codec.h's block (int8, fp4), exact and
// topk codecs, computed on the tensor's GPU. Quantize, dequantize-add, the sums, the average and
// the final rounding run as CUDA kernels (csrc/codec/codec_cuda.h, ring_cuda.h) on a
// stream of the ring's own; only payload bytes cross PCIe, through pinned host
// memory, so the host CPU only moves bytes (and authenticates frames, in the
// transport). Compiled only in CUDA builds (setup.py: PRIME_WITH_CUDA).
//
// Per segment of the reduce-scatter: the received payload is copied into a pinned
// upload slot (one of several, reused once the GPU has read it: the copy of one
// segment overlaps the upload of the one before), uploaded, added to the own values,
// re-encoded, and downloaded into a pinned buffer that goes to the transport as it
// is (no host copy). The own chunk's encodes are all queued at once (prefetch_input)
// and handed out as each finishes. The final segments are gathered on the device
// (block codecs: the code and scale arrays of the whole tensor; exact: its values) as they are
// known, and written into the tensor with one pass once every check passed.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "wire_codec.h"

namespace prime::ring {

// Throws std::runtime_error("CUDA error in <what>: <message>") unless e is cudaSuccess.
void cuda_check(cudaError_t e, const char* what);

// Pinned host buffers, recycled (cudaHostAlloc is slow and cudaFreeHost synchronizes
// the device). A buffer returns here when its last reference goes, from any thread (the
// transport's sender, once the frame left). The pool keeps idle buffers up to the most
// it ever had in use at once (at least `min_cached_bytes`, at most `max_cached_bytes`):
// a ring's collectives repeat their sizes, so from the second one on nothing is
// allocated or freed. (A fixed 512 MiB cap made every all-reduce of a 1.5B-value
// tensor free and re-pin ~1 GiB in ~260 KiB pieces, the frees on the sender thread,
// which then stalled the wire: 1.57 s against 1.22 s at 10 Gbit/s.)
class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
  struct Key {};

 public:
  static std::shared_ptr<PinnedPool> create(size_t min_cached_bytes, size_t max_cached_bytes);
  PinnedPool(Key, size_t min_cached_bytes, size_t max_cached_bytes)
      : min_cached_(min_cached_bytes), max_cached_(max_cached_bytes) {}
  ~PinnedPool();
  Buffer acquire(size_t size);

 private:
  void release(char* p, size_t capacity);

  const size_t min_cached_;
  const size_t max_cached_;
  std::mutex mu_;
  std::multimap<size_t, char*> idle_;  // by capacity
  size_t cached_ = 0;  // bytes in idle_
  size_t live_ = 0;    // bytes handed out and not yet returned
  size_t peak_ = 0;    // the most live_ ever was
};

// One ring's resources on one GPU, shared by its collectives (a ring runs them one at a
// time): the stream, pinned staging, grow-only device buffers and recycled events.
// prime.comm.Ring makes one per device on first use (bindings: _CudaRingContext).
class CudaContext {
 public:
  explicit CudaContext(int device);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  PinnedPool& pinned() { return *pinned_; }

  // kPackedScales: an int8 payload's packed scales on their way to or from the host.
  // topk: kDropped, what this rank's selections dropped (the tensor's n values, for the
  // residual); kDecoded, the owner's selection of a segment's average, decoded.
  enum Slot : int { kUploadIn = 0, kAcc, kOut, kImageQ, kImageS, kFlags, kPackedScales, kDropped, kDecoded, kSlots };
  // Device memory of slot `slot`, at least `bytes` long. Growing waits for the stream
  // first (work queued earlier may still use the old buffer).
  char* device_buffer(Slot slot, size_t bytes);
  // Bytes of device memory the slots hold now (cudaMalloc'd: torch's memory statistics do
  // not see them; prime.memory adds them to the GPU peak it reports). Read from any thread.
  size_t device_bytes() const { return device_bytes_.load(std::memory_order_relaxed); }

  cudaEvent_t take_event();  // a timing event
  void give_event(cudaEvent_t e);

  // Pinned memory (64 bytes) the collective's flags are downloaded into (words 0, 1: own
  // input bad, result bad; bytes 16-31: the block codec's error sums, at the end of the collective).
  uint32_t* host_flags() { return host_flags_; }

  // How received payloads reach the GPU in the collectives submitted from now on (each
  // job copies it at submit: CudaJob::pageable_upload). false (default): the worker copies
  // each into a pinned upload slot, then one DMA; true: cudaMemcpyAsync straight from the
  // transport's (pageable) buffer, the driver staging it ($PRIME_RING_CUDA_UPLOAD=pageable).
  bool pageable_upload() const { return pageable_upload_; }
  void set_pageable_upload(bool on) { pageable_upload_ = on; }

 private:
  const int device_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<PinnedPool> pinned_;
  char* buffers_[kSlots] = {};
  size_t buffer_bytes_[kSlots] = {};
  std::atomic<size_t> device_bytes_{0};  // the sum of buffer_bytes_
  std::vector<cudaEvent_t> events_;
  uint32_t* host_flags_ = nullptr;
  bool pageable_upload_ = false;  // (set and read under the GIL, at submit)
};

struct CudaJob {
  std::shared_ptr<CudaContext> context;
  // Recorded on the caller's stream when the collective was submitted: the ring's
  // stream waits for it before reading the input (owned; null: read at once).
  cudaEvent_t input_ready = nullptr;
  // CudaContext::pageable_upload() when the collective was submitted.
  bool pageable_upload = false;
  CudaJob() = default;
  ~CudaJob();
  CudaJob(const CudaJob&) = delete;
  CudaJob& operator=(const CudaJob&) = delete;
};

std::unique_ptr<WireCodec> make_cuda_wire_codec(const AllReduceSpec& spec, ScheduleTimes& times);

// Times every kernel and copy the codec runs per segment, over n values at once on
// `device` (benchmarks/bench_ring_cuda_kernels.py): `iters` CUDA-event timings each,
// with the bytes the operation must move.
struct KernelTiming {
  std::string name;
  double bytes = 0;
  std::vector<double> ms;
};
std::vector<KernelTiming> time_kernels(int device, int64_t n, int64_t block, int iters);

}  // namespace prime::ring
