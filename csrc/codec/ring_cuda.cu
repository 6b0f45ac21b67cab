// Element-wise kernels of the ring's GPU path (ring_cuda.h). Grid-stride loops over
// contiguous runs: a ring segment is 256 Ki values, a few microseconds of memory
// traffic, so launch count matters more than the loop's shape. Arithmetic with the
// _rn intrinsics (and --fmad=false), as in codec_cuda.cu. The kernels that read or
// write codes are templates over the format (formats_cuda.cuh: Int8Codes, Fp4Codes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "formats_cuda.cuh"
#include "scale_grid.h"
#include "ring_cuda.h"

namespace prime::codec::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 4096;  // CTAs; the loops stride over the rest

__device__ __forceinline__ float load_widened(const void* p, InputType type, int64_t i) {
  switch (type) {
    case InputType::kFloat32:
      return static_cast<const float*>(p)[i];
    case InputType::kBFloat16:
      return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
    default:
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
  }
}

// Exponent all ones: NaN or Inf (widening keeps it so, narrowing makes it so on overflow).
__device__ __forceinline__ bool nonfinite(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }

// v rounded to `type` and widened back: what a rank decoding v into the tensor gets.
__device__ __forceinline__ float rounded(float v, InputType type) {
  switch (type) {
    case InputType::kFloat32:
      return v;
    case InputType::kBFloat16:
      return __bfloat162float(__float2bfloat16_rn(v));
    default:
      return __half2float(__float2half_rn(v));
  }
}

__device__ __forceinline__ void store_narrowed(void* p, InputType type, int64_t i, float v) {
  switch (type) {
    case InputType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case InputType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      break;
    default:
      static_cast<uint16_t*>(p)[i] = __half_as_ushort(__float2half_rn(v));
      break;
  }
}

// The flag is only ever set to 1, so racing stores agree.
__device__ __forceinline__ void raise_flag(bool bad, uint32_t* flag) {
  if (bad) *flag = 1u;
}

__device__ __forceinline__ int64_t first_index() { return int64_t{blockIdx.x} * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t stride() { return int64_t{gridDim.x} * blockDim.x; }

template <class Codes>
__global__ void __launch_bounds__(kThreads)
    add_dequantized_kernel(const void* __restrict__ own, InputType type, const typename Codes::Code* __restrict__ q,
                           const float* __restrict__ scales, int64_t n, int log2_block, float* __restrict__ acc,
                           uint32_t* own_bad) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float o = load_widened(own, type, i);
    bad |= nonfinite(o);
    acc[i] = __fadd_rn(o, __fmul_rn(Codes::value(q, i), scales[i >> log2_block]));
  }
  raise_flag(bad, own_bad);
}

__global__ void __launch_bounds__(kThreads)
    add_widened_kernel(const void* __restrict__ own, InputType type, const float* __restrict__ add, int64_t n,
                       float* __restrict__ acc, uint32_t* own_bad) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float o = load_widened(own, type, i);
    bad |= nonfinite(o);
    acc[i] = __fadd_rn(o, add[i]);
  }
  raise_flag(bad, own_bad);
}

__global__ void __launch_bounds__(kThreads)
    widen_kernel(const void* __restrict__ src, InputType type, int64_t n, float* __restrict__ dst, uint32_t* flag) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float v = load_widened(src, type, i);
    bad |= nonfinite(v);
    if (dst) dst[i] = v;
  }
  raise_flag(bad, flag);
}

__global__ void __launch_bounds__(kThreads) add_into_kernel(float* __restrict__ acc, const float* __restrict__ add,
                                                            int64_t n) {
  for (int64_t i = first_index(); i < n; i += stride()) acc[i] = __fadd_rn(acc[i], add[i]);
}

__global__ void __launch_bounds__(kThreads) divide_kernel(float* __restrict__ x, int64_t n, float d) {
  for (int64_t i = first_index(); i < n; i += stride()) x[i] = __fdiv_rn(x[i], d);
}

__global__ void __launch_bounds__(kThreads)
    narrow_kernel(const float* __restrict__ src, int64_t n, InputType type, void* __restrict__ dst, uint32_t* flag) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float v = src[i];
    bad |= nonfinite(rounded(v, type));
    store_narrowed(dst, type, i, v);
  }
  raise_flag(bad, flag);
}

