// Device-side element rules of the two block formats (docs/wire-format.md), shared by
// the CUDA kernels of the codec (codec_cuda.cu) and of the ring (ring_cuda.cu), so
// that one kernel template serves both. The arithmetic is the format's, operation for
// operation: _rn intrinsics, integer bit building, comparisons against exact constants.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace prime::codec::cuda {

// The int8 scale grid (docs/wire-format.md; the host's scale_grid.h): 0 or 2^e * G[j],
// G[j] = 2^(j / 18) in fp32, j < 18. Their mantissa bits, as immediates:
#define PRIME_GRID_MANTISSAS(X)                                                                                  \
  X(0, 0x000000u) X(1, 0x050672u) X(2, 0x0a3f66u) X(3, 0x0facd6u) X(4, 0x1550d3u) X(5, 0x1b2d80u) X(6, 0x214518u) \
  X(7, 0x2799eau) X(8, 0x2e2e5eu) X(9, 0x3504f3u) X(10, 0x3c2043u) X(11, 0x4382ffu) X(12, 0x4b2ff5u)            \
  X(13, 0x532a10u) X(14, 0x5b7457u) X(15, 0x6411f0u) X(16, 0x6d0620u) X(17, 0x76544du)

// The bits of the smallest grid value >= t (bits of a non-negative finite fp32): 0 stays 0,
// t below 2^-126 gives 2^-126.
__device__ __forceinline__ uint32_t grid_round_up(uint32_t t) {
  const uint32_t m = t & 0x7fffffu;
  uint32_t up = 0x800000u;  // above G[17]: 2^(e + 1), a carry into the exponent
#define PRIME_GRID_UP(j, g) up = (m <= (g) && up == 0x800000u) ? (g) : up;
  PRIME_GRID_MANTISSAS(PRIME_GRID_UP)
#undef PRIME_GRID_UP
  if (t < 0x00800000u) return t == 0 ? 0u : 0x00800000u;
  return (t & 0x7f800000u) + up;
}

// The grid index 18 e + j of a positive normal grid value's bits.
__device__ __forceinline__ int grid_index(uint32_t s) {
  const uint32_t m = s & 0x7fffffu;
  int j = 0;
#define PRIME_GRID_BELOW(k, g) j += (g) < m ? 1 : 0;
  PRIME_GRID_MANTISSAS(PRIME_GRID_BELOW)
#undef PRIME_GRID_BELOW
  return static_cast<int>(s >> 23) * 18 + j;
}

// The bits of the grid value of index k (18 <= k < 18 * 255).
__device__ __forceinline__ uint32_t grid_value(int k) {
  uint32_t g = 0;
#define PRIME_GRID_AT(j, v) g = (k % 18 == (j)) ? (v) : g;
  PRIME_GRID_MANTISSAS(PRIME_GRID_AT)
#undef PRIME_GRID_AT
  return (static_cast<uint32_t>(k / 18) << 23) | g;
}

// int8: one byte a value, q = clamp(round(v), -127, 127).
struct Int8Codes {
  using Code = int8_t;
  static constexpr float kQMax = 127.0f;
  // The scale and inverse of a finite block with max |x| = a: a / 127.5 rounded up to the
  // scale grid (1 byte on the wire) for round-to-nearest codes, a / 127 for stochastic ones
  // (`up`); then inv = 1 / scale (0 when scale is 0).
  __device__ __forceinline__ static void block_scale(float a, float& scale, float& inv, bool up) {
    scale = __uint_as_float(grid_round_up(__float_as_uint(__fdiv_rn(a, up ? kQMax : kQMax + 0.5f))));
    inv = scale > 0.f ? __fdiv_rn(1.f, scale) : 0.f;
  }
  __device__ __forceinline__ static int nearest(float v) { return min(max(__float2int_rn(v), -127), 127); }
  // floor(v) + (u < v - floor(v)); both terms exact.
  __device__ __forceinline__ static int stochastic(float v, float u) {
    const float f = floorf(v);
    return min(max(__float2int_rn(f) + (u < __fsub_rn(v, f) ? 1 : 0), -127), 127);
  }
  __device__ __forceinline__ static float value(const Code* q, int64_t i) { return static_cast<float>(q[i]); }
  // The codes of the 4 values at element i (a multiple of 4): 4 bytes (4-byte aligned),
  // loaded as they are (decoders load first, unpack later: fewer live registers) ...
  __device__ __forceinline__ static uint32_t load4(const Code* q, int64_t i) {
    return *reinterpret_cast<const uint32_t*>(q + i);
  }
  // ... and their values.
  __device__ __forceinline__ static void unpack4(uint32_t w, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(static_cast<int8_t>((w >> (8 * k)) & 0xffu));
  }
};

