// The topk codec on the GPU: wire_codec.cpp's SparseCodec (docs/wire-format-sparse.md's records,
// direct schedule only) with its selections, decodes and sums on the tensor's device
// (../codec/sparse_cuda.h), so the host only moves the compact payloads. The bytes are the CPU
// codec's, bit for bit, and so is the result and what the residual gets.
//
// Per contribution (another rank's segment): encode on the device, download; what the selection
// dropped (own values minus the decoded record) goes into the context's kDropped buffer at the
// segment's place. Per own segment: the own values widened into the accumulator (with the finite
// check), each received record checked on the host (well formed) and then uploaded and added,
// the sum divided, the average encoded and downloaded; what that selection dropped, times the
// divisor, goes into kDropped too. The final records gather in an image on the device, decoded
// into the tensor with one pass once every check passed; kDropped is added to the residual
// (AllReduceSpec::residual, device memory) only when the collective succeeded, or with
// residual_scratch the dropped values go straight into the caller's zeroed scratch.
#include <cuda_runtime.h>

#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../codec/ring_cuda.h"
#include "../codec/sparse.h"
#include "../codec/sparse_cuda.h"
#include "cuda_codec_base.h"

namespace prime::ring::cuda_detail {
namespace {

namespace sparse = codec::sparse;

class CudaSparseCodec final : public CudaCodecBase {
 public:
  CudaSparseCodec(const AllReduceSpec& spec, ScheduleTimes& times)
      : CudaCodecBase(spec, times, spec.measure_error),
        chunk_(spec.block),
        k_(spec.keep),
        k_avg_(spec.keep_average ? spec.keep_average : spec.keep),
        n_(spec.n),
        input_(static_cast<const float*>(spec.input)),
        residual_(spec.residual) {
    if (spec.dtype != DType::kFloat32) throw std::invalid_argument("the topk codec takes float32 tensors only");
    if (!sparse::valid_chunk(chunk_) || !sparse::valid_keep(chunk_, k_) || !sparse::valid_keep(chunk_, k_avg_)) {
      throw std::invalid_argument("topk: chunk must be a power of two from 16 to 4096 and k in [1, chunk]");
    }
    // Allocated now: growing later would wait for the stream.
    image_ = reinterpret_cast<uint8_t*>(ctx_.device_buffer(CudaContext::kImageQ,
                                                           static_cast<size_t>(final_bytes(n_))));
    if (residual_ && n_ > 0) {
      // The caller's scratch takes what is dropped as it is known; a residual proper only once the
      // collective succeeded (commit), from a buffer of the context's.
      dropped_ = spec.residual_scratch
                     ? residual_
                     : reinterpret_cast<float*>(ctx_.device_buffer(CudaContext::kDropped, static_cast<size_t>(n_) * 4));
      check(cudaMemsetAsync(dropped_, 0, static_cast<size_t>(n_) * 4, stream_), "cudaMemsetAsync (dropped)");
    }
  }

  int64_t unit() const override { return chunk_; }
  int64_t partial_bytes(int64_t len) const override { return sparse::payload_bytes(len, chunk_, k_); }
  int64_t final_bytes(int64_t len) const override { return sparse::payload_bytes(len, chunk_, k_avg_); }

