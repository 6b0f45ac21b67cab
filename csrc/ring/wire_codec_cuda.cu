// The GPU wire codec (wire_codec_cuda.h). Host code: it enqueues the kernels of
// csrc/codec/codec_cuda.cu and ring_cuda.cu and the PCIe copies on the ring's stream,
// and waits only where the transport needs bytes.
#include "wire_codec_cuda.h"

#include <unistd.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../codec/codec_cuda.h"
#include "../codec/ring_cuda.h"
#include "cuda_codec_base.h"

namespace prime::ring {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
  }
}

namespace {

// Pinned buffers are rounded up to this, so that segments of slightly different sizes
// reuse each other's buffers.
constexpr size_t kPinnedGrain = 64 << 10;

// Makes `device` current in this thread for the scope (the worker and the Python thread
// may have another one current).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------
// PinnedPool

std::shared_ptr<PinnedPool> PinnedPool::create(size_t min_cached_bytes, size_t max_cached_bytes) {
  return std::make_shared<PinnedPool>(Key{}, min_cached_bytes, std::max(min_cached_bytes, max_cached_bytes));
}

PinnedPool::~PinnedPool() {
  for (auto& [cap, p] : idle_) cudaFreeHost(p);
}

Buffer PinnedPool::acquire(size_t size) {
  const size_t want = std::max<size_t>(kPinnedGrain, (size + kPinnedGrain - 1) / kPinnedGrain * kPinnedGrain);
  char* p = nullptr;
  size_t cap = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.lower_bound(want);
    if (it != idle_.end() && it->first <= 2 * want) {
      cap = it->first;
      p = it->second;
      cached_ -= cap;
      idle_.erase(it);
      live_ += cap;
      peak_ = std::max(peak_, live_);
    }
  }
  if (!p) {
    void* raw = nullptr;
    cuda_check(cudaHostAlloc(&raw, want, cudaHostAllocPortable), "cudaHostAlloc (pinned staging)");
    p = static_cast<char*>(raw);
    cap = want;
    std::lock_guard<std::mutex> lock(mu_);
    live_ += cap;
    peak_ = std::max(peak_, live_);
  }
  std::weak_ptr<PinnedPool> pool = weak_from_this();
  std::shared_ptr<void> keeper(p, [pool, cap](void* q) {
    if (auto live = pool.lock()) {
      live->release(static_cast<char*>(q), cap);
    } else {
      cudaFreeHost(q);
    }
  });
  return std::make_shared<ByteBuffer>(p, size, std::move(keeper));
}

void PinnedPool::release(char* p, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_ -= capacity;
    if (cached_ + capacity <= std::min(max_cached_, std::max(min_cached_, peak_))) {
      cached_ += capacity;
      idle_.emplace(capacity, p);
      return;
    }
  }
  cudaFreeHost(p);
}

// ---------------------------------------------------------------------------
// CudaContext, CudaJob

CudaContext::CudaContext(int device) : device_(device) {
  DeviceScope scope(device);
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  // Idle pinned buffers kept: what the largest collective so far had in flight, at
  // least 512 MiB, at most a quarter of the host's memory.
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const size_t quarter = pages > 0 && page > 0 ? static_cast<size_t>(pages) / 4 * static_cast<size_t>(page) : 0;
  pinned_ = PinnedPool::create(size_t{512} << 20, quarter);
  void* flags = nullptr;
  cuda_check(cudaHostAlloc(&flags, 64, cudaHostAllocPortable), "cudaHostAlloc (flags)");
  host_flags_ = static_cast<uint32_t*>(flags);
}

CudaContext::~CudaContext() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  for (char* p : buffers_) {
    if (p) cudaFree(p);
  }
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
  if (host_flags_) cudaFreeHost(host_flags_);
  cudaSetDevice(previous);
}

char* CudaContext::device_buffer(Slot slot, size_t bytes) {
  if (buffer_bytes_[slot] >= bytes && buffers_[slot]) return buffers_[slot];
  cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (growing a device buffer)");
  if (buffers_[slot]) {
    cuda_check(cudaFree(buffers_[slot]), "cudaFree");
    buffers_[slot] = nullptr;
    device_bytes_ -= buffer_bytes_[slot];
    buffer_bytes_[slot] = 0;
  }
  const size_t want = std::max<size_t>(bytes, 256);
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, want), "cudaMalloc (ring device buffer)");
  buffers_[slot] = static_cast<char*>(p);
  buffer_bytes_[slot] = want;
  device_bytes_ += want;
  return buffers_[slot];
}

