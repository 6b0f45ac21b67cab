// CUDA kernels of the block codecs, int8 and fp4 (docs/wire-format.md). Raw pointers
// and the CUDA runtime only: the torch ops live in ops_cuda.cu. One kernel template per
// operation serves both formats; their element rules are formats_cuda.cuh's.
//
// Bit-exactness with the CPU and the reference: both divisions are __fdiv_rn,
// products and sums use __fmul_rn / __fadd_rn / __fsub_rn (never contracted into
// an FMA; the build also passes --fmad=false), rounding is __float2int_rn
// (nearest even), and no flush-to-zero.
//
// Quantize mapping: a group of G threads owns one block of B elements; each
// thread makes L = 4 sixteen-byte loads (16 fp32 or 32 bf16/fp16 values), keeps
// them in registers, and the group reduces max |x| with warp shuffles (through
// shared memory when the block spans several warps). So the input is read from
// memory exactly once and every load instruction is coalesced within a group.
// G = B / (4 * values per load): fp32 B=256 -> 16 threads, B=4096 -> 256.
// With 64 bytes in flight per thread, quantize streams 256 MiB at 101% of a
// device copy's GB/s on an H200 (B = 32: 90%; benchmarks/RESULTS.md). fp4 has the
// same mapping; each load's values become half as many bytes (2 or 4 per store).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "codec_cuda.h"
#include "formats_cuda.cuh"

namespace prime::codec::cuda {
namespace {

constexpr int kThreads = 256;       // threads per CTA, all kernels
constexpr int kLoads = 4;           // 16-byte loads per thread in quantize
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

// ---- input element types, widened to fp32 exactly ----

struct F32 {
  static constexpr int kSize = 4;
  __device__ static float widen(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  // the 32-bit word w holds 1 value
  __device__ static void widen_word(uint32_t w, float* out) { out[0] = __uint_as_float(w); }
};
struct BF16 {
  static constexpr int kSize = 2;
  __device__ static float widen(const void* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
  __device__ static void widen_word(uint32_t w, float* out) {  // little endian: low half first
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
  }
};
struct F16 {
  static constexpr int kSize = 2;
  __device__ static float widen(const void* p, int64_t i) {
    return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
  }
  __device__ static void widen_word(uint32_t w, float* out) {
    out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
};

__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// max over the G threads of a group (G a power of two; groups are aligned runs
// of threadIdx.x). Every thread of the CTA must call it (shuffles with a full
// mask, and __syncthreads when G > 32).
template <int G>
__device__ __forceinline__ uint32_t group_max(uint32_t m) {
  if constexpr (G == 1) {
    return m;
  } else if constexpr (G <= 32) {
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
  } else {
    __shared__ uint32_t warp_max[kThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    constexpr int kWarps = G / 32;
    const int first = (threadIdx.x / G) * kWarps;
    uint32_t r = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) r = max(r, warp_max[first + w]);
    return r;
  }
}

// In: element type; Codes: the format (Int8Codes, Fp4Codes); G: threads per block;
// kStochastic: stochastic rounding. Block size B = G * kLoads * (16 / In::kSize).
template <class In, class Codes, int G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const void* __restrict__ x, int64_t n, bool aligned, typename Codes::Code* __restrict__ q,
                    float* __restrict__ scales, uint32_t seed) {
  constexpr int kPerLoad = 16 / In::kSize;       // values per 16-byte load: 4 or 8
  constexpr int kPerThread = kLoads * kPerLoad;  // 16 or 32
  constexpr int64_t B = int64_t{G} * kPerThread;
  constexpr int kGroups = kThreads / G;

  const int t = threadIdx.x % G;  // rank in the group
  const int64_t block = int64_t{blockIdx.x} * kGroups + threadIdx.x / G;
  const int64_t start = block * B;
  const bool active = start < n;  // inactive threads still join the reduction
  const bool vector = active && aligned && start + B <= n;

  // load: chunk l of this thread is the (t + G*l)-th run of kPerLoad values of the block,
  // so each load instruction reads G consecutive 16-byte pieces
  float v[kPerThread];
  if (vector) {
    const char* base = static_cast<const char*>(x) + start * In::kSize;
    uint4 w[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) w[l] = *reinterpret_cast<const uint4*>(base + (t + G * l) * 16);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      constexpr int kPerWord = 4 / In::kSize;
      In::widen_word(w[l].x, v + l * kPerLoad + 0 * kPerWord);
      In::widen_word(w[l].y, v + l * kPerLoad + 1 * kPerWord);
      In::widen_word(w[l].z, v + l * kPerLoad + 2 * kPerWord);
      In::widen_word(w[l].w, v + l * kPerLoad + 3 * kPerWord);
    }
  } else {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
#pragma unroll
      for (int j = 0; j < kPerLoad; ++j) {
        const int64_t i = start + (t + G * l) * kPerLoad + j;
        v[l * kPerLoad + j] = (active && i < n) ? In::widen(x, i) : 0.f;  // 0 does not change max |x|
      }
    }
  }