// One CTA: the largest grid index, then the bytes (a payload's scales: a few thousand).
__global__ void __launch_bounds__(kThreads)
    pack_int8_scales_kernel(float* __restrict__ scales, int64_t nb, uint8_t* __restrict__ out) {
  __shared__ int warp_top[kThreads / 32];
  int top = 0;
  for (int64_t i = threadIdx.x; i < nb; i += kThreads) {
    const float s = scales[i];
    if (s > 0.f) top = max(top, grid_index(__float_as_uint(s)));  // NaN compares false
  }
  for (int off = 16; off > 0; off /= 2) top = max(top, __shfl_xor_sync(0xffffffffu, top, off));
  if (threadIdx.x % 32 == 0) warp_top[threadIdx.x / 32] = top;
  __syncthreads();
  top = 0;
  for (int w = 0; w < kThreads / 32; ++w) top = max(top, warp_top[w]);
  if (threadIdx.x == 0) {
    out[0] = static_cast<uint8_t>(top & 0xff);
    out[1] = static_cast<uint8_t>(top >> 8);
  }
  for (int64_t i = threadIdx.x; i < nb; i += kThreads) {
    const float s = scales[i];
    const int steps = top - grid_index(__float_as_uint(s));
    const bool sent = s > 0.f && steps <= kPackedMaxSteps;
    out[kPackedHeaderBytes + i] = isnan(s) ? kPackedNaN : sent ? static_cast<uint8_t>(steps) : kPackedZero;
    if (s > 0.f && !sent) scales[i] = 0.f;  // the sender's copy decodes as its peers' does
  }
}

__global__ void __launch_bounds__(kThreads)
    unpack_int8_scales_kernel(const uint8_t* __restrict__ in, int64_t nb, float* __restrict__ scales) {
  const int top = static_cast<int>(in[0]) | (static_cast<int>(in[1]) << 8);
  for (int64_t i = first_index(); i < nb; i += stride()) {
    const int d = in[kPackedHeaderBytes + i];
    const int k = top - d;
    uint32_t bits;
    if (d == kPackedZero) {
      bits = 0;
    } else if (d == kPackedNaN || k < kGridSteps || k >= kGridIndexEnd) {
      bits = 0x7fc00000u;
    } else {
      bits = grid_value(k);
    }
    scales[i] = __uint_as_float(bits);
  }
}

template <class Codes>
__global__ void __launch_bounds__(kThreads)
    flag_decoded_kernel(const typename Codes::Code* __restrict__ q, const float* __restrict__ scales, int64_t n,
                        int log2_block, InputType type, uint32_t* flag) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    bad |= nonfinite(rounded(__fmul_rn(Codes::value(q, i), scales[i >> log2_block]), type));
  }
  raise_flag(bad, flag);
}


// One warp per codec block of B = 32 * V values: lane l holds values l + 32 j (every
// load instruction of the warp reads one contiguous run), the block's max |v| comes
// from shuffles, and the quantize is codec_cuda.cu's, operation for operation. fp4:
// each even lane stores the byte of its value and its right neighbour's (a shuffle).
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kCanonicalNaN = 0x7fc00000u;
constexpr int kWarpsPerCta = kThreads / 32;

__device__ __forceinline__ void atomic_add_f64(double* at, double v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
  // (no native float64 atomicAdd before sm_60)
  auto* word = reinterpret_cast<unsigned long long*>(at);
  unsigned long long old = *word, seen;
  do {
    seen = old;
    old = atomicCAS(word, seen, __double_as_longlong(__longlong_as_double(seen) + v));
  } while (seen != old);
#else
  atomicAdd(at, v);
#endif
}

// Adds the CTA's error sums (e, r of every thread) to sums[0], sums[1]: a warp shuffle
// tree, then one float64 atomic per sum per CTA. Every thread of the CTA must call it.
__device__ __forceinline__ void add_error_sums(double e, double r, double* sums) {
  __shared__ double warp_e[kWarpsPerCta], warp_r[kWarpsPerCta];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    e += __shfl_xor_sync(0xffffffffu, e, off);
    r += __shfl_xor_sync(0xffffffffu, r, off);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    warp_e[warp] = e;
    warp_r[warp] = r;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double te = 0, tr = 0;
#pragma unroll
    for (int w = 0; w < kWarpsPerCta; ++w) {
      te += warp_e[w];
      tr += warp_r[w];
    }
    atomic_add_f64(&sums[0], te);
    atomic_add_f64(&sums[1], tr);
  }
}

