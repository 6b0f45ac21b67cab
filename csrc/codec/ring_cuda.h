// The element-wise CUDA kernels the ring needs besides the codec itself, for its
// GPU wire codec (csrc/ring/wire_codec_cuda.cu): adding a received partial sum to
// this rank's own values, the average's division, rounding the final sum to the
// tensor's dtype, and NaN/Inf flags. Each does the arithmetic of the CPU path
// (csrc/ring/convert.cpp, csrc/ring/wire_codec.cpp) with one IEEE rounding per
// operation and no FMA, so a ring may mix CPU and CUDA ranks and end bit-identical.
//
// Like codec_cuda.h: raw device pointers, everything enqueued on `stream`, no host
// sync, no allocation; each returns cudaGetLastError() after its launch. A flag
// argument is a device word set to 1 when the condition holds and left alone
// otherwise (callers zero it, and OR-accumulate over several launches).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "codec.h"

namespace prime::codec::cuda {

// The block format of the codes `q` points at (kernels below that read or write codes):
// int8 (int8_t, one a value) or fp4 (uint8_t, two a byte; docs/wire-format.md).
enum class BlockFormat : int { kInt8 = 0, kFp4 = 1 };

// acc[i] = widen(own[i]) + value(q, i) * scales[i / block]  (multiply, then add; value:
// float(q[i]) for int8, the E2M1 value of code i for fp4). *own_bad = 1 when own holds NaN or Inf.
cudaError_t add_dequantized(BlockFormat format, const void* own, InputType type, const void* q, const float* scales,
                            int64_t n, int64_t block, float* acc, uint32_t* own_bad, cudaStream_t stream);

// acc[i] = widen(own[i]) + add[i]. *own_bad = 1 when own holds NaN or Inf.
cudaError_t add_widened(const void* own, InputType type, const float* add, int64_t n, float* acc, uint32_t* own_bad,
                        cudaStream_t stream);

// acc[i] = acc[i] + add[i] (the direct schedule's owner adding an exact contribution).
cudaError_t add_into(float* acc, const float* add, int64_t n, cudaStream_t stream);

// dst[i] = widen(src[i]) (dst may be null: only the check). *bad = 1 when src holds NaN or Inf.
cudaError_t widen(const void* src, InputType type, int64_t n, float* dst, uint32_t* bad, cudaStream_t stream);

// x[i] = x[i] / d (a true division, as the CPU path and the reference do).
cudaError_t divide(float* x, int64_t n, float d, cudaStream_t stream);

// dst[i] = src[i] rounded to `type` (nearest even; fp32: a copy). *bad = 1 when a
// rounded value is NaN or Inf.
cudaError_t narrow(const float* src, int64_t n, InputType type, void* dst, uint32_t* bad, cudaStream_t stream);

// *bad = 1 when some value(q, i) * scales[i / block], rounded to `type`, is NaN or Inf
// (the owner's check that the result every rank will decode is finite).
cudaError_t flag_nonfinite_decoded(BlockFormat format, const void* q, const float* scales, int64_t n, int64_t block,
                                   InputType type, uint32_t* bad, cudaStream_t stream);

// The int8 payload's packed scales (docs/wire-format.md, "On the wire"; the host's
// ring::pack_int8_scales): out = [2 bytes: K, the largest grid index of the nonzero finite
// scales, or 0][nb bytes: K - k (<= 253), 254 for 0, 255 for the NaN flag]. A scale more than
// 253 steps below K is sent as 0 and set to 0 in `scales`. unpack: the fp32 scales of such
// bytes (an index off the grid decodes as the NaN flag). nb > 0.
cudaError_t pack_int8_scales(float* scales, int64_t nb, uint8_t* out, cudaStream_t stream);
cudaError_t unpack_int8_scales(const uint8_t* in, int64_t nb, float* scales, cudaStream_t stream);

// Fused passes of one ring segment (the hot path: one launch, one read of each input,
// one write of each output, instead of add, divide, quantize and check launches with
// an fp32 sum in between). The arithmetic is that of the unfused kernels above and of
// codec_cuda.cu's quantize, operation for operation, so the bytes are the same.

// True when reduce_quantize takes this block size (one warp per block: 32..1024).
bool reduce_quantize_supported(int64_t block);

// int8 / fp4: v[i] = widen(own[i]) + value(q, i) * scales[i / block], then v[i] / divisor
// when divisor != 0, quantized into q_out / scales_out in the same format (nearest even; a
// block holding NaN or Inf gets the NaN scale and zero codes). *own_bad = 1 when own holds
// NaN or Inf; when result_bad is set, *result_bad = 1 when a decoded value rounded to
// result_type is NaN or Inf (flag_nonfinite_decoded of the output). When err_sums is set,
// the quantization error of v is added to it as quantize_error_sq does (below), from the
// registers.
cudaError_t reduce_quantize(BlockFormat format, const void* own, InputType type, const void* q, const float* scales,
                            int64_t n, int64_t block, float divisor, void* q_out, float* scales_out, uint32_t* own_bad,
                            uint32_t* result_bad, InputType result_type, cudaStream_t stream,
                            double* err_sums = nullptr);

// The round-trip error of x[0, n) (of `type`) given what quantize wrote for it (q,
// scales), as codec.h's quantize_error_sq(_fp4) computes it on the CPU: sums[0] += the
// sum of (double(value(q, i) * scale) - double(widen(x[i])))^2 and sums[1] += the sum of
// double(widen(x[i]))^2, over the blocks with a finite scale. sums: two device doubles,
// added to with one float64 atomic per CTA (so the order of additions, and the last
// bits, may vary from run to run). Any valid block size.
cudaError_t quantize_error_sq(BlockFormat format, const void* x, InputType type, const void* q, const float* scales,
                              int64_t n, int64_t block, double* sums, cudaStream_t stream);

// exact: v[i] = widen(own[i]) + add[i], then v[i] / divisor when divisor != 0, stored
// rounded to out_type (fp32: as it is). *own_bad = 1 when own holds NaN or Inf; when
// result_bad is set, *result_bad = 1 when a stored value is NaN or Inf.
cudaError_t reduce_exact(const void* own, InputType type, const float* add, int64_t n, float divisor, void* out,
                         InputType out_type, uint32_t* own_bad, uint32_t* result_bad, cudaStream_t stream);

}  // namespace prime::codec::cuda