// The fp32 value (+-M[m], before the scale) of an fp4 code: the E2M1 value built from its
// bits (0, 0.5, then 2^((m >> 1) - 1) * (1 + (m & 1) / 2)), the sign from bit 3 (code 8: -0).
__device__ __forceinline__ float fp4_value(uint32_t code) {
  const uint32_t m = code & 7u;
  const uint32_t magnitude = m < 2 ? m * 0x3f000000u : (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
  return __uint_as_float(magnitude | ((code & 8u) << 28));
}

// The index m of the E2M1 magnitude M[m] nearest to |v|, a midpoint to the even index: the
// format's seven comparisons (docs/wire-format.md, "fp4") in six operations. For |v| in
// [2^e, 2^(e+1)), the magic M = 2^(22 + max(e, 0)) leaves fp32 a spacing of 0.5 (|v| < 2),
// 1 (|v| in [2, 4)) or 2 (|v| in [4, 8)) above M: the spacing of E2M1 there. So |v| + M, one
// IEEE addition, rounds |v| to the E2M1 grid, ties to even (the grid value with the even
// index), and subtracting M again is exact. Times 2^-126 (exact, no flush to zero), fp32's
// exponent bias 127 becomes E2M1's 1 (0.5 the subnormal 2^-127), so bits 22..24 of the
// product are the E2M1 exponent and mantissa: m. Holds for every |v| < 7 (checked on every
// such fp32 against the comparisons: tools/check_fp4_rounding.py); v = x * inv of a finite
// block is at most 6 + 2^-21.
__device__ __forceinline__ uint32_t fp4_nearest_magnitude(float v) {
  const uint32_t pow2 = max(__float_as_uint(v) & 0x7f800000u, 0x3f800000u);  // 2^max(e, 0), as bits
  const float magic = __uint_as_float(pow2 + (22u << 23));
  const float r = __fsub_rn(__fadd_rn(fabsf(v), magic), magic);
  return __float_as_uint(__fmul_rn(r, 0x1p-126f)) >> 22;
}

// fp4: two E2M1 codes a byte, value 2j in the low nibble of byte j.
struct Fp4Codes {
  using Code = uint8_t;
  static constexpr float kQMax = 6.0f;
  // scale = a / 6 and inv = 6 / a (0 when a is 0 or the quotient overflows): fp32 scales.
  __device__ __forceinline__ static void block_scale(float a, float& scale, float& inv, bool) {
    scale = __fdiv_rn(a, kQMax);
    inv = a > 0.f ? __fdiv_rn(kQMax, a) : 0.f;
    if (isinf(inv)) inv = 0.f;  // tiny subnormal blocks: all codes are zero
  }
  // A zero magnitude is code 0, whatever the sign of v.
  __device__ __forceinline__ static int signed_code(float v, int m) { return m > 0 && v < 0.f ? (m | 8) : m; }
  // The code of the nearest magnitude (fp4_nearest_magnitude; |v| < 7), the sign on m > 0 only:
  // m + 7 has bit 3 set exactly when m is 1..7.
  __device__ __forceinline__ static int nearest(float v) {
    const uint32_t m = fp4_nearest_magnitude(v);
    return static_cast<int>(m | ((__float_as_uint(v) >> 28) & (m + 7u) & 8u));
  }
  // The magnitude l just below |v|, plus one when u < (|v| - M[l]) * (1 / gap): exact (Sterbenz,
  // and a gap of 0.5, 1 or 2); index 7 stays.
  __device__ __forceinline__ static int stochastic(float v, float u) {
    const float t = fabsf(v);
    const int l = (t >= 0.5f) + (t >= 1.f) + (t >= 1.5f) + (t >= 2.f) + (t >= 3.f) + (t >= 4.f) + (t >= 6.f);
    const float inv_gap = l < 4 ? 2.f : l < 6 ? 1.f : l < 7 ? 0.5f : 0.f;
    const float frac = __fmul_rn(__fsub_rn(t, fp4_value(static_cast<uint32_t>(l))), inv_gap);
    return signed_code(v, l + (u < frac ? 1 : 0));
  }
  __device__ __forceinline__ static float value(const Code* q, int64_t i) {
    return fp4_value((static_cast<uint32_t>(q[i >> 1]) >> (4 * (i & 1))) & 15u);
  }
  // The codes of the 4 values at element i (a multiple of 4): 2 bytes (2-byte aligned).
  __device__ __forceinline__ static uint32_t load4(const Code* q, int64_t i) {
    return *reinterpret_cast<const uint16_t*>(q + (i >> 1));
  }
  // fp4_value of each code in fewer operations, for the decoders' inner loop: the E2M1 bits m
  // placed at fp32 bits 22..24 are the value times 2^-126 (exponent bias 1 instead of 127;
  // m = 1, 0.5, is the subnormal 2^-127), and times 2^126 is exact (no flush to zero). (The
  // ring's kernels keep fp4_value: with this form ptxas spilled a few bytes around the division
  // calls of three of them.)
  __device__ __forceinline__ static void unpack4(uint32_t w, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t code = (w >> (4 * k)) & 15u;
      out[k] = __fmul_rn(__uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)), 0x1p126f);
    }
  }
};

}  // namespace prime::codec::cuda