  // max |x| as bits: finite values order like their bits, Inf and NaN above all of them
  uint32_t m = 0;
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) m = max(m, __float_as_uint(v[e]) & kAbsMask);
  m = group_max<G>(m);
  if (!active) return;

  float inv = 0.f;
  const bool finite = m < kInfBits;
  if (finite) {
    float scale;
    Codes::block_scale(__uint_as_float(m), scale, inv, kStochastic);
    if (t == 0) scales[block] = scale;
  } else if (t == 0) {
    reinterpret_cast<uint32_t*>(scales)[block] = kCanonicalNaN;  // the flag, written bit-exact
  }

  uint32_t key = 0;
  if constexpr (kStochastic) {
    // blocks never straddle a multiple of 2^32 (B divides it), so the key is per block
    key = fmix32(seed ^ fmix32(static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32) ^ 0x9e3779b9u));
  }
  int r[kPerThread];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
#pragma unroll
    for (int j = 0; j < kPerLoad; ++j) {
      const int e = l * kPerLoad + j;
      const float p = __fmul_rn(v[e], inv);
      int k;
      if constexpr (kStochastic) {
        const uint32_t lo = static_cast<uint32_t>(start + (t + G * l) * kPerLoad + j);
        const uint32_t h = fmix32(fmix32(lo ^ key) + key);
        const float u = __fmul_rn(__uint2float_rn(h >> 8), 0x1p-24f);  // exact
        k = Codes::stochastic(p, u);
      } else {
        k = Codes::nearest(p);
      }
      r[e] = finite ? k : 0;
    }
  }

  // store: the same layout as the loads, kPerLoad values per chunk (int8: kPerLoad
  // bytes; fp4: kPerLoad / 2, value 2j in the low nibble)
  if constexpr (std::is_same_v<Codes, Int8Codes>) {
    if (vector) {
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        uint32_t words[kPerLoad / 4];
#pragma unroll
        for (int w = 0; w < kPerLoad / 4; ++w) {
          const int* rr = r + l * kPerLoad + w * 4;
          words[w] = (rr[0] & 0xff) | ((rr[1] & 0xff) << 8) | ((rr[2] & 0xff) << 16) |
                     (static_cast<uint32_t>(rr[3] & 0xff) << 24);
        }
        int8_t* dst = q + start + (t + G * l) * kPerLoad;
        if constexpr (kPerLoad == 4) {
          *reinterpret_cast<uint32_t*>(dst) = words[0];
        } else {
          *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
        }
      }
    } else {
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
#pragma unroll
        for (int j = 0; j < kPerLoad; ++j) {
          const int64_t i = start + (t + G * l) * kPerLoad + j;
          if (i < n) q[i] = static_cast<int8_t>(r[l * kPerLoad + j]);
        }
      }
    }
  } else {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      uint32_t word = 0;  // kPerLoad codes: 16 or 32 bits
#pragma unroll
      for (int j = 0; j < kPerLoad; ++j) word |= static_cast<uint32_t>(r[l * kPerLoad + j]) << (4 * j);
      const int64_t first = start + (t + G * l) * kPerLoad;  // even: a run starts a byte
      uint8_t* dst = q + first / 2;
      if (vector) {
        if constexpr (kPerLoad == 4) {
          *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(word);
        } else {
          *reinterpret_cast<uint32_t*>(dst) = word;
        }
      } else {
#pragma unroll
        for (int b = 0; b < kPerLoad / 2; ++b) {  // past n the values were 0: code 0
          if (first + 2 * b < n) dst[b] = static_cast<uint8_t>(word >> (8 * b));
        }
      }
    }
  }
}

