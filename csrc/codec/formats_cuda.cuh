// Device-side element rules of the two block formats (docs/wire-format.md), shared by
// the CUDA kernels of the codec (codec_cuda.cu) and of the ring (ring_cuda.cu), so
// that one kernel template serves both. The arithmetic is the format's, operation for
// operation: _rn intrinsics, integer bit building, comparisons against exact constants.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace prime::codec::cuda {

// int8: one byte a value, q = clamp(round(v), -127, 127).
struct Int8Codes {
  using Code = int8_t;
  static constexpr float kQMax = 127.0f;
  // The scale and inverse of a finite block with max |x| = a: a / 127 rounded to a bf16
  // value in the bits (2 bytes on the wire), to nearest (ties to even) for round-to-nearest
  // codes, upward for stochastic ones (`up`); then inv = 1 / scale (0 when scale is 0 or the
  // quotient overflows).
  __device__ __forceinline__ static void block_scale(float a, float& scale, float& inv, bool up) {
    const uint32_t u = __float_as_uint(__fdiv_rn(a, kQMax));
    scale = __uint_as_float((u + (up ? 0xffffu : 0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u);
    inv = scale > 0.f ? __fdiv_rn(1.f, scale) : 0.f;
    if (isinf(inv)) inv = 0.f;  // tiny subnormal blocks: all q are zero
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
