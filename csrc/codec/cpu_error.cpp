// The round-trip error of a range that was just quantized (codec.h: quantize_error_sq
// and quantize_error_sq_fp4), in plain C++: the fallback for CPUs without AVX2 and the
// last partial block of the SIMD versions (cpu_avx2.cpp, cpu_avx512.cpp). It is what the
// ring reports as quant_err_sq / quant_in_sq, so that DiLoCo needs no quantize/dequantize
// pass of its own to measure the error. Compiled with -ffp-contract=off like the rest:
// each product and sum is rounded on its own.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_scalar_formats.h"

namespace prime::codec::cpu {
namespace {

// Four float64 accumulators per sum (float64 additions are not reordered without
// -ffast-math, so independent chains are spelled out).
constexpr int kLanes = 4;

template <class Format, class T>
void error_typed(const T* x, const typename Format::Code* q, const float* scales, int64_t n, int64_t block,
                 double* err, double* ref) {
  double e[kLanes] = {}, r[kLanes] = {};
  for (int64_t start = 0; start < n; start += block) {
    const float s = scales[start / block];
    if ((float_bits(s) & kAbsMask) >= kInfBits) continue;  // NaN scale: the block held NaN or Inf
    const int64_t len = std::min(block, n - start);
    for (int64_t i = 0; i < len; ++i) {
      // widened as quantize reads it (exact), dequantized as dequantize rounds it
      const double v = widen(x[start + i]);
      const double d = static_cast<double>(Format::value(q, start + i) * s) - v;
      e[i % kLanes] += d * d;
      r[i % kLanes] += v * v;
    }
  }
  *err += (e[0] + e[1]) + (e[2] + e[3]);
  *ref += (r[0] + r[1]) + (r[2] + r[3]);
}

template <class Format>
void error_as(const void* x, InputType type, const typename Format::Code* q, const float* scales, int64_t n,
              int64_t block, double* err, double* ref) {
  with_type<float, c10::BFloat16, c10::Half>(type, [&](auto element) {
    error_typed<Format>(static_cast<const decltype(element)*>(x), q, scales, n, block, err, ref);
  });
}

}  // namespace

void quantize_error_sq_scalar(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                              int64_t block, double* err, double* ref) {
  error_as<Int8Format>(x, type, q, scales, n, block, err, ref);
}

void quantize_error_sq_fp4_scalar(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                  int64_t block, double* err, double* ref) {
  error_as<Fp4Format>(x, type, q, scales, n, block, err, ref);
}

}  // namespace prime::codec::cpu
