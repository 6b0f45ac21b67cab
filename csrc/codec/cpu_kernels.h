// Internal to the CPU codec: the single-threaded block kernels of each
// instruction set. codec_cpu.cpp picks one table at run time and splits the
// work across threads at block boundaries.
//
// The SIMD tables live in their own files (cpu_avx2.cpp, cpu_avx512.cpp), which
// switch the target with `#pragma GCC target` after their includes. Everything
// defined there has internal linkage, so no AVX instruction can leak into an
// inline function the linker might share with code that runs on older CPUs.
#pragma once

#include <cstdint>
#include <cstring>

#include "codec.h"
#include "scale_grid.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PRIME_CODEC_X86 1
#else
#define PRIME_CODEC_X86 0
#endif

namespace prime::codec::cpu {

// All kernels work on [0, n) of the given pointers; the first element is the
// start of a block. `first_index` is the flattened index of x[0] (keys the
// stochastic rounding). Full blocks and a shorter last block are both allowed.
// fp4 ranges: `q` points at the byte holding the range's first code (ranges start at a
// block, so at an even element).
struct Kernels {
  int64_t (*quantize)(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                      bool stochastic, uint32_t seed, int64_t first_index);
  void (*dequantize)(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type);
  void (*dequantize_add)(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block);
  int64_t (*quantize_fp4)(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                          bool stochastic, uint32_t seed, int64_t first_index);
  void (*dequantize_fp4)(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                         InputType out_type);
  void (*dequantize_add_fp4)(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block);
};

Kernels scalar_kernels();  // cpu_scalar.cpp: plain C++, any CPU
#if PRIME_CODEC_X86
Kernels avx2_kernels();    // cpu_avx2.cpp: AVX2 + F16C
Kernels avx512_kernels();  // cpu_avx512.cpp: AVX-512F
#endif

// The scalar block kernels, also used by the SIMD files for the parts they
// leave to plain code (a short last block, a stochastic block whose indices
// cross a multiple of 2^32).
int64_t quantize_scalar(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                        bool stochastic, uint32_t seed, int64_t first_index);
void dequantize_scalar(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type);
void dequantize_add_scalar(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block);
int64_t quantize_fp4_scalar(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                            bool stochastic, uint32_t seed, int64_t first_index);
void dequantize_fp4_scalar(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                           InputType out_type);
void dequantize_add_fp4_scalar(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block);

// codec.h's quantize_error_sq on one range (adds to *err and *ref): plain C++
// (cpu_error.cpp, also the SIMD versions' last partial block), AVX2 (cpu_avx2.cpp)
// and AVX-512F (cpu_avx512.cpp). Not in the Kernels tables: the float64 pass is
// arithmetic-bound, so the widest vectors win (codec_cpu.cpp picks them).
// The _fp4 versions read packed fp4 codes (q: the bytes, as in Kernels).
void quantize_error_sq_scalar(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                              int64_t block, double* err, double* ref);
void quantize_error_sq_fp4_scalar(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                  int64_t block, double* err, double* ref);
#if PRIME_CODEC_X86
void quantize_error_sq_avx2(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                            int64_t block, double* err, double* ref);
void quantize_error_sq_avx512(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                              int64_t block, double* err, double* ref);
void quantize_error_sq_fp4_avx2(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                int64_t block, double* err, double* ref);
void quantize_error_sq_fp4_avx512(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                  int64_t block, double* err, double* ref);
#endif

// ---- shared scalar pieces (static: a private copy per file, see above) ----

// The SIMD quantize kernels prefetch the input this far ahead of the block they
// read. One core's streaming read rate rose from 10.4 to 13-14 GB/s with it
// (2048: 12.6, 4096: 13.6, 8192: 14.1, 16384: 12.7 GB/s; 64 MiB fp32, one thread,
// the 2-core Xeon of the CI machine, benchmarks/RESULTS.md).
constexpr int64_t kPrefetchBytes = 8192;

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;       // |x| bits >= this: Inf or NaN
constexpr uint32_t kCanonicalNaN = 0x7fc00000u;  // the flag scale of a non-finite block

static inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// scale and inverse of a finite block whose largest |x| has the bits `amax_bits`
// (docs/wire-format.md). int8 (grid_scale): scale = a / 127.5 rounded up to the scale grid
// (scale_grid.h) for round-to-nearest codes, a / 127 for stochastic ones (`stochastic`),
// and inv = 1 / scale. fp4: scale = a / 6, inv = 6 / a. IEEE divisions; inv is 0 when the
// divisor is 0 and when the quotient overflows (fp4's tiny subnormal blocks).
static inline void block_scale(uint32_t amax_bits, float qmax, bool grid_scale, bool stochastic, float* scale,
                               float* inv) {
  const float a = bits_float(amax_bits);
  if (grid_scale) {  // 1 / scale from a table (scale_grid.h): the IEEE quotient, bit for bit
    uint32_t s, r;
    grid_round_up_and_inverse(float_bits(a / (stochastic ? qmax : qmax + 0.5f)), &s, &r);
    *scale = bits_float(s);
    *inv = bits_float(r);
    return;
  }
  *scale = a / qmax;
  float r = a > 0.f ? qmax / a : 0.f;
  if (float_bits(r) == kInfBits) r = 0.f;
  *inv = r;
}

// f(T{}) with T the one of three element types (a file's loaders, storers or element types
// for fp32, bf16, fp16) that `type` names: the dtype dispatch of every kernel.
template <class F32, class BF16, class F16, class F>
static inline auto with_type(InputType type, F&& f) {
  switch (type) {
    case InputType::kBFloat16:
      return f(BF16{});
    case InputType::kFloat16:
      return f(F16{});
    default:
      return f(F32{});
  }
}

// ---- fp4 (E2M1 codes: sign << 3 | magnitude index; docs/wire-format.md) ----

// The decoded value of each code before the scale; code 8 (never written) is -0.
constexpr float kFp4Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                  -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The nearest magnitude index of t = |v| (0 <= t, a little above 6 at most): one count
// per midpoint below t; a t on a midpoint goes to the even index.
static inline int fp4_nearest(float t) {
  return (t > 0.25f) + (t >= 0.75f) + (t > 1.25f) + (t >= 1.75f) + (t > 2.5f) + (t >= 3.5f) + (t > 5.f);
}

// Stochastic: the magnitude l just below t, plus one when u < (t - M[l]) / gap (exact:
// Sterbenz, and a power-of-two gap); 7 stays 7.
static inline int fp4_stochastic(float t, float u) {
  const int l = (t >= 0.5f) + (t >= 1.f) + (t >= 1.5f) + (t >= 2.f) + (t >= 3.f) + (t >= 4.f) + (t >= 6.f);
  if (l == 7) return 7;
  const float frac = (t - kFp4Values[l]) / (kFp4Values[l + 1] - kFp4Values[l]);
  return l + (u < frac ? 1 : 0);
}

// The code of v with magnitude index m: a zero magnitude is code 0 whatever v's sign.
static inline uint8_t fp4_code(float v, int m) {
  return static_cast<uint8_t>(m == 0 ? 0 : (v < 0.f ? m | 8 : m));
}

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The per-block key of the stochastic-rounding generator: depends only on the
// high 32 bits of the element index.
static inline uint32_t stochastic_key(uint32_t seed, uint32_t hi) { return fmix32(seed ^ fmix32(hi ^ 0x9e3779b9u)); }

// Blocks hold at most 4096 elements, so a block at a block-aligned index never
// straddles a multiple of 2^32; one at an arbitrary `first_index` might.
static inline bool same_key_range(int64_t first, int64_t len) {
  return (static_cast<uint64_t>(first) >> 32) == (static_cast<uint64_t>(first + len - 1) >> 32);
}

}  // namespace prime::codec::cpu
