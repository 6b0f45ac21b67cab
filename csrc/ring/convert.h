// Element-wise loops of the exact (codec "none") path and the result write-out:
// widening fp16/bf16 to fp32, rounding fp32 back (round to nearest even, like
// torch), fused add, and NaN/Inf scans. Plain loops the compiler vectorizes; no
// torch headers so the ring builds quickly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace prime::ring {

// Same numbering as codec::InputType.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType t);

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t{h} << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN (as c10::BFloat16 writes it)
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 0x1p-24f;  // subnormal or zero, exact
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN, Inf
  if (a >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24. Scaling by 2^24
    // is exact; the magic-number add rounds to an integer, nearest even.
    float v = bits_float(a) * 0x1p24f;
    v = (v + 12582912.0f) - 12582912.0f;
    return sign | static_cast<uint16_t>(v);
  }
  const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

// dst[i] = float(src[i]). Returns true when every value was finite.
bool widen(const void* src, DType t, int64_t n, float* dst);
// acc[i] = float(own[i]) + add[i]. Returns true when every own value was finite.
bool add_widened(const void* own, DType t, const float* add, int64_t n, float* acc);
// dst[i] = src[i] rounded to t.
void narrow(const float* src, int64_t n, DType t, void* dst);
bool all_finite(const void* src, DType t, int64_t n);
void divide(float* x, int64_t n, float d);

}  // namespace prime::ring