// The error terms of one value v whose code decodes to `value` (before the scale; int8:
// float(q)) with `scale` (dequantized as the decoders round it, then widened; the
// subtraction and squares in float64).
__device__ __forceinline__ void error_terms(float v, float value, float scale, double& e, double& r) {
  const double x = v;
  const double d = __dsub_rn(static_cast<double>(__fmul_rn(value, scale)), x);
  e = __dadd_rn(e, __dmul_rn(d, d));
  r = __dadd_rn(r, __dmul_rn(x, x));
}

// quantize_error_sq: one warp per block (lane l reads values l + 32 j of it).
template <class Codes>
__global__ void __launch_bounds__(kThreads)
    quantize_error_kernel(const void* __restrict__ x, InputType type, const typename Codes::Code* __restrict__ q,
                          const float* __restrict__ scales, int64_t n, int64_t block_size, double* sums) {
  const int lane = threadIdx.x % 32;
  const int64_t block = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32;
  const int64_t start = block * block_size;
  double e = 0, r = 0;
  if (start < n) {  // (no early return: every thread reaches the CTA reduction)
    const float s = scales[block];
    if ((__float_as_uint(s) & kAbsMask) < kInfBits) {  // a NaN scale: the block held NaN or Inf
      const int64_t end = min(n, start + block_size);
      for (int64_t i = start + lane; i < end; i += 32) {
        error_terms(load_widened(x, type, i), Codes::value(q, i), s, e, r);
      }
    }
  }
  add_error_sums(e, r, sums);
}

// The decoded value (before the scale) of a code the encoder just made.
__device__ __forceinline__ float code_value(Int8Codes, int k) { return static_cast<float>(k); }
__device__ __forceinline__ float code_value(Fp4Codes, int k) { return fp4_value(static_cast<uint32_t>(k)); }

// Stores code k of value i (lane `lane` of the warp; every lane calls it): int8 one byte
// a value; fp4 the even lane writes its code and its right neighbour's as one byte.
__device__ __forceinline__ void store_code(int8_t* q, int64_t i, int64_t n, int k, int) {
  if (i < n) q[i] = static_cast<int8_t>(k);
}
__device__ __forceinline__ void store_code(uint8_t* q, int64_t i, int64_t n, int k, int lane) {
  const int next = __shfl_down_sync(0xffffffffu, k, 1);  // past n: a value of 0, code 0
  if (lane % 2 == 0 && i < n) q[i >> 1] = static_cast<uint8_t>(k | (next << 4));
}

// One block of reduce_quantize_kernel (its warp). With `measure`, adds the block's
// error terms to e, r.
template <class Codes, int V>
__device__ __forceinline__ void reduce_quantize_block(const void* __restrict__ own, InputType type,
                                                      const typename Codes::Code* __restrict__ q,
                                                      const float* __restrict__ scales, int64_t n, float divisor,
                                                      typename Codes::Code* __restrict__ q_out,
                                                      float* __restrict__ scales_out, uint32_t* own_bad,
                                                      uint32_t* result_bad, InputType result_type, int64_t block,
                                                      int lane, bool measure, double& e, double& r) {
  constexpr int64_t B = 32 * V;
  const int64_t start = block * B;
  const float s_in = scales[block];
  float v[V];
  bool bad = false;
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t i = start + lane + 32 * j;
    float x = 0.f;  // (past the end: 0 does not change max |v|)
    if (i < n) {
      const float o = load_widened(own, type, i);
      bad |= nonfinite(o);
      x = __fadd_rn(o, __fmul_rn(Codes::value(q, i), s_in));
      if (divisor != 0.f) x = __fdiv_rn(x, divisor);
    }
    v[j] = x;
    m = max(m, __float_as_uint(x) & kAbsMask);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
  const bool finite = m < kInfBits;
  float scale = __uint_as_float(kCanonicalNaN);
  float inv = 0.f;
  if (finite) {
    Codes::block_scale(__uint_as_float(m), scale, inv, false);  // round to nearest
  }
  if (lane == 0) reinterpret_cast<uint32_t*>(scales_out)[block] = __float_as_uint(scale);
  bool rbad = false;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t i = start + lane + 32 * j;
    const int k = finite ? Codes::nearest(__fmul_rn(v[j], inv)) : 0;
    store_code(q_out, i, n, k, lane);
    if (i < n) {
      const float value = code_value(Codes{}, k);
      if (result_bad) rbad |= nonfinite(rounded(__fmul_rn(value, scale), result_type));
      if (measure && finite) error_terms(v[j], value, scale, e, r);
    }
  }
  raise_flag(bad, own_bad);
  if (result_bad) raise_flag(rbad, result_bad);
}