cudaEvent_t CudaContext::take_event() {
  if (!events_.empty()) {
    cudaEvent_t e = events_.back();
    events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}

void CudaContext::give_event(cudaEvent_t e) { events_.push_back(e); }

CudaJob::~CudaJob() {
  if (input_ready) cudaEventDestroy(input_ready);
}

// ---------------------------------------------------------------------------
// What the codecs share (cuda_codec_base.h)

namespace cuda_detail {

CudaCodecBase::CudaCodecBase(const AllReduceSpec& spec, ScheduleTimes& times, bool measure)
    : job_(spec.cuda), ctx_(*spec.cuda->context), stream_(ctx_.stream()), measure_(measure), times_(&times) {
  // The worker thread runs every collective of the ring: the device stays current.
  cuda_check(cudaSetDevice(ctx_.device()), "cudaSetDevice");
  if (job_->input_ready) cuda_check(cudaStreamWaitEvent(stream_, job_->input_ready, 0), "cudaStreamWaitEvent");
  flags_ = reinterpret_cast<uint32_t*>(ctx_.device_buffer(CudaContext::kFlags, 64));
  err_sums_ = reinterpret_cast<double*>(reinterpret_cast<char*>(flags_) + kErrSumsOffset);
  // The flags and the error sums (bytes [kErrSumsOffset, +16) of the same buffer).
  cuda_check(cudaMemsetAsync(flags_, 0, kErrSumsOffset + 2 * sizeof(double), stream_), "cudaMemsetAsync (flags)");
  ctx_.host_flags()[0] = ctx_.host_flags()[1] = 0;
  for (auto& s : slots_) s.read = ctx_.take_event();
}

CudaCodecBase::~CudaCodecBase() {
  // Nothing may be released while the GPU still reads or writes it (pinned slots,
  // device buffers the next collective reuses).
  cudaStreamSynchronize(stream_);
  for (auto& s : slots_) ctx_.give_event(s.read);
  for (cudaEvent_t e : used_) ctx_.give_event(e);
}

void CudaCodecBase::ready(const Payload& p, bool* finite) {
  if (!p.deferred) return;
  while (!inflight_.empty() && inflight_.front().owner != p.owner.get()) inflight_.pop_front();
  if (inflight_.empty()) throw std::logic_error("internal: ready() of a payload the CUDA wire codec did not defer");
  wait_for(inflight_.front().done);
  inflight_.pop_front();
  // The flags are OR-accumulated on the device and downloaded after every encode: this
  // copy holds at least this payload's (later ones only add).
  own_bad_ |= ctx_.host_flags()[0] != 0;
  *finite = ctx_.host_flags()[1] == 0;
}

CudaCodecBase::Prefetched CudaCodecBase::take_prefetched(const void* own, int64_t len) {
  if (prefetched_.empty() || prefetched_.front().own != own || prefetched_.front().len != len) {
    // (Nothing the GPU still writes may go back to the pinned pool: wait first.)
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    prefetched_.clear();
    prefetch_input(own, len);
  }
  Prefetched p = std::move(prefetched_.front());
  prefetched_.pop_front();
  if (p.done) wait_for(p.done);
  return p;
}

void CudaCodecBase::decode_final(const char*, int64_t, void*, float*) const {
  // Only reached through the base write_result, which these codecs replace.
  throw std::logic_error("internal: decode_final of a CUDA wire codec");
}

void CudaCodecBase::finish() {
  // The error sums, read back once (every encode was enqueued before this).
  char* host_sums = reinterpret_cast<char*>(ctx_.host_flags()) + kErrSumsOffset;
  if (measure_) {
    cuda_check(cudaMemcpyAsync(host_sums, err_sums_, 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (error sums)");
  }
  {
    ScopedTimer timer(times_->gpu_wait_s);
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (end of the collective)");
  }
  own_bad_ |= ctx_.host_flags()[0] != 0;
  if (measure_) {
    double sums[2];
    std::memcpy(sums, host_sums, sizeof(sums));
    times_->quant_err_sq += sums[0];
    times_->quant_in_sq += sums[1];
  }
  for (const Span& s : spans_) {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, s.a, s.b), "cudaEventElapsedTime");
    *s.sink += ms * 1e-3;
  }
  spans_.clear();
  times_->gpu_codec_s += gpu_codec_;
  times_->h2d_s += h2d_;
  times_->d2h_s += d2h_;
  times_->staging_s += staging_;
  times_ = nullptr;  // ring.cpp reads the times now; the result is written later
}

cudaEvent_t CudaCodecBase::record() {
  cudaEvent_t e = ctx_.take_event();
  used_.push_back(e);
  cuda_check(cudaEventRecord(e, stream_), "cudaEventRecord");
  return e;
}

void CudaCodecBase::wait_for(cudaEvent_t e) {
  ScopedTimer timer(times_->gpu_wait_s);
  cuda_check(cudaEventSynchronize(e), "cudaEventSynchronize");
}

const char* CudaCodecBase::stage(const char* src, size_t bytes) {
  UploadSlot& s = slots_[next_slot_];
  if (s.pending) wait_for(s.read);
  s.pending = false;
  if (!s.host || s.host->size() < bytes) s.host = ctx_.pinned().acquire(bytes);
  ScopedTimer timer(staging_);
  std::memcpy(s.host->data(), src, bytes);
  return s.host->data();
}

void CudaCodecBase::staged_done() {
  UploadSlot& s = slots_[next_slot_];
  cuda_check(cudaEventRecord(s.read, stream_), "cudaEventRecord (upload slot)");
  s.pending = true;
  next_slot_ = (next_slot_ + 1) % kUploadSlots;
}

void CudaCodecBase::download_prefetched(Prefetched& p, cudaEvent_t a, const char* src, int64_t len,
                                        size_t bytes) {
  cudaEvent_t b = record();
  download(p.host->data(), src, len, bytes);
  p.done = record();
  span(&gpu_codec_, a, b);
  span(&d2h_, b, p.done);
}

void CudaCodecBase::download(char* host, const char* device, int64_t len, size_t bytes) {
  if (len > 0) {
    cuda_check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (download)");
  }
  cuda_check(cudaMemcpyAsync(ctx_.host_flags(), flags_, 2 * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream_),
             "cudaMemcpyAsync (flags)");
}

Payload CudaCodecBase::send_from_device(const char* src, size_t bytes, int64_t len) {
  Buffer host = ctx_.pinned().acquire(bytes);
  cudaEvent_t b = record();
  if (kernels_from_) span(&gpu_codec_, kernels_from_, b);
  kernels_from_ = nullptr;
  download(host->data(), src, len, bytes);
  cudaEvent_t c = record();
  span(&d2h_, b, c);
  inflight_.push_back(Inflight{host.get(), c});
  Payload p{host->data(), host->size(), host};
  p.deferred = true;
  return p;
}

}  // namespace cuda_detail

// ---------------------------------------------------------------------------
// The codec

namespace {

codec::InputType input_type_of(DType t) { return static_cast<codec::InputType>(t); }

class CudaWireCodec final : public cuda_detail::CudaCodecBase {
 public:
  CudaWireCodec(const AllReduceSpec& spec, ScheduleTimes& times)
      : CudaCodecBase(spec, times,
                      (spec.codec == CodecKind::kInt8 || spec.codec == CodecKind::kFp4) && spec.measure_error),
        blocked_(spec.codec == CodecKind::kInt8 || spec.codec == CodecKind::kFp4),
        fp4_(spec.codec == CodecKind::kFp4),
        packed_(spec.codec == CodecKind::kInt8),
        format_(fp4_ ? codec::cuda::BlockFormat::kFp4 : codec::cuda::BlockFormat::kInt8),
        dtype_(spec.dtype),
        type_(input_type_of(spec.dtype)),
        esize_(dtype_size(spec.dtype)),
        block_(spec.block),
        n_(spec.n) {
    // The final result gathers here (allocated now: growing later would wait for the stream).
    if (blocked_) {
      image_q_ = ctx_.device_buffer(CudaContext::kImageQ, static_cast<size_t>(code_bytes(n_)));
      image_s_ = reinterpret_cast<float*>(
          ctx_.device_buffer(CudaContext::kImageS, static_cast<size_t>(codec::num_blocks(n_, block_)) * 4));
    } else {
      image_q_ = ctx_.device_buffer(CudaContext::kImageQ, static_cast<size_t>(n_) * esize_);
    }
  }


  int64_t unit() const override { return blocked_ ? block_ : kExactUnit; }
  int64_t partial_bytes(int64_t len) const override {
    return blocked_ ? wire_scale_bytes(len) + code_bytes(len) : 4 * len;
  }
  int64_t final_bytes(int64_t len) const override {
    return blocked_ ? partial_bytes(len) : len * static_cast<int64_t>(esize_);
  }

  void prefetch_input(const void* own, int64_t len) override {
    Prefetched p{own, len, nullptr, nullptr};
    const size_t bytes = static_cast<size_t>(partial_bytes(len));
    p.host = ctx_.pinned().acquire(bytes);
    if (len > 0) {
      cudaEvent_t a = record();
      const char* src = nullptr;
      if (blocked_) {
        char* out = out_buffer(static_cast<size_t>(device_bytes(len)));
        quantize_codes(own, type_, len, out, "quantize (own values)");
        if (measure_) {
          check(codec::cuda::quantize_error_sq(format_, own, type_, q_of(out, len), scales_of(out), len, block_,
                                               err_sums_, stream_),
                "quantization error (own values)");
        }
        pack_scales(out, len);
        src = out;
      } else if (dtype_ == DType::kFloat32) {
        check(codec::cuda::widen(own, type_, len, nullptr, &flags_[0], stream_), "finite check (own values)");
        src = static_cast<const char*>(own);  // sent as it is
      } else {
        char* out = out_buffer(bytes);
        check(codec::cuda::widen(own, type_, len, reinterpret_cast<float*>(out), &flags_[0], stream_),
              "widen (own values)");
        src = out;
      }
      download_prefetched(p, a, src, len, bytes);
    }
    prefetched_.push_back(std::move(p));
  }

  Payload encode_input(const void* own, int64_t len, bool* finite) override {
    Prefetched p = take_prefetched(own, len);
    bool ok = true;
    if (blocked_) {
      // Blocks holding NaN or Inf carry the NaN scale (the format's flag).
      const int64_t nb = codec::num_blocks(len, block_);
      if (packed_) {  // the packed scales: the byte 255 is the flag
        const uint8_t* s = reinterpret_cast<const uint8_t*>(p.host->data()) + codec::kPackedHeaderBytes;
        for (int64_t b = 0; b < nb; ++b) ok &= s[b] != codec::kPackedNaN;
      } else {
        const float* s = p.host->as<float>();
        for (int64_t b = 0; b < nb; ++b) ok &= !std::isnan(s[b]);
      }
    } else {
      ok = ctx_.host_flags()[0] == 0;  // (this segment's check or an earlier one: the schedule only ORs)
    }
    own_bad_ |= !ok;
    *finite = ok;
    return Payload{p.host->data(), p.host->size(), p.host};
  }

  bool accumulate(const void* own, const char* payload, int64_t len, float*) override {
    if (len == 0) return input_finite();
    kernels_from_ = nullptr;
    upload(payload, len);
    own_ = own;
    divisor_ = 0.f;
    summed_ = false;
    if (!fused()) sum_first(len);  // block sizes the fused kernel does not take: the sum in fp32 first
    // The own values' check is read back with this segment's encode (before anything is
    // sent: the schedule asks input_finite() for every frame header).
    return input_finite();
  }

  void add_partial(const char* payload, int64_t len, float*) override {
    if (len == 0) return;
    if (!summed_) sum_first(len);  // (before the upload below reuses the device buffer: same stream)
    upload(payload, len);
    if (fp4_) {
      check(codec::cuda::dequantize_add_fp4(acc_, reinterpret_cast<const uint8_t*>(q_of(in_, len)), scales_of(in_), len,
                                            block_, stream_),
            "dequantize-add (contribution)");
    } else if (blocked_) {
      check(codec::cuda::dequantize_add(acc_, reinterpret_cast<const int8_t*>(q_of(in_, len)), scales_of(in_), len,
                                        block_, stream_),
            "dequantize-add (contribution)");
    } else {
      check(codec::cuda::add_into(acc_, reinterpret_cast<const float*>(in_), len, stream_), "add (contribution)");
    }
  }

  void divide(float*, int64_t len, float d) override {
    if (summed_) {
      check(codec::cuda::divide(acc_, len, d, stream_), "divide");
    } else {
      divisor_ = d;  // done by the fused pass of encode_partial / encode_final
    }
  }

  Payload encode_partial(const Buffer&, int64_t len) override {
    char* out = out_buffer(static_cast<size_t>(device_bytes(len)));
    if (len > 0) encode_sum(out, len, false);
    return send_from_device(out, static_cast<size_t>(partial_bytes(len)), len);
  }

  Payload encode_final(const Buffer&, int64_t len, bool* finite) override {
    char* out = out_buffer(static_cast<size_t>(device_bytes(len, true)));
    if (len > 0) encode_sum(out, len, true);
    Payload p = send_from_device(out, static_cast<size_t>(final_bytes(len)), len);
    *finite = true;  // known in ready()
    final_here_ = out;
    return p;
  }

  void final_known(const FinalPiece& piece, bool encoded_here) override {
    known_ += piece.len;
    if (piece.len == 0) return;
    const int64_t len = piece.len;
    if (encoded_here) {
      // Already on the device (encode_final's output, fp32 scales): a device-to-device copy.
      place_at(final_here_, piece.begin, len, cudaMemcpyDeviceToDevice);
      return;
    }
    if (job_->pageable_upload) {
      cudaEvent_t a = record();
      {
        ScopedTimer timer(staging_);
        place_at(piece.bytes->data(), piece.begin, len, cudaMemcpyHostToDevice);
      }
      span(&h2d_, a, record());
      return;
    }
    const char* staged = stage(piece.bytes->data(), static_cast<size_t>(final_bytes(len)));
    cudaEvent_t a = record();
    place_at(staged, piece.begin, len, cudaMemcpyHostToDevice);
    staged_done();
    span(&h2d_, a, record());
  }

  void write_result(const std::vector<FinalPiece>&, void* dst, size_t, BufferPool&) override {
    if (known_ != n_) {
      throw std::logic_error("internal: the CUDA wire codec saw " + std::to_string(known_) + " of " +
                             std::to_string(n_) + " final values");
    }
    if (n_ > 0) {
      if (fp4_) {
        check(codec::cuda::dequantize_fp4(reinterpret_cast<const uint8_t*>(image_q_), image_s_, n_, block_, dst, type_,
                                          stream_),
              "dequantize (result)");
      } else if (blocked_) {
        check(codec::cuda::dequantize(reinterpret_cast<const int8_t*>(image_q_), image_s_, n_, block_, dst, type_,
                                      stream_),
              "dequantize (result)");
      } else {
        cuda_check(cudaMemcpyAsync(dst, image_q_, static_cast<size_t>(n_) * esize_, cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync (result)");
      }
    }
    // The caller's streams know nothing of this one: the tensor is complete when wait() returns.
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (result)");
  }

 private:
  // The block codecs' payload layout on the device: fp32 scales, then codes (int8: a byte
  // a value; fp4: two values a byte). On the wire fp4 has the same layout; int8 sends its
  // packed scales (a 2-byte header, a byte a block) and its codes right after them: the
  // copies to and from the host pack and unpack the scales (pack_scales, download, upload,
  // place_at), so every kernel reads and writes fp32 scales and 4-byte-aligned codes.
  float* scales_of(char* p) const { return reinterpret_cast<float*>(p); }
  char* q_of(char* p, int64_t len) const { return p + 4 * codec::num_blocks(len, block_); }
  int64_t code_bytes(int64_t len) const { return fp4_ ? codec::fp4_bytes(len) : len; }
  int64_t wire_scale_bytes(int64_t len) const {
    const int64_t nb = codec::num_blocks(len, block_);
    return packed_ ? ring::int8_scale_bytes(nb) : 4 * nb;
  }
  // Bytes of the device copy of a payload of len values (final: an all-gather payload).
  int64_t device_bytes(int64_t len, bool final = false) const {
    if (blocked_) return 4 * codec::num_blocks(len, block_) + code_bytes(len);
    return final ? final_bytes(len) : partial_bytes(len);
  }
  uint8_t* packed_scales(int64_t len) {
    return reinterpret_cast<uint8_t*>(
        ctx_.device_buffer(CudaContext::kPackedScales, static_cast<size_t>(wire_scale_bytes(len))));
  }

  // int8: the packed wire scales of the device payload `out` (len values) into
  // kPackedScales, for download() to send (scales too small for the byte become 0 in `out`).
  void pack_scales(char* out, int64_t len) {
    if (!packed_ || len == 0) return;
    check(codec::cuda::pack_int8_scales(scales_of(out), codec::num_blocks(len, block_), packed_scales(len), stream_),
          "pack scales");
  }

  // Encodes len values of x (of `type`) into `out` (the payload layout) in the codec's format.
  void quantize_codes(const void* x, codec::InputType type, int64_t len, char* out, const char* what) {
    if (fp4_) {
      check(codec::cuda::quantize_fp4(x, type, len, block_, reinterpret_cast<uint8_t*>(q_of(out, len)),
                                      scales_of(out), std::nullopt, stream_),
            what);
    } else {
      check(codec::cuda::quantize(x, type, len, block_, reinterpret_cast<int8_t*>(q_of(out, len)), scales_of(out),
                                  std::nullopt, stream_),
            what);
    }
  }

  char* out_buffer(size_t bytes) { return ctx_.device_buffer(CudaContext::kOut, bytes); }

  // Copies the device payload of len values (the device layout) to `host` in the wire
  // layout (`bytes`; int8: the scales pack_scales made, then the codes), and the flags.
  void download(char* host, const char* device, int64_t len, size_t bytes) override {
    if (len > 0 && packed_) {
      const int64_t nb = codec::num_blocks(len, block_);
      const int64_t sb = wire_scale_bytes(len);
      cuda_check(cudaMemcpyAsync(host, packed_scales(len), static_cast<size_t>(sb), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (download scales)");
      cuda_check(cudaMemcpyAsync(host + sb, device + 4 * nb, static_cast<size_t>(code_bytes(len)),
                                 cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (download)");
    } else if (len > 0) {
      cuda_check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (download)");
    }
    cuda_check(cudaMemcpyAsync(ctx_.host_flags(), flags_, 2 * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (flags)");
  }

  bool fused() const { return !blocked_ || codec::cuda::reduce_quantize_supported(block_); }

  // Uploads a received payload of len values (the wire layout) into in_ (the device's copy
  // of the current payload, in the device layout).
  void upload(const char* payload, int64_t len) {
    const size_t bytes = static_cast<size_t>(partial_bytes(len));
    in_ = ctx_.device_buffer(CudaContext::kUploadIn, static_cast<size_t>(device_bytes(len)));
    cudaEvent_t a;
    if (job_->pageable_upload) {
      // Straight from the transport's buffer: the call returns once the driver has copied
      // the bytes into its own staging (host time, counted as staging), so the buffer may
      // go back to the pool at once.
      a = record();
      ScopedTimer timer(staging_);
      copy_payload_in(in_, payload, len, "cudaMemcpyAsync (upload, pageable)");
    } else {
      const char* staged = stage(payload, bytes);
      a = record();  // (after the host copy: the span is the GPU's)
      copy_payload_in(in_, staged, len, "cudaMemcpyAsync (upload)");
      staged_done();
    }
    cudaEvent_t b = record();
    span(&h2d_, a, b);
    if (!kernels_from_) kernels_from_ = b;
  }

  // Copies a host payload of len values (the wire layout) to `device` in the device layout:
  // int8 codes after the fp32 scales, which the 2-byte ones are widened into.
  void copy_payload_in(char* device, const char* host, int64_t len, const char* what) {
    if (!packed_) {
      cuda_check(cudaMemcpyAsync(device, host, static_cast<size_t>(partial_bytes(len)), cudaMemcpyHostToDevice, stream_),
                 what);
      return;
    }
    place_int8(host, len, scales_of(device), q_of(device, len), what);
  }

  // int8: the wire payload of len values at `host` into fp32 scales (`scales`) and codes (`q`) on the device.
  void place_int8(const char* host, int64_t len, float* scales, char* q, const char* what) {
    const int64_t nb = codec::num_blocks(len, block_);
    const int64_t sb = wire_scale_bytes(len);
    uint8_t* packed = packed_scales(len);
    cuda_check(cudaMemcpyAsync(packed, host, static_cast<size_t>(sb), cudaMemcpyHostToDevice, stream_), what);
    cuda_check(cudaMemcpyAsync(q, host + sb, static_cast<size_t>(len), cudaMemcpyHostToDevice, stream_), what);
    check(codec::cuda::unpack_int8_scales(packed, nb, scales, stream_), "unpack scales");
  }

  // acc_ = own values + the uploaded payload, in fp32 (the unfused path, and the direct
  // schedule's owner before it adds more contributions).
  void sum_first(int64_t len) {
    acc_ = reinterpret_cast<float*>(ctx_.device_buffer(CudaContext::kAcc, static_cast<size_t>(len) * 4));
    if (blocked_) {
      check(codec::cuda::add_dequantized(format_, own_, type_, q_of(in_, len), scales_of(in_), len, block_, acc_,
                                         &flags_[0], stream_),
            "dequantize-add");
    } else {
      check(codec::cuda::add_widened(own_, type_, reinterpret_cast<const float*>(in_), len, acc_, &flags_[0], stream_),
            "add");
    }
    summed_ = true;
  }

  // The segment's sum (own values + the uploaded payload, divided when divide() said so)
  // encoded into `out`: one fused pass, or (blocks above 1024) a quantize of acc_.
  void encode_sum(char* out, int64_t len, bool final) {
    uint32_t* result_bad = final ? &flags_[1] : nullptr;
    if (!summed_) {
      if (blocked_) {
        check(codec::cuda::reduce_quantize(format_, own_, type_, q_of(in_, len), scales_of(in_), len, block_,
                                           divisor_, q_of(out, len), scales_of(out), &flags_[0], result_bad, type_,
                                           stream_, measure_ ? err_sums_ : nullptr),
              final ? "reduce-quantize (final value)" : "reduce-quantize (partial sum)");
        pack_scales(out, len);
      } else {
        // exact: the fp32 partial sums, or the final value rounded to the dtype
        check(codec::cuda::reduce_exact(own_, type_, reinterpret_cast<const float*>(in_), len, divisor_, out,
                                        final ? type_ : codec::InputType::kFloat32, &flags_[0], result_bad, stream_),
              final ? "reduce (final value)" : "reduce (partial sum)");
      }
      return;
    }
    if (!blocked_) {
      // exact, summed (the direct schedule's owner): the fp32 sum, rounded to the dtype when final
      check(codec::cuda::narrow(acc_, len, final ? type_ : codec::InputType::kFloat32, out, &flags_[final ? 1 : 2],
                                stream_),
            final ? "round (final value)" : "copy (partial sum)");
      return;
    }
    quantize_codes(acc_, codec::InputType::kFloat32, len, out,
                   final ? "quantize (final value)" : "quantize (partial sum)");
    if (measure_) {
      check(codec::cuda::quantize_error_sq(format_, acc_, codec::InputType::kFloat32, q_of(out, len), scales_of(out),
                                           len, block_, err_sums_, stream_),
            "quantization error");
    }
    if (final) {
      // Every rank writes decode(these bytes) in the dtype: it must be finite.
      check(codec::cuda::flag_nonfinite_decoded(format_, q_of(out, len), scales_of(out), len, block_, type_,
                                                &flags_[1], stream_),
            "finite check (final value)");
    }
    pack_scales(out, len);
  }

  // Copies one final payload (of `len` values starting at value `begin`) into the image:
  // from the host (the wire layout) or from the device (encode_final's, the device layout).
  void place_at(const char* payload, int64_t begin, int64_t len, cudaMemcpyKind kind) {
    if (packed_ && kind == cudaMemcpyHostToDevice) {
      place_int8(payload, len, image_s_ + begin / block_, image_q_ + begin, "cudaMemcpyAsync (final values)");
    } else if (blocked_) {  // (begin: a multiple of the block, so even: fp4 codes start a byte)
      const int64_t nb = codec::num_blocks(len, block_);
      cuda_check(cudaMemcpyAsync(image_s_ + begin / block_, payload, static_cast<size_t>(nb) * 4, kind, stream_),
                 "cudaMemcpyAsync (final scales)");
      cuda_check(cudaMemcpyAsync(image_q_ + code_bytes(begin), payload + 4 * nb, static_cast<size_t>(code_bytes(len)),
                                 kind, stream_),
                 "cudaMemcpyAsync (final values)");
    } else {
      const size_t bytes = static_cast<size_t>(len) * esize_;
      cuda_check(cudaMemcpyAsync(image_q_ + begin * static_cast<int64_t>(esize_), payload, bytes, kind, stream_),
                 "cudaMemcpyAsync (final values)");
    }
  }

  const bool blocked_;  // a block codec (int8 or fp4), not exact values
  const bool fp4_;
  const bool packed_;  // int8: packed 1-byte scales on the wire, fp32 on the device
  const codec::cuda::BlockFormat format_;
  const DType dtype_;
  const codec::InputType type_;
  const size_t esize_;
  const int64_t block_;
  const int64_t n_;

  char* image_q_ = nullptr;    // block codecs: the result's codes; exact: its bytes
  float* image_s_ = nullptr;   // block codecs: the result's scales
  float* acc_ = nullptr;       // the current segment's fp32 sum (device; unfused path only)
  char* in_ = nullptr;         // the current segment's uploaded payload (device)
  const void* own_ = nullptr;  // the current segment's own values (device)
  float divisor_ = 0.f;        // 0: no division
  bool summed_ = false;        // acc_ holds the sum (unfused path)
  const char* final_here_ = nullptr;
  int64_t known_ = 0;  // final values placed in the image
};

}  // namespace

std::unique_ptr<WireCodec> make_cuda_wire_codec(const AllReduceSpec& spec, ScheduleTimes& times) {
  if (spec.codec == CodecKind::kTopk) return cuda_detail::make_cuda_sparse_codec(spec, times);
  return std::make_unique<CudaWireCodec>(spec, times);
}

std::vector<KernelTiming> time_kernels(int device, int64_t n, int64_t block, int iters) {
  if (n <= 0 || iters <= 0 || !codec::valid_block_size(block)) throw std::invalid_argument("time_kernels: bad arguments");
  DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  const int64_t nb = codec::num_blocks(n, block);
  const size_t payload = static_cast<size_t>(n + 4 * nb);
  std::vector<void*> owned;
  auto dev = [&](size_t bytes) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, bytes), "cudaMalloc");
    owned.push_back(p);
    return static_cast<char*>(p);
  };
  float* own = reinterpret_cast<float*>(dev(static_cast<size_t>(n) * 4));
  float* add = reinterpret_cast<float*>(dev(static_cast<size_t>(n) * 4));
  float* acc = reinterpret_cast<float*>(dev(static_cast<size_t>(n) * 4));
  char* in = dev(payload);
  char* out = dev(payload);
  uint32_t* flags = reinterpret_cast<uint32_t*>(dev(64));
  double* err_sums = reinterpret_cast<double*>(reinterpret_cast<char*>(flags) + 16);
  void* pinned = nullptr;
  cuda_check(cudaHostAlloc(&pinned, payload, cudaHostAllocPortable), "cudaHostAlloc");
  {
    // Values of a few magnitudes (a deterministic hash: no host RNG pass over n values).
    std::vector<float> host(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 20)));
    uint32_t h = 12345;
    for (float& v : host) {
      h = h * 1664525u + 1013904223u;
      v = (static_cast<float>(h >> 8) * 0x1p-24f - 0.5f) * static_cast<float>(1 << ((h >> 4) & 7));
    }
    for (int64_t i = 0; i < n; i += static_cast<int64_t>(host.size())) {
      const size_t m = static_cast<size_t>(std::min<int64_t>(n - i, static_cast<int64_t>(host.size())));
      cuda_check(cudaMemcpy(own + i, host.data(), m * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      cuda_check(cudaMemcpy(add + i, host.data() + (host.size() - m), m * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }
  cuda_check(cudaMemsetAsync(flags, 0, 64, stream), "cudaMemsetAsync");
  auto sc = [&](char* p) { return reinterpret_cast<float*>(p); };
  auto qq = [&](char* p) { return reinterpret_cast<int8_t*>(p + 4 * nb); };
  cuda_check(codec::cuda::quantize(add, codec::InputType::kFloat32, n, block, qq(in), sc(in), std::nullopt, stream),
             "quantize");
  // fp4 payloads beside the int8 ones (in4: an encoded input; out4: the output)
  const double S4 = static_cast<double>(codec::fp4_bytes(n));
  char* in4 = dev(payload);
  char* out4 = dev(payload);
  auto q4 = [&](char* p) { return reinterpret_cast<uint8_t*>(p + 4 * nb); };
  cuda_check(codec::cuda::quantize_fp4(add, codec::InputType::kFloat32, n, block, q4(in4), sc(in4), std::nullopt,
                                       stream),
             "quantize fp4");
  using F = codec::InputType;
  using codec::cuda::BlockFormat;
  const double N = static_cast<double>(n), S = 4.0 * static_cast<double>(nb);
  struct Op {
    const char* name;
    double bytes;
    std::function<cudaError_t()> run;
  };
  std::vector<Op> ops = {
      {"quantize own (fp32 -> int8)", 4 * N + N + S,
       [&] { return codec::cuda::quantize(own, F::kFloat32, n, block, qq(out), sc(out), std::nullopt, stream); }},
      {"reduce-quantize (fused: +deq, /2, quant, checks)", 4 * N + 2 * (N + S),
       [&] {
         return codec::cuda::reduce_quantize(BlockFormat::kInt8, own, F::kFloat32, qq(in), sc(in), n, block, 2.f,
                                             qq(out), sc(out), &flags[0], &flags[1], F::kFloat32, stream);
       }},
      {"reduce-quantize + error sums (what the ring runs)", 4 * N + 2 * (N + S),
       [&] {
         return codec::cuda::reduce_quantize(BlockFormat::kInt8, own, F::kFloat32, qq(in), sc(in), n, block, 2.f,
                                             qq(out), sc(out), &flags[0], &flags[1], F::kFloat32, stream, err_sums);
       }},
      {"quantization error of the own values (after quantize own)", 4 * N + N + S,
       [&] {
         return codec::cuda::quantize_error_sq(BlockFormat::kInt8, own, F::kFloat32, qq(out), sc(out), n, block,
                                               err_sums, stream);
       }},
      {"fp4: quantize own (fp32 -> fp4)", 4 * N + S4 + S,
       [&] { return codec::cuda::quantize_fp4(own, F::kFloat32, n, block, q4(out4), sc(out4), std::nullopt, stream); }},
      {"fp4: reduce-quantize + error sums (what the ring runs)", 4 * N + 2 * (S4 + S),
       [&] {
         return codec::cuda::reduce_quantize(BlockFormat::kFp4, own, F::kFloat32, q4(in4), sc(in4), n, block, 2.f,
                                             q4(out4), sc(out4), &flags[0], &flags[1], F::kFloat32, stream, err_sums);
       }},
      {"fp4: dequantize result (fp4 -> fp32)", S4 + S + 4 * N,
       [&] { return codec::cuda::dequantize_fp4(q4(out4), sc(out4), n, block, acc, F::kFloat32, stream); }},
      {"  unfused: add_dequantized", 4 * N + N + S + 4 * N,
       [&] {
         return codec::cuda::add_dequantized(BlockFormat::kInt8, own, F::kFloat32, qq(in), sc(in), n, block, acc,
                                             &flags[0], stream);
       }},
      {"  unfused: divide", 8 * N, [&] { return codec::cuda::divide(acc, n, 2.f, stream); }},
      {"  unfused: quantize (fp32 sum)", 4 * N + N + S,
       [&] { return codec::cuda::quantize(acc, F::kFloat32, n, block, qq(out), sc(out), std::nullopt, stream); }},
      {"  unfused: flag_nonfinite_decoded", N + S,
       [&] {
         return codec::cuda::flag_nonfinite_decoded(BlockFormat::kInt8, qq(out), sc(out), n, block, F::kFloat32,
                                                    &flags[1], stream);
       }},
      {"dequantize result (int8 -> fp32)", N + S + 4 * N,
       [&] { return codec::cuda::dequantize(qq(out), sc(out), n, block, acc, F::kFloat32, stream); }},
      {"reduce exact (fused: +, /2, checks; fp32)", 12 * N,
       [&] {
         return codec::cuda::reduce_exact(own, F::kFloat32, add, n, 2.f, acc, F::kFloat32, &flags[0], &flags[1],
                                          stream);
       }},
      {"device copy (fp32, reference)", 8 * N,
       [&] { return cudaMemcpyAsync(acc, own, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream); }},
      {"D2H int8 payload (pinned)", N + S,
       [&] { return cudaMemcpyAsync(pinned, out, payload, cudaMemcpyDeviceToHost, stream); }},
      {"H2D int8 payload (pinned)", N + S,
       [&] { return cudaMemcpyAsync(in, pinned, payload, cudaMemcpyHostToDevice, stream); }},
  };
  cudaEvent_t a = nullptr, b = nullptr;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<KernelTiming> result;
  for (const Op& op : ops) {
    KernelTiming t{op.name, op.bytes, {}};
    cuda_check(op.run(), op.name);  // warm-up
    for (int i = 0; i < iters; ++i) {
      cuda_check(cudaEventRecord(a, stream), "cudaEventRecord");
      cuda_check(op.run(), op.name);
      cuda_check(cudaEventRecord(b, stream), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      t.ms.push_back(ms);
    }
    result.push_back(std::move(t));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFreeHost(pinned);
  for (void* p : owned) cudaFree(p);
  cudaStreamDestroy(stream);
  return result;
}

}  // namespace prime::ring
