// Internal to the SIMD kernel files (cpu_avx2.cpp, cpu_avx512.cpp): the pieces of their
// kernels that do not depend on the vector width. Each file includes it after its
// `#pragma GCC target`, so everything here is compiled for that file's instruction set,
// with internal linkage (no copy is shared between the two; see cpu_kernels.h).
#pragma once

#include "cpu_kernels.h"

namespace prime::codec::cpu {
namespace {

// Per format, what a decoder needs besides its vector decode: the code type, the bytes of
// a whole number of values, and the plain kernels for the short last block.
struct Int8Codes {
  using Code = int8_t;
  static constexpr auto& dequantize_rest = dequantize_scalar;
  static constexpr auto& dequantize_add_rest = dequantize_add_scalar;
  static constexpr auto& error_rest = quantize_error_sq_scalar;
  static int64_t bytes(int64_t values) { return values; }
};

struct Fp4Codes {
  using Code = uint8_t;
  static constexpr auto& dequantize_rest = dequantize_fp4_scalar;
  static constexpr auto& dequantize_add_rest = dequantize_add_fp4_scalar;
  static constexpr auto& error_rest = quantize_error_sq_fp4_scalar;
  static int64_t bytes(int64_t values) { return values / 2; }  // (an even number of values)
};

}  // namespace
}  // namespace prime::codec::cpu