template <class Codes, int V>
__global__ void __launch_bounds__(kThreads)
    reduce_quantize_kernel(const void* __restrict__ own, InputType type, const typename Codes::Code* __restrict__ q,
                           const float* __restrict__ scales, int64_t n, float divisor,
                           typename Codes::Code* __restrict__ q_out, float* __restrict__ scales_out,
                           uint32_t* own_bad, uint32_t* result_bad, InputType result_type, double* err_sums) {
  const int lane = threadIdx.x % 32;
  const int64_t block = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32;
  double e = 0, r = 0;
  // Warps past the end skip the block (whole warps: the shuffles stay full) but, when
  // the error is measured, still reach the CTA's reduction (err_sums is the grid's).
  if (block * 32 * V < n) {
    reduce_quantize_block<Codes, V>(own, type, q, scales, n, divisor, q_out, scales_out, own_bad, result_bad,
                                    result_type, block, lane, err_sums != nullptr, e, r);
  }
  if (err_sums) add_error_sums(e, r, err_sums);
}

__global__ void __launch_bounds__(kThreads)
    reduce_exact_kernel(const void* __restrict__ own, InputType type, const float* __restrict__ add, int64_t n,
                        float divisor, void* __restrict__ out, InputType out_type, uint32_t* own_bad,
                        uint32_t* result_bad) {
  bool bad = false, rbad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float o = load_widened(own, type, i);
    bad |= nonfinite(o);
    float x = __fadd_rn(o, add[i]);
    if (divisor != 0.f) x = __fdiv_rn(x, divisor);
    rbad |= nonfinite(rounded(x, out_type));
    store_narrowed(out, out_type, i, x);
  }
  raise_flag(bad, own_bad);
  if (result_bad) raise_flag(rbad, result_bad);
}

dim3 grid_for(int64_t n) {
  const int64_t ctas = (n + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(ctas < kMaxGrid ? ctas : kMaxGrid));
}

int log2_of(int64_t b) {
  int k = 0;
  while ((int64_t{1} << k) < b) ++k;
  return k;
}

// Runs f(Codes{}, q, q_out) with the code pointers of `format` (const void* -> its Code*).
template <class F>
cudaError_t with_codes(BlockFormat format, const void* q, void* q_out, const F& f) {
  if (format == BlockFormat::kFp4) {
    return f(Fp4Codes{}, static_cast<const uint8_t*>(q), static_cast<uint8_t*>(q_out));
  }
  return f(Int8Codes{}, static_cast<const int8_t*>(q), static_cast<int8_t*>(q_out));
}

}  // namespace

cudaError_t add_dequantized(BlockFormat format, const void* own, InputType type, const void* q, const float* scales,
                            int64_t n, int64_t block, float* acc, uint32_t* own_bad, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  return with_codes(format, q, nullptr, [&](auto codes, auto* qc, auto*) {
    add_dequantized_kernel<decltype(codes)>
        <<<grid_for(n), kThreads, 0, stream>>>(own, type, qc, scales, n, log2_of(block), acc, own_bad);
    return cudaGetLastError();
  });
}

cudaError_t add_widened(const void* own, InputType type, const float* add, int64_t n, float* acc, uint32_t* own_bad,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_widened_kernel<<<grid_for(n), kThreads, 0, stream>>>(own, type, add, n, acc, own_bad);
  return cudaGetLastError();
}

