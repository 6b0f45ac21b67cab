// What the GPU wire codecs share (CUDA builds only; wire_codec_cuda.h): the ring's stream and
// its device flags, timing events, the pinned upload slots received payloads go through, the
// payloads downloaded behind the schedule's back (deferred: ready() waits for them), and the
// end of a collective (the GPU times, the error sums). The block and exact codecs
// (wire_codec_cuda.cu) and the sparse one (wire_codec_sparse_cuda.cu) add the formats.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "wire_codec_cuda.h"

namespace prime::ring::cuda_detail {

// Pinned upload slots: a received payload is copied into one while the GPU still reads
// the previous ones.
constexpr int kUploadSlots = 4;

class CudaCodecBase : public WireCodec {
 public:
  // measure: the codec adds its error sums (err_sums_) to the ScheduleTimes at finish().
  CudaCodecBase(const AllReduceSpec& spec, ScheduleTimes& times, bool measure);
  ~CudaCodecBase() override;

  void ready(const Payload& p, bool* finite) override;
  bool input_finite() const override { return !own_bad_; }
  void finish() override;
  void decode_final(const char*, int64_t, void*, float*) const override;  // replaced by write_result
  int64_t scratch_floats(int64_t) const override { return 0; }

 protected:
  static void check(cudaError_t e, const char* what) { cuda_check(e, what); }

  // An own segment's payload as prefetch_input queued it: the pinned buffer its download
  // goes to, and the event after that download (null for an empty segment).
  struct Prefetched {
    const void* own;
    int64_t len;
    Buffer host;
    cudaEvent_t done;
  };
  // The payload prefetch_input queued for (own, len), its download waited for. The
  // schedule announces every own segment first; other callers (the test hooks) get the
  // segment prefetched now, one at a time.
  Prefetched take_prefetched(const void* own, int64_t len);
  // The end of a non-empty prefetch_input: downloads the own segment's payload (`bytes` at
  // device `src`, made by the kernels since event a) into p's pinned buffer, records p.done,
  // and times the kernels as gpu_codec and the copy as d2h.
  void download_prefetched(Prefetched& p, cudaEvent_t a, const char* src, int64_t len, size_t bytes);

  cudaEvent_t record();  // an event recorded on the stream now (returned to the context at the end)
  void span(double* sink, cudaEvent_t a, cudaEvent_t b) { spans_.push_back(Span{sink, a, b}); }
  void wait_for(cudaEvent_t e);  // counted as gpu_wait_s

  // Copies host bytes into the next pinned upload slot (once the GPU has read what it
  // held) and returns it; the caller enqueues the uploads from it, then staged_done().
  const char* stage(const char* src, size_t bytes);
  void staged_done();

  // Copies the device payload of len values (`bytes` on the wire) into pinned `host`, then
  // the flags. The default copies the bytes as they are.
  virtual void download(char* host, const char* device, int64_t len, size_t bytes);
  // Downloads `bytes` from device memory (the kernels since kernels_from_ made them) into
  // a fresh pinned buffer and returns it as a deferred payload: ready() waits for it.
  Payload send_from_device(const char* src, size_t bytes, int64_t len);

  std::shared_ptr<CudaJob> job_;  // keeps the context and the input event alive
  CudaContext& ctx_;
  const cudaStream_t stream_;
  const bool measure_;
  ScheduleTimes* times_;

  // Byte offset of the two error sums (device doubles: error, input) in the flags
  // buffer, and of their copy in the context's pinned host_flags (64 bytes each).
  static constexpr size_t kErrSumsOffset = 16;
  uint32_t* flags_ = nullptr;   // device: [own input bad, result bad, ignored, decode fault], OR-accumulated
  double* err_sums_ = nullptr;  // device: the error sums (ScheduleTimes::quant_err_sq, quant_in_sq)
  cudaEvent_t kernels_from_ = nullptr;  // the first event of the kernels of the payload being made
  bool own_bad_ = false;
  double gpu_codec_ = 0, h2d_ = 0, d2h_ = 0, staging_ = 0;
  std::deque<Prefetched> prefetched_;  // prefetch_input appends (released after the destructor's wait)

 private:
  struct Inflight {
    const ByteBuffer* owner;  // the payload's pinned buffer
    cudaEvent_t done;         // recorded after its download
  };
  struct Span {
    double* sink;
    cudaEvent_t a, b;
  };
  struct UploadSlot {
    Buffer host;
    cudaEvent_t read = nullptr;  // recorded after the last upload from host
    bool pending = false;
  };

  std::deque<Inflight> inflight_;  // deferred payloads, in order
  UploadSlot slots_[kUploadSlots];
  int next_slot_ = 0;
  std::vector<Span> spans_;
  std::vector<cudaEvent_t> used_;
};

// The topk codec on the GPU (wire_codec_sparse_cuda.cu).
std::unique_ptr<WireCodec> make_cuda_sparse_codec(const AllReduceSpec& spec, ScheduleTimes& times);

}  // namespace prime::ring::cuda_detail
