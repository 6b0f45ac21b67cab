#include "convert.h"

namespace prime::ring {
namespace {

// Exponent all ones: NaN or Inf. Written on bits so the loops vectorize.
inline uint32_t bad_f32(uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u; }
inline uint32_t bad_bf16(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }
inline uint32_t bad_f16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

}  // namespace

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

bool widen(const void* src, DType t, int64_t n, float* dst) {
  uint32_t bad = 0;
  if (t == DType::kFloat32) {
    const uint32_t* s = static_cast<const uint32_t*>(src);
    for (int64_t i = 0; i < n; ++i) bad |= bad_f32(s[i]);
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (t == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      bad |= bad_bf16(s[i]);
      dst[i] = bf16_to_float(s[i]);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      bad |= bad_f16(s[i]);
      dst[i] = half_to_float(s[i]);
    }
  }
  return bad == 0;
}

bool add_widened(const void* own, DType t, const float* add, int64_t n, float* acc) {
  uint32_t bad = 0;
  if (t == DType::kFloat32) {
    const float* s = static_cast<const float*>(own);
    for (int64_t i = 0; i < n; ++i) {
      bad |= bad_f32(float_bits(s[i]));
      acc[i] = s[i] + add[i];
    }
  } else if (t == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(own);
    for (int64_t i = 0; i < n; ++i) {
      bad |= bad_bf16(s[i]);
      acc[i] = bf16_to_float(s[i]) + add[i];
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(own);
    for (int64_t i = 0; i < n; ++i) {
      bad |= bad_f16(s[i]);
      acc[i] = half_to_float(s[i]) + add[i];
    }
  }
  return bad == 0;
}

void narrow(const float* src, int64_t n, DType t, void* dst) {
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (t == DType::kBFloat16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
  }
}

bool all_finite(const void* src, DType t, int64_t n) {
  uint32_t bad = 0;
  if (t == DType::kFloat32) {
    const uint32_t* s = static_cast<const uint32_t*>(src);
    for (int64_t i = 0; i < n; ++i) bad |= bad_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if (t == DType::kBFloat16) {
      for (int64_t i = 0; i < n; ++i) bad |= bad_bf16(s[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) bad |= bad_f16(s[i]);
    }
  }
  return bad == 0;
}

void divide(float* x, int64_t n, float d) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / d;  // a true division, as the reference does
}

}  // namespace prime::ring