template <class In, class Codes, int G>
void launch_quantize(const void* x, int64_t n, bool aligned, typename Codes::Code* q, float* scales,
                     std::optional<uint32_t> seed, cudaStream_t stream) {
  constexpr int64_t B = int64_t{G} * kLoads * (16 / In::kSize);
  constexpr int64_t kGroups = kThreads / G;
  const int64_t nblocks = (n + B - 1) / B;
  const dim3 grid(static_cast<unsigned>((nblocks + kGroups - 1) / kGroups));
  if (seed) {
    quantize_kernel<In, Codes, G, true><<<grid, kThreads, 0, stream>>>(x, n, aligned, q, scales, *seed);
  } else {
    quantize_kernel<In, Codes, G, false><<<grid, kThreads, 0, stream>>>(x, n, aligned, q, scales, 0);
  }
}

// block size -> threads per block for one element type: B = G * 4 * (16 / size)
template <class In, class Codes>
void dispatch_quantize(const void* x, int64_t n, int64_t block, bool aligned, typename Codes::Code* q, float* scales,
                       std::optional<uint32_t> seed, cudaStream_t stream) {
  constexpr int64_t kPerThread = kLoads * (16 / In::kSize);
  switch (block / kPerThread) {
    case 1: return launch_quantize<In, Codes, 1>(x, n, aligned, q, scales, seed, stream);
    case 2: return launch_quantize<In, Codes, 2>(x, n, aligned, q, scales, seed, stream);
    case 4: return launch_quantize<In, Codes, 4>(x, n, aligned, q, scales, seed, stream);
    case 8: return launch_quantize<In, Codes, 8>(x, n, aligned, q, scales, seed, stream);
    case 16: return launch_quantize<In, Codes, 16>(x, n, aligned, q, scales, seed, stream);
    case 32: return launch_quantize<In, Codes, 32>(x, n, aligned, q, scales, seed, stream);
    case 64: return launch_quantize<In, Codes, 64>(x, n, aligned, q, scales, seed, stream);
    case 128: return launch_quantize<In, Codes, 128>(x, n, aligned, q, scales, seed, stream);
    case 256: return launch_quantize<In, Codes, 256>(x, n, aligned, q, scales, seed, stream);
    default: return;  // not reached: the callers check valid_block_size
  }
}

// ---- decoding ----
// A warp decodes 512 consecutive values: lane t takes the 4 values at
// warp_base + 128*k + 4*t for k = 0..3. Every load and store instruction of the
// warp then covers one contiguous run (128 bytes of q, 512 bytes of fp32), which
// keeps the writes full-sector. 32 | B, so 4 aligned values share one scale.

constexpr int kDecodeRuns = 4;                        // runs of 4 values per thread
constexpr int kDecodePerWarp = 32 * 4 * kDecodeRuns;  // 512

