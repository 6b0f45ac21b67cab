// Element-wise kernels of the ring's GPU path (ring_cuda.h). Grid-stride loops over
// contiguous runs: a ring segment is 256 Ki values, a few microseconds of memory
// traffic, so launch count matters more than the loop's shape. Arithmetic with the
// _rn intrinsics (and --fmad=false), as in codec_cuda.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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

__global__ void __launch_bounds__(kThreads)
    add_dequantized_kernel(const void* __restrict__ own, InputType type, const int8_t* __restrict__ q,
                           const float* __restrict__ scales, int64_t n, int log2_block, float* __restrict__ acc,
                           uint32_t* own_bad) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    const float o = load_widened(own, type, i);
    bad |= nonfinite(o);
    acc[i] = __fadd_rn(o, __fmul_rn(static_cast<float>(q[i]), scales[i >> log2_block]));
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

__global__ void __launch_bounds__(kThreads)
    flag_decoded_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales, int64_t n, int log2_block,
                        InputType type, uint32_t* flag) {
  bool bad = false;
  for (int64_t i = first_index(); i < n; i += stride()) {
    bad |= nonfinite(rounded(__fmul_rn(static_cast<float>(q[i]), scales[i >> log2_block]), type));
  }
  raise_flag(bad, flag);
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

}  // namespace

cudaError_t add_dequantized(const void* own, InputType type, const int8_t* q, const float* scales, int64_t n,
                            int64_t block, float* acc, uint32_t* own_bad, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  add_dequantized_kernel<<<grid_for(n), kThreads, 0, stream>>>(own, type, q, scales, n, log2_of(block), acc, own_bad);
  return cudaGetLastError();
}

cudaError_t add_widened(const void* own, InputType type, const float* add, int64_t n, float* acc, uint32_t* own_bad,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_widened_kernel<<<grid_for(n), kThreads, 0, stream>>>(own, type, add, n, acc, own_bad);
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

cudaError_t flag_nonfinite_decoded(const int8_t* q, const float* scales, int64_t n, int64_t block, InputType type,
                                   uint32_t* bad, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  flag_decoded_kernel<<<grid_for(n), kThreads, 0, stream>>>(q, scales, n, log2_of(block), type, bad);
  return cudaGetLastError();
}

}  // namespace prime::codec::cuda