  void prefetch_input(const void* own, int64_t len) override {
    Prefetched p{own, len, ctx_.pinned().acquire(static_cast<size_t>(partial_bytes(len))), nullptr};
    if (len > 0) {
      const float* x = static_cast<const float*>(own);
      uint8_t* out = out_buffer(partial_bytes(len));
      cudaEvent_t a = record();
      check(sparse::cuda::encode(x, len, chunk_, k_, out, status(0), 0, stream_), "sparse encode (own values)");
      if (dropped_) {
        float* d = dropped_ + (x - input_);
        check(cudaMemcpyAsync(d, x, static_cast<size_t>(len) * 4, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync (dropped)");
        check(sparse::cuda::decode(sparse::cuda::DecodeMode::kSubtract, out, len, chunk_, k_, d, nullptr, stream_),
              "sparse decode (dropped)");
      }
      download_prefetched(p, a, reinterpret_cast<const char*>(out), len, p.host->size());
    }
    prefetched_.push_back(std::move(p));
  }

  Payload encode_input(const void* own, int64_t len, bool* finite) override {
    Prefetched p = take_prefetched(own, len);
    // (this segment's encode or an earlier one: the schedule only ORs)
    const bool ok = ctx_.host_flags()[0] == 0;
    if (!ok && len > 0) zero_payload(p.host->data(), len, k_);  // well formed: the frame says why it is void
    own_bad_ |= !ok;
    *finite = ok;
    return Payload{p.host->data(), p.host->size(), p.host};
  }

  bool accumulate(const void* own, const char* payload, int64_t len, float*) override {
    if (len == 0) return input_finite();
    const uint8_t* in = upload(checked(payload, len, k_), partial_bytes(len));
    acc_ = reinterpret_cast<float*>(ctx_.device_buffer(CudaContext::kAcc, static_cast<size_t>(len) * 4));
    check(codec::cuda::widen(own, codec::InputType::kFloat32, len, acc_, &flags_[0], stream_),
          "finite check (own values)");
    add(in, len);
    divisor_ = 1.f;
    return input_finite();  // (read back with the segment's encode, before anything is sent)
  }

  void add_partial(const char* payload, int64_t len, float*) override {
    if (len == 0) return;
    add(upload(checked(payload, len, k_), partial_bytes(len)), len);
  }

  void divide(float*, int64_t len, float d) override {
    divisor_ = d;
    if (len > 0) check(codec::cuda::divide(acc_, len, d, stream_), "divide");
  }

  Payload encode_partial(const Buffer&, int64_t) override {
    throw std::logic_error("internal: the topk codec has no partial sums (direct schedule only)");
  }

  Payload encode_final(const Buffer&, int64_t len, bool* finite) override {
    uint8_t* out = out_buffer(final_bytes(len));
    pending_ = nullptr;
    if (len > 0) {
      if (!kernels_from_) kernels_from_ = record();
      check(sparse::cuda::encode(acc_, len, chunk_, k_avg_, out, status(1), 0, stream_), "sparse encode (average)");
      if (measure_ || dropped_) {
        // What every rank will decode, beside what it stands for: the error the ring reports
        // and what this owner's residual keeps (placed by final_known, which knows where).
        float* dec = reinterpret_cast<float*>(ctx_.device_buffer(CudaContext::kDecoded, static_cast<size_t>(len) * 4));
        check(sparse::cuda::decode(sparse::cuda::DecodeMode::kWrite, out, len, chunk_, k_avg_, dec, status(3), stream_),
              "sparse decode (average)");
        check(sparse::cuda::owner_dropped(acc_, dec, len, divisor_, dropped_ != nullptr, measure_ ? err_sums_ : nullptr,
                                          stream_),
              "dropped (average)");
        if (dropped_) pending_ = dec;
      }
    }
    Payload p = send_from_device(reinterpret_cast<const char*>(out), static_cast<size_t>(final_bytes(len)), len);
    finals_.emplace_back(p.owner.get(), len);
    *finite = true;  // known in ready()
    final_here_ = out;
    return p;
  }

  void ready(const Payload& p, bool* finite) override {
    CudaCodecBase::ready(p, finite);
    if (!p.deferred) return;
    while (!finals_.empty() && finals_.front().first != p.owner.get()) finals_.pop_front();
    if (!*finite && !finals_.empty() && finals_.front().second > 0) {
      // An average that overflows bf16 (its record is not one): a well-formed record goes instead.
      zero_payload(const_cast<char*>(p.data), finals_.front().second, k_avg_);
    }
  }

  void final_known(const FinalPiece& piece, bool encoded_here) override {
    known_ += piece.len;
    if (piece.len == 0) return;
    const int64_t len = piece.len;
    uint8_t* at = image_ + piece.begin / chunk_ * sparse::record_bytes(k_avg_, chunk_);
    const size_t bytes = static_cast<size_t>(final_bytes(len));
    if (encoded_here) {
      check(cudaMemcpyAsync(at, final_here_, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (final)");
      if (pending_) {
        check(cudaMemcpyAsync(dropped_ + piece.begin, pending_, static_cast<size_t>(len) * 4, cudaMemcpyDeviceToDevice,
                              stream_),
              "cudaMemcpyAsync (dropped of the average)");
        pending_ = nullptr;
      }
      return;
    }
    copy_in(at, checked(piece.bytes->data(), len, k_avg_), bytes);
  }

  void commit() override {
    if (dropped_ && dropped_ != residual_) check(codec::cuda::add_into(residual_, dropped_, n_, stream_), "residual");
  }

  void write_result(const std::vector<FinalPiece>&, void* dst, size_t, BufferPool&) override {
    if (known_ != n_) {
      throw std::logic_error("internal: the CUDA topk codec saw " + std::to_string(known_) + " of " +
                             std::to_string(n_) + " final values");
    }
    if (n_ > 0) {
      check(sparse::cuda::decode(sparse::cuda::DecodeMode::kWrite, image_, n_, chunk_, k_avg_, static_cast<float*>(dst),
                                 status(3), stream_),
            "sparse decode (result)");
    }
    // The caller's streams know nothing of this one: the tensor is complete when wait() returns.
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (result)");
  }

 private:
  // flags_[i] as the encode status / decode fault word the sparse launchers take.
  int* status(int i) { return reinterpret_cast<int*>(&flags_[i]); }
  uint8_t* out_buffer(int64_t bytes) {
    return reinterpret_cast<uint8_t*>(ctx_.device_buffer(CudaContext::kOut, static_cast<size_t>(bytes)));
  }

  // A received payload, checked on the host before the GPU sees it: positions ascending
  // inside every chunk (the CPU codec's check and message).
  const char* checked(const char* payload, int64_t len, int64_t k) const {
    if (!sparse::well_formed(reinterpret_cast<const uint8_t*>(payload), len, chunk_, k)) {
      throw std::runtime_error("a topk payload has positions that are not ascending inside a chunk");
    }
    return payload;
  }

  // Received bytes to device memory: through a pinned slot, or straight from the transport's
  // buffer with pageable uploads. Returns the event after the copy.
  cudaEvent_t copy_in(void* device, const char* payload, size_t bytes) {
    cudaEvent_t a;
    if (job_->pageable_upload) {
      a = record();
      ScopedTimer timer(staging_);
      check(cudaMemcpyAsync(device, payload, bytes, cudaMemcpyHostToDevice, stream_),
            "cudaMemcpyAsync (upload, pageable)");
    } else {
      const char* staged = stage(payload, bytes);
      a = record();  // (after the host copy: the span is the GPU's)
      check(cudaMemcpyAsync(device, staged, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (upload)");
      staged_done();
    }
    cudaEvent_t b = record();
    span(&h2d_, a, b);
    return b;
  }

  // A contribution's bytes into the device's upload buffer; the segment's kernels start after it.
  const uint8_t* upload(const char* payload, int64_t bytes) {
    char* in = ctx_.device_buffer(CudaContext::kUploadIn, static_cast<size_t>(bytes));
    const cudaEvent_t b = copy_in(in, payload, static_cast<size_t>(bytes));
    if (!kernels_from_) kernels_from_ = b;
    return reinterpret_cast<const uint8_t*>(in);
  }

  void add(const uint8_t* in, int64_t len) {
    // (flags_[3] stays 0: the record was checked on the host)
    check(sparse::cuda::decode(sparse::cuda::DecodeMode::kAdd, in, len, chunk_, k_, acc_, status(3), stream_),
          "sparse decode-add (contribution)");
  }

  // out = the records of len zeros (the CPU codec's), for a payload whose values are void.
  void zero_payload(char* out, int64_t len, int64_t k) const {
    const int64_t full = len / chunk_, rest = len % chunk_;
    const std::vector<float> zeros(static_cast<size_t>(std::min(len, chunk_)), 0.f);
    uint8_t* o = reinterpret_cast<uint8_t*>(out);
    const int64_t record = sparse::record_bytes(k, chunk_);
    if (full > 0) {
      sparse::encode(zeros.data(), chunk_, chunk_, k, o);
      for (int64_t c = 1; c < full; ++c) std::memcpy(o + c * record, o, static_cast<size_t>(record));
    }
    if (rest > 0) sparse::encode(zeros.data(), rest, chunk_, k, o + full * record);
  }

  const int64_t chunk_;
  const int64_t k_;
  const int64_t k_avg_;
  const int64_t n_;
  const float* const input_;  // the tensor's values on the device (where the own segments sit)
  float* const residual_;     // device, or null
  uint8_t* image_ = nullptr;  // the final records of the whole tensor, in order
  float* dropped_ = nullptr;  // what this rank's selections dropped (residual set)
  float* acc_ = nullptr;      // the current own segment's fp32 sum
  float divisor_ = 1.f;
  float* pending_ = nullptr;  // what the last encode_final dropped, until final_known places it
  const uint8_t* final_here_ = nullptr;
  int64_t known_ = 0;  // final values placed in the image
  std::deque<std::pair<const ByteBuffer*, int64_t>> finals_;  // deferred averages: (payload, values)
};

}  // namespace

std::unique_ptr<WireCodec> make_cuda_sparse_codec(const AllReduceSpec& spec, ScheduleTimes& times) {
  return std::make_unique<CudaSparseCodec>(spec, times);
}

}  // namespace prime::ring::cuda_detail
