// CPU implementation of the int8 block codec (docs/wire-format.md).
// Compiled with -ffp-contract=off: no multiply-add may be fused.
#include "codec.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace prime::codec {
namespace {

inline float load(const void* x, InputType type, int64_t i) {
  switch (type) {
    case InputType::kFloat32:
      return static_cast<const float*>(x)[i];
    case InputType::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(x)[i]);
    case InputType::kFloat16:
      return static_cast<float>(static_cast<const c10::Half*>(x)[i]);
  }
  return 0.f;
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

inline float stochastic_uniform(uint32_t seed, int64_t index) {
  const uint32_t lo = static_cast<uint32_t>(index);
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  const uint32_t k = fmix32(seed ^ fmix32(hi ^ 0x9e3779b9u));
  const uint32_t h = fmix32(fmix32(lo ^ k) + k);
  return static_cast<float>(h >> 8) * 0x1p-24f;
}

// round half to even for |v| < 2^22 without depending on the FPU rounding mode
// being set by anyone else: adding and subtracting 1.5 * 2^23 rounds in the
// current (default: nearest-even) mode, and vectorizes on plain SSE2.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;  // not folded: no -ffast-math
}

}  // namespace

int64_t quantize_range(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                       std::optional<uint32_t> seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  for (int64_t start = 0; start < n; start += block) {
    const int64_t len = std::min(block, n - start);
    float a = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < len; ++i) {
      const float v = load(x, type, start + i);
      finite &= std::isfinite(v);
      a = std::max(a, std::fabs(v));
    }
    float* scale = scales + start / block;
    int8_t* out = q + start;
    if (!finite) {
      *scale = std::numeric_limits<float>::quiet_NaN();
      std::memset(out, 0, len);
      ++bad_blocks;
      continue;
    }
    *scale = a / 127.0f;
    float inv = a > 0.f ? 127.0f / a : 0.f;
    if (std::isinf(inv)) inv = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      const float v = load(x, type, start + i) * inv;
      float r;
      if (seed) {
        const float f = std::floor(v);
        r = f + (stochastic_uniform(*seed, first_index + start + i) < (v - f) ? 1.f : 0.f);
      } else {
        r = round_half_even(v);
      }
      r = std::min(std::max(r, -127.f), 127.f);
      out[i] = static_cast<int8_t>(r);
    }
  }
  return bad_blocks;
}

void dequantize_range(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(q[i]) * scales[i / block];
}

void dequantize_add_range(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = static_cast<float>(q[i]) * scales[i / block];
    acc[i] = acc[i] + p;
  }
}

namespace {
// Work per thread in blocks: big enough to amortize the fork (a few hundred KiB).
constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, kGrainElements / block); }
}  // namespace

int64_t quantize(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                 std::optional<uint32_t> seed) {
  const int64_t nb = num_blocks(n, block);
  std::atomic<int64_t> bad{0};
  const int64_t elem_size = type == InputType::kFloat32 ? 4 : 2;
  at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    const int64_t start = b0 * block;
    const int64_t len = std::min(b1 * block, n) - start;
    const void* xs = static_cast<const char*>(x) + start * elem_size;
    bad += quantize_range(xs, type, len, block, q + start, scales + b0, seed, start);
  });
  return bad.load();
}

void dequantize(const int8_t* q, const float* scales, int64_t n, int64_t block, float* y) {
  const int64_t nb = num_blocks(n, block);
  at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    const int64_t start = b0 * block;
    dequantize_range(q + start, scales + b0, std::min(b1 * block, n) - start, block, y + start);
  });
}

void dequantize_add(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  const int64_t nb = num_blocks(n, block);
  at::parallel_for(0, nb, grain_blocks(block), [&](int64_t b0, int64_t b1) {
    const int64_t start = b0 * block;
    dequantize_add_range(acc + start, q + start, scales + b0, std::min(b1 * block, n) - start, block);
  });
}

}  // namespace prime::codec
