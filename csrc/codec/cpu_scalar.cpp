// Plain C++ block kernels of the CPU codec: the fallback for CPUs without AVX2
// (and for non-x86 machines), and the code the SIMD kernels hand their odd
// ends to. Written to the letter of docs/wire-format.md, for both formats: the
// block loop is shared, the element rules are Int8Format's and Fp4Format's.
// Compiled with -ffp-contract=off: no multiply-add may be fused.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_scalar_formats.h"

namespace prime::codec::cpu {
namespace {

inline float stochastic_uniform(uint32_t key, int64_t index) {
  const uint32_t h = fmix32(fmix32(static_cast<uint32_t>(index) ^ key) + key);
  return static_cast<float>(h >> 8) * 0x1p-24f;  // exact: h >> 8 < 2^24
}

template <class Format, class T>
int64_t quantize_typed(const T* x, int64_t n, int64_t block, typename Format::Code* q, float* scales,
                       bool stochastic, uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const T* xb = x + start;
    typename Format::Code* qb = Format::at(q, start);
    // max of |x| as bits: for non-negative floats the integer order is the float
    // order, and NaN/Inf sort above every finite value, so one max finds both.
    uint32_t amax = 0;
    for (int64_t i = 0; i < len; ++i) amax = std::max(amax, float_bits(widen(xb[i])) & kAbsMask);
    float* scale = scales + start / block;
    if (amax >= kInfBits) {
      *scale = bits_float(kCanonicalNaN);
      std::memset(qb, 0, static_cast<size_t>(Format::bytes(len)));
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, Format::kQMax, Format::kGridScale, stochastic, scale, &inv);
    for (int64_t i = 0; i < len; ++i) {
      const float v = widen(xb[i]) * inv;
      if (!stochastic) {
        Format::put(qb, i, Format::nearest(v));
      } else {
        const int64_t index = first_index + start + i;
        const uint32_t key = stochastic_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32));
        Format::put(qb, i, Format::stochastic(v, stochastic_uniform(key, index)));
      }
    }
  }
  return bad_blocks;
}

template <class Format, class T>
void dequantize_typed(const typename Format::Code* q, const float* scales, int64_t n, int64_t block, T* y) {
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const float s = scales[start / block];
    for (int64_t i = start; i < start + len; ++i) y[i] = static_cast<T>(Format::value(q, i) * s);
  }
}

template <class Format>
int64_t quantize_as(const void* x, InputType type, int64_t n, int64_t block, typename Format::Code* q, float* scales,
                    bool stochastic, uint32_t seed, int64_t first_index) {
  return with_type<float, c10::BFloat16, c10::Half>(type, [&](auto element) {
    using T = decltype(element);
    return quantize_typed<Format>(static_cast<const T*>(x), n, block, q, scales, stochastic, seed, first_index);
  });
}

// fp32 -> bf16 / fp16 through c10's conversions: round to nearest even, NaN stays NaN.
template <class Format>
void dequantize_as(const typename Format::Code* q, const float* scales, int64_t n, int64_t block, void* y,
                   InputType out_type) {
  with_type<float, c10::BFloat16, c10::Half>(out_type, [&](auto element) {
    dequantize_typed<Format>(q, scales, n, block, static_cast<decltype(element)*>(y));
  });
}

template <class Format>
void dequantize_add_as(float* acc, const typename Format::Code* q, const float* scales, int64_t n, int64_t block) {
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    const float s = scales[start / block];
    for (int64_t i = start; i < start + len; ++i) {
      const float p = Format::value(q, i) * s;
      acc[i] = acc[i] + p;  // multiply, then add: -ffp-contract=off keeps them apart
    }
  }
}

}  // namespace

int64_t quantize_scalar(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                        bool stochastic, uint32_t seed, int64_t first_index) {
  return quantize_as<Int8Format>(x, type, n, block, q, scales, stochastic, seed, first_index);
}

void dequantize_scalar(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                       InputType out_type) {
  dequantize_as<Int8Format>(q, scales, n, block, y, out_type);
}

void dequantize_add_scalar(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_as<Int8Format>(acc, q, scales, n, block);
}

int64_t quantize_fp4_scalar(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                            bool stochastic, uint32_t seed, int64_t first_index) {
  return quantize_as<Fp4Format>(x, type, n, block, q, scales, stochastic, seed, first_index);
}

void dequantize_fp4_scalar(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                           InputType out_type) {
  dequantize_as<Fp4Format>(q, scales, n, block, y, out_type);
}

void dequantize_add_fp4_scalar(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_as<Fp4Format>(acc, q, scales, n, block);
}

Kernels scalar_kernels() {
  return {&quantize_scalar,     &dequantize_scalar,     &dequantize_add_scalar,
          &quantize_fp4_scalar, &dequantize_fp4_scalar, &dequantize_add_fp4_scalar};
}

}  // namespace prime::codec::cpu