cudaError_t add_into(float* acc, const float* add, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_into_kernel<<<grid_for(n), kThreads, 0, stream>>>(acc, add, n);
  return cudaGetLastError();
}

cudaError_t widen(const void* src, InputType type, int64_t n, float* dst, uint32_t* bad, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  widen_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, type, n, dst, bad);
  return cudaGetLastError();
}

cudaError_t divide(float* x, int64_t n, float d, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  divide_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, d);
  return cudaGetLastError();
}

cudaError_t narrow(const float* src, int64_t n, InputType type, void* dst, uint32_t* bad, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  narrow_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, n, type, dst, bad);
  return cudaGetLastError();
}

cudaError_t flag_nonfinite_decoded(BlockFormat format, const void* q, const float* scales, int64_t n, int64_t block,
                                   InputType type, uint32_t* bad, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  return with_codes(format, q, nullptr, [&](auto codes, auto* qc, auto*) {
    flag_decoded_kernel<decltype(codes)><<<grid_for(n), kThreads, 0, stream>>>(qc, scales, n, log2_of(block), type, bad);
    return cudaGetLastError();
  });
}

cudaError_t pack_int8_scales(float* scales, int64_t nb, uint8_t* out, cudaStream_t stream) {
  if (nb <= 0) return cudaSuccess;
  pack_int8_scales_kernel<<<1, kThreads, 0, stream>>>(scales, nb, out);
  return cudaGetLastError();
}

cudaError_t unpack_int8_scales(const uint8_t* in, int64_t nb, float* scales, cudaStream_t stream) {
  if (nb <= 0) return cudaSuccess;
  unpack_int8_scales_kernel<<<grid_for(nb), kThreads, 0, stream>>>(in, nb, scales);
  return cudaGetLastError();
}

bool reduce_quantize_supported(int64_t block) { return valid_block_size(block) && block <= 1024; }

cudaError_t reduce_quantize(BlockFormat format, const void* own, InputType type, const void* q, const float* scales,
                            int64_t n, int64_t block, float divisor, void* q_out, float* scales_out, uint32_t* own_bad,
                            uint32_t* result_bad, InputType result_type, cudaStream_t stream, double* err_sums) {
  if (!reduce_quantize_supported(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + block - 1) / block;
  const dim3 grid(static_cast<unsigned>((blocks + kWarpsPerCta - 1) / kWarpsPerCta));
  return with_codes(format, q, q_out, [&](auto codes, auto* qc, auto* qo) {
    using Codes = decltype(codes);
#define PRIME_RQ(V)                                                                                              \
  reduce_quantize_kernel<Codes, V><<<grid, kThreads, 0, stream>>>(own, type, qc, scales, n, divisor, qo,       \
                                                                  scales_out, own_bad, result_bad, result_type, \
                                                                  err_sums)
    switch (block / 32) {
      case 1: PRIME_RQ(1); break;
      case 2: PRIME_RQ(2); break;
      case 4: PRIME_RQ(4); break;
      case 8: PRIME_RQ(8); break;
      case 16: PRIME_RQ(16); break;
      default: PRIME_RQ(32); break;
    }
#undef PRIME_RQ
    return cudaGetLastError();
  });
}

cudaError_t quantize_error_sq(BlockFormat format, const void* x, InputType type, const void* q, const float* scales,
                              int64_t n, int64_t block, double* sums, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + block - 1) / block;
  const dim3 grid(static_cast<unsigned>((blocks + kWarpsPerCta - 1) / kWarpsPerCta));
  return with_codes(format, q, nullptr, [&](auto codes, auto* qc, auto*) {
    quantize_error_kernel<decltype(codes)><<<grid, kThreads, 0, stream>>>(x, type, qc, scales, n, block, sums);
    return cudaGetLastError();
  });
}

cudaError_t reduce_exact(const void* own, InputType type, const float* add, int64_t n, float divisor, void* out,
                         InputType out_type, uint32_t* own_bad, uint32_t* result_bad, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  reduce_exact_kernel<<<grid_for(n), kThreads, 0, stream>>>(own, type, add, n, divisor, out, out_type, own_bad,
                                                            result_bad);
  return cudaGetLastError();
}

}  // namespace prime::codec::cuda