struct OutF32 {
  __device__ static void store1(void* y, int64_t i, float v) { static_cast<float*>(y)[i] = v; }
  __device__ static void store4(void* y, int64_t i, const float* v) {  // 16-byte aligned
    *reinterpret_cast<float4*>(static_cast<float*>(y) + i) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
struct OutBF16 {
  __device__ static uint32_t bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
  __device__ static void store1(void* y, int64_t i, float v) {
    static_cast<uint16_t*>(y)[i] = static_cast<uint16_t>(bits(v));
  }
  __device__ static void store4(void* y, int64_t i, const float* v) {  // 8-byte aligned
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(y) + i) =
        make_uint2(bits(v[0]) | (bits(v[1]) << 16), bits(v[2]) | (bits(v[3]) << 16));
  }
};
struct OutF16 {
  __device__ static uint32_t bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static void store1(void* y, int64_t i, float v) {
    static_cast<uint16_t*>(y)[i] = static_cast<uint16_t>(bits(v));
  }
  __device__ static void store4(void* y, int64_t i, const float* v) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(y) + i) =
        make_uint2(bits(v[0]) | (bits(v[1]) << 16), bits(v[2]) | (bits(v[3]) << 16));
  }
};

__device__ __forceinline__ int64_t decode_warp_base() {
  return (int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32) * kDecodePerWarp;
}

// Codes: Int8Codes or Fp4Codes (a lane's 4 values are 4 bytes or 2).
template <class Codes, class Out>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const typename Codes::Code* __restrict__ q, const float* __restrict__ scales, int64_t n,
                      int log2_block, bool aligned, void* __restrict__ y) {
  const int64_t base = decode_warp_base() + 4 * (threadIdx.x % 32);
  if (aligned && base + 128 * (kDecodeRuns - 1) + 4 <= n) {
    uint32_t w[kDecodeRuns];
    float s[kDecodeRuns];
#pragma unroll
    for (int k = 0; k < kDecodeRuns; ++k) {  // all loads first: 4 requests in flight
      w[k] = Codes::load4(q, base + 128 * k);
      s[k] = scales[(base + 128 * k) >> log2_block];
    }
#pragma unroll
    for (int k = 0; k < kDecodeRuns; ++k) {
      float v[4];
      Codes::unpack4(w[k], v);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = __fmul_rn(v[j], s[k]);
      Out::store4(y, base + 128 * k, v);
    }
  } else {
    for (int k = 0; k < kDecodeRuns; ++k) {
      for (int64_t i = base + 128 * k; i < base + 128 * k + 4 && i < n; ++i) {
        Out::store1(y, i, __fmul_rn(Codes::value(q, i), scales[i >> log2_block]));
      }
    }
  }
}

