// Internal to the plain C++ kernels (cpu_scalar.cpp, cpu_error.cpp): the element rules
// of each block format (docs/wire-format.md), so that one block loop serves both.
// Not for the SIMD files (see cpu_kernels.h on what they may include).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace prime::codec::cpu {

template <class T>
inline float widen(T v) {
  return static_cast<float>(v);  // bf16 and fp16 widen to fp32 exactly
}

// Round half to even for |v| < 2^22 in the FPU's default mode (nearest even):
// adding and subtracting 1.5 * 2^23 leaves the rounded integer. Not folded away:
// the build has no -ffast-math.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// int8: one byte a value, q = clamp(round(v), -127, 127).
struct Int8Format {
  using Code = int8_t;
  static constexpr float kQMax = 127.0f;
  static constexpr bool kGridScale = true;  // scales on the scale grid (1 byte on the wire)
  static int64_t bytes(int64_t values) { return values; }
  static Code* at(Code* q, int64_t i) { return q + i; }
  static int8_t nearest(float v) { return static_cast<int8_t>(std::min(std::max(round_half_even(v), -127.f), 127.f)); }
  static int8_t stochastic(float v, float u) {
    const float f = std::floor(v);
    const float r = f + (u < (v - f) ? 1.f : 0.f);
    return static_cast<int8_t>(std::min(std::max(r, -127.f), 127.f));
  }
  // Writes value i of a block (in order: 0, 1, 2, ...).
  static void put(Code* qb, int64_t i, int8_t c) { qb[i] = c; }
  static float value(const Code* q, int64_t i) { return static_cast<float>(q[i]); }
};

// fp4: two E2M1 codes a byte, value 2j in the low nibble of byte j.
struct Fp4Format {
  using Code = uint8_t;
  static constexpr float kQMax = kFp4Max;
  static constexpr bool kGridScale = false;
  static int64_t bytes(int64_t values) { return (values + 1) / 2; }
  static Code* at(Code* q, int64_t i) { return q + i / 2; }  // i even
  static uint8_t nearest(float v) { return fp4_code(v, fp4_nearest(std::fabs(v))); }
  static uint8_t stochastic(float v, float u) { return fp4_code(v, fp4_stochastic(std::fabs(v), u)); }
  // In order: an even i starts its byte (clearing the high nibble), an odd one completes it.
  static void put(Code* qb, int64_t i, uint8_t c) {
    if (i % 2 == 0) {
      qb[i / 2] = c;
    } else {
      qb[i / 2] = static_cast<uint8_t>(qb[i / 2] | (c << 4));
    }
  }
  static float value(const Code* q, int64_t i) { return kFp4Values[(q[i / 2] >> (4 * (i % 2))) & 15]; }
};

}  // namespace prime::codec::cpu
