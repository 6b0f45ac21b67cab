// Plain C++ block kernels of the CPU codec: the fallback for CPUs without AVX2
// (and for non-x86 machines), and the code the SIMD kernels hand their odd
// ends to. Written to the letter of docs/wire-format.md.
// Compiled with -ffp-contract=off: no multiply-add may be fused.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_kernels.h"

namespace prime::codec::cpu {
namespace {

template <class T>
float widen(T v) {
  return static_cast<float>(v);  // bf16 and fp16 widen to fp32 exactly
}

// Round half to even for |v| < 2^22 in the FPU's default mode (nearest even):
// adding and subtracting 1.5 * 2^23 leaves the rounded integer. Not folded away:
// the build has no -ffast-math.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

inline float stochastic_uniform(uint32_t key, int64_t index) {
  const uint32_t h = fmix32(fmix32(static_cast<uint32_t>(index) ^ key) + key);
  return static_cast<float>(h >> 8) * 0x1p-24f;  // exact: h >> 8 < 2^24
}

template <class T>
int64_t quantize_typed(const T* x, int64_t n, int64_t block, int8_t* q, float* scales, bool stochastic,
                       uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const T* xb = x + start;
    int8_t* qb = q + start;
    // max of |x| as bits: for non-negative floats the integer order is the float
    // order, and NaN/Inf sort above every finite value, so one max finds both.
    uint32_t amax = 0;
    for (int64_t i = 0; i < len; ++i) amax = std::max(amax, float_bits(widen(xb[i])) & kAbsMask);
    float* scale = scales + start / block;
    if (amax >= kInfBits) {
      *scale = bits_float(kCanonicalNaN);
      std::memset(qb, 0, len);
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, scale, &inv);
    if (!stochastic) {
      for (int64_t i = 0; i < len; ++i) {
        float r = round_half_even(widen(xb[i]) * inv);
        r = std::min(std::max(r, -127.f), 127.f);
        qb[i] = static_cast<int8_t>(r);
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t index = first_index + start + i;
        const uint32_t key = stochastic_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32));
        const float v = widen(xb[i]) * inv;
        const float f = std::floor(v);
        float r = f + (stochastic_uniform(key, index) < (v - f) ? 1.f : 0.f);
        r = std::min(std::max(r, -127.f), 127.f);
        qb[i] = static_cast<int8_t>(r);
      }
    }
  }
  return bad_blocks;
}

template <class T>
void dequantize_typed(const int8_t* q, const float* scales, int64_t n, int64_t block, T* y) {
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const float s = scales[start / block];
    for (int64_t i = 0; i < len; ++i) y[start + i] = static_cast<T>(static_cast<float>(q[start + i]) * s);
  }
}

}  // namespace

int64_t quantize_scalar(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                        bool stochastic, uint32_t seed, int64_t first_index) {
  switch (type) {
    case InputType::kFloat32:
      return quantize_typed(static_cast<const float*>(x), n, block, q, scales, stochastic, seed, first_index);
    case InputType::kBFloat16:
      return quantize_typed(static_cast<const c10::BFloat16*>(x), n, block, q, scales, stochastic, seed,
                            first_index);
    case InputType::kFloat16:
      return quantize_typed(static_cast<const c10::Half*>(x), n, block, q, scales, stochastic, seed, first_index);
  }
  return 0;
}

// fp32 -> bf16 / fp16 through c10's conversions: round to nearest even, NaN stays NaN.
void dequantize_scalar(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                       InputType out_type) {
  switch (out_type) {
    case InputType::kFloat32:
      return dequantize_typed(q, scales, n, block, static_cast<float*>(y));
    case InputType::kBFloat16:
      return dequantize_typed(q, scales, n, block, static_cast<c10::BFloat16*>(y));
    case InputType::kFloat16:
      return dequantize_typed(q, scales, n, block, static_cast<c10::Half*>(y));
  }
}

void dequantize_add_scalar(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const float s = scales[start / block];
    for (int64_t i = start; i < start + len; ++i) {
      const float p = static_cast<float>(q[i]) * s;
      acc[i] = acc[i] + p;  // multiply, then add: -ffp-contract=off keeps them apart
    }
  }
}

Kernels scalar_kernels() { return {&quantize_scalar, &dequantize_scalar, &dequantize_add_scalar}; }

}  // namespace prime::codec::cpu