template <class Codes>
__global__ void __launch_bounds__(kThreads)
    dequantize_add_kernel(float* __restrict__ acc, const typename Codes::Code* __restrict__ q,
                          const float* __restrict__ scales, int64_t n, int log2_block, bool aligned) {
  const int64_t base = decode_warp_base() + 4 * (threadIdx.x % 32);
  if (aligned && base + 128 * (kDecodeRuns - 1) + 4 <= n) {
    uint32_t w[kDecodeRuns];
    float s[kDecodeRuns];
    float4 a[kDecodeRuns];
#pragma unroll
    for (int k = 0; k < kDecodeRuns; ++k) {
      w[k] = Codes::load4(q, base + 128 * k);
      s[k] = scales[(base + 128 * k) >> log2_block];
      a[k] = *reinterpret_cast<const float4*>(acc + base + 128 * k);
    }
#pragma unroll
    for (int k = 0; k < kDecodeRuns; ++k) {
      float v[4];
      Codes::unpack4(w[k], v);
      // multiply, then add: two roundings, as the format says
      a[k].x = __fadd_rn(a[k].x, __fmul_rn(v[0], s[k]));
      a[k].y = __fadd_rn(a[k].y, __fmul_rn(v[1], s[k]));
      a[k].z = __fadd_rn(a[k].z, __fmul_rn(v[2], s[k]));
      a[k].w = __fadd_rn(a[k].w, __fmul_rn(v[3], s[k]));
      *reinterpret_cast<float4*>(acc + base + 128 * k) = a[k];
    }
  } else {
    for (int k = 0; k < kDecodeRuns; ++k) {
      for (int64_t i = base + 128 * k; i < base + 128 * k + 4 && i < n; ++i) {
        acc[i] = __fadd_rn(acc[i], __fmul_rn(Codes::value(q, i), scales[i >> log2_block]));
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int log2_of(int64_t b) {
  int k = 0;
  while ((int64_t{1} << k) < b) ++k;
  return k;
}

dim3 decode_grid(int64_t n) {
  const int64_t per_cta = int64_t{kThreads / 32} * kDecodePerWarp;
  return dim3(static_cast<unsigned>((n + per_cta - 1) / per_cta));
}

template <class Codes>
cudaError_t quantize_as(const void* x, InputType type, int64_t n, int64_t block, typename Codes::Code* q,
                        float* scales, std::optional<uint32_t> seed, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const bool aligned = aligned16(x) && aligned16(q);  // torch allocations are; views at odd offsets are not
  switch (type) {
    case InputType::kFloat32:
      dispatch_quantize<F32, Codes>(x, n, block, aligned, q, scales, seed, stream);
      break;
    case InputType::kBFloat16:
      dispatch_quantize<BF16, Codes>(x, n, block, aligned, q, scales, seed, stream);
      break;
    case InputType::kFloat16:
      dispatch_quantize<F16, Codes>(x, n, block, aligned, q, scales, seed, stream);
      break;
  }
  return cudaGetLastError();
}

template <class Codes>
cudaError_t dequantize_as(const typename Codes::Code* q, const float* scales, int64_t n, int64_t block, void* y,
                          InputType out_type, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const bool aligned = aligned16(q) && aligned16(y);
  const int lb = log2_of(block);
  switch (out_type) {
    case InputType::kFloat32:
      dequantize_kernel<Codes, OutF32><<<decode_grid(n), kThreads, 0, stream>>>(q, scales, n, lb, aligned, y);
      break;
    case InputType::kBFloat16:
      dequantize_kernel<Codes, OutBF16><<<decode_grid(n), kThreads, 0, stream>>>(q, scales, n, lb, aligned, y);
      break;
    case InputType::kFloat16:
      dequantize_kernel<Codes, OutF16><<<decode_grid(n), kThreads, 0, stream>>>(q, scales, n, lb, aligned, y);
      break;
  }
  return cudaGetLastError();
}

template <class Codes>
cudaError_t dequantize_add_as(float* acc, const typename Codes::Code* q, const float* scales, int64_t n,
                              int64_t block, cudaStream_t stream) {
  if (!valid_block_size(block)) return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  const bool aligned = aligned16(q) && aligned16(acc);
  dequantize_add_kernel<Codes><<<decode_grid(n), kThreads, 0, stream>>>(acc, q, scales, n, log2_of(block), aligned);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                     std::optional<uint32_t> seed, cudaStream_t stream) {
  return quantize_as<Int8Codes>(x, type, n, block, q, scales, seed, stream);
}

cudaError_t dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type,
                       cudaStream_t stream) {
  return dequantize_as<Int8Codes>(q, scales, n, block, y, out_type, stream);
}

cudaError_t dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block,
                           cudaStream_t stream) {
  return dequantize_add_as<Int8Codes>(acc, q, scales, n, block, stream);
}

cudaError_t quantize_fp4(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                         std::optional<uint32_t> seed, cudaStream_t stream) {
  return quantize_as<Fp4Codes>(x, type, n, block, q, scales, seed, stream);
}

cudaError_t dequantize_fp4(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                           InputType out_type, cudaStream_t stream) {
  return dequantize_as<Fp4Codes>(q, scales, n, block, y, out_type, stream);
}

cudaError_t dequantize_add_fp4(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block,
                               cudaStream_t stream) {
  return dequantize_add_as<Fp4Codes>(acc, q, scales, n, block, stream);
}

}  // namespace prime::codec::cuda
