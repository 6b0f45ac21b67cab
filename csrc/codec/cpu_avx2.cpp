// AVX2 (+F16C) block kernels of the CPU codec, 8 fp32 lanes. Chosen at run time
// by codec_cpu.cpp when the CPU has AVX2 and F16C.
//
// Quantize reads each block twice, both times from L1: once for max |x|, once
// to scale, round and pack 32 values into one 32-byte store. No FMA: the target
// below does not enable it and the build has -ffp-contract=off.
#include "cpu_kernels.h"

#if PRIME_CODEC_X86

#include <immintrin.h>

// Everything after this line is compiled for AVX2 + F16C. Keep it free of
// templates or inline functions from other headers (see cpu_kernels.h).
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

namespace prime::codec::cpu {
namespace {

// ---- loading 8 inputs widened to fp32 (exact) ----
struct LoadF32 {
  using Elem = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
};
struct LoadBF16 {
  using Elem = uint16_t;
  static __m256 load(const uint16_t* p) {  // bf16 is the top half of an fp32
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
};
struct LoadF16 {
  using Elem = uint16_t;
  static __m256 load(const uint16_t* p) {  // vcvtph2ps: exact, subnormals included
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

// Prefetches the cache lines of 32 elements kPrefetchBytes ahead (never faults).
template <class Elem>
inline void prefetch32(const Elem* p) {
  const char* c = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  _mm_prefetch(c, _MM_HINT_T0);
  if constexpr (sizeof(Elem) == 4) _mm_prefetch(c + 64, _MM_HINT_T0);
}

inline __m256i abs_bits(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(kAbsMask)); }

inline uint32_t horizontal_max(__m256i m) {
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
}

inline __m256i fmix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// Round to nearest even (vcvtps2dq in the default MXCSR mode).
inline __m256i round_nearest(__m256 v) { return _mm256_cvtps_epi32(v); }

// floor(v) + (u < v - floor(v)), u from the counter hash of the low index bits.
inline __m256i round_stochastic(__m256 v, __m256i lo, __m256i key) {
  const __m256i h = fmix32x8(_mm256_add_epi32(fmix32x8(_mm256_xor_si256(lo, key)), key));
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
  const __m256 f = _mm256_floor_ps(v);
  const __m256 up = _mm256_and_ps(_mm256_cmp_ps(u, _mm256_sub_ps(v, f), _CMP_LT_OQ), _mm256_set1_ps(1.0f));
  return _mm256_cvtps_epi32(_mm256_add_ps(f, up));  // an integer already: exact
}

// 32 int32 (in [-2^31, 2^31)) -> 32 int8 clamped to [-127, 127], in order.
inline void store32(int8_t* q, __m256i r0, __m256i r1, __m256i r2, __m256i r3) {
  // packs work per 128-bit lane; the permute below puts the dwords back in order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  // saturation clamped to [-128, 127]; -128 is not in the format
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_max_epi8(ordered, _mm256_set1_epi8(-127)));
}

template <class In, bool kStochastic>
int64_t quantize_full_blocks(const typename In::Elem* x, InputType type, int64_t nblocks, int64_t block, int8_t* q,
                             float* scales, uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const typename In::Elem* xb = x + b * block;
    int8_t* qb = q + b * block;
    // pass 1: max |x| as bits (finite values order like their bits; Inf/NaN above all)
    __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
    for (int64_t i = 0; i < block; i += 32) {
      prefetch32<typename In::Elem>(xb + i);
      m0 = _mm256_max_epi32(m0, abs_bits(In::load(xb + i)));
      m1 = _mm256_max_epi32(m1, abs_bits(In::load(xb + i + 8)));
      m2 = _mm256_max_epi32(m2, abs_bits(In::load(xb + i + 16)));
      m3 = _mm256_max_epi32(m3, abs_bits(In::load(xb + i + 24)));
    }
    const uint32_t amax = horizontal_max(_mm256_max_epi32(_mm256_max_epi32(m0, m1), _mm256_max_epi32(m2, m3)));
    if (amax >= kInfBits) {
      scales[b] = bits_float(kCanonicalNaN);
      std::memset(qb, 0, block);
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, scales + b, &inv);
    const __m256 vinv = _mm256_set1_ps(inv);
    // pass 2, from L1: scale, round, pack
    if constexpr (!kStochastic) {
      for (int64_t i = 0; i < block; i += 32) {
        store32(qb + i, round_nearest(_mm256_mul_ps(In::load(xb + i), vinv)),
                round_nearest(_mm256_mul_ps(In::load(xb + i + 8), vinv)),
                round_nearest(_mm256_mul_ps(In::load(xb + i + 16), vinv)),
                round_nearest(_mm256_mul_ps(In::load(xb + i + 24), vinv)));
      }
    } else {
      const int64_t first = first_index + b * block;
      if (!same_key_range(first, block)) {  // indices cross a multiple of 2^32: rare, plain code
        float scale_unused;
        quantize_scalar(xb, type, block, block, qb, &scale_unused, true, seed, first);
        continue;
      }
      const __m256i key = _mm256_set1_epi32(static_cast<int>(
          stochastic_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32))));
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t i = 0; i < block; i += 32) {
        // low 32 bits of the index; wraps like the uint32 arithmetic of the format
        const __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first + i))), lane);
        const __m256i eight = _mm256_set1_epi32(8);
        const __m256i lo1 = _mm256_add_epi32(lo, eight), lo2 = _mm256_add_epi32(lo1, eight);
        const __m256i lo3 = _mm256_add_epi32(lo2, eight);
        store32(qb + i, round_stochastic(_mm256_mul_ps(In::load(xb + i), vinv), lo, key),
                round_stochastic(_mm256_mul_ps(In::load(xb + i + 8), vinv), lo1, key),
                round_stochastic(_mm256_mul_ps(In::load(xb + i + 16), vinv), lo2, key),
                round_stochastic(_mm256_mul_ps(In::load(xb + i + 24), vinv), lo3, key));
      }
    }
  }
  return bad_blocks;
}

template <class In>
int64_t quantize_typed(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                       bool stochastic, uint32_t seed, int64_t first_index) {
  const auto* xt = static_cast<const typename In::Elem*>(x);
  const int64_t full = n / block;
  int64_t bad = stochastic ? quantize_full_blocks<In, true>(xt, type, full, block, q, scales, seed, first_index)
                           : quantize_full_blocks<In, false>(xt, type, full, block, q, scales, seed, first_index);
  const int64_t done = full * block;
  if (done < n) {  // the short last block
    bad += quantize_scalar(xt + done, type, n - done, block, q + done, scales + full, stochastic, seed,
                           first_index + done);
  }
  return bad;
}

int64_t quantize_avx2(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                      bool stochastic, uint32_t seed, int64_t first_index) {
  switch (type) {
    case InputType::kFloat32:
      return quantize_typed<LoadF32>(x, type, n, block, q, scales, stochastic, seed, first_index);
    case InputType::kBFloat16:
      return quantize_typed<LoadBF16>(x, type, n, block, q, scales, stochastic, seed, first_index);
    case InputType::kFloat16:
      return quantize_typed<LoadF16>(x, type, n, block, q, scales, stochastic, seed, first_index);
  }
  return 0;
}

// ---- decoding ----

inline __m256 decode8(const int8_t* q, __m256 scale) {
  const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(w), scale);
}

struct StoreF32 {
  using Elem = float;
  static void store(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
};
struct StoreBF16 {
  using Elem = uint16_t;
  // round to nearest even on the bits, as c10::BFloat16 does; NaN -> 0x7fc0
  static void store(uint16_t* y, __m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
  }
};
struct StoreF16 {
  using Elem = uint16_t;
  static void store(uint16_t* y, __m256 v) {  // vcvtps2ph, nearest even, overflow -> Inf
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

template <class Out>
void dequantize_typed(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  auto* yt = static_cast<typename Out::Elem*>(y);
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      Out::store(yt + i, decode8(q + i, s));
      Out::store(yt + i + 8, decode8(q + i + 8, s));
    }
  }
  const int64_t done = full * block;
  if (done < n) dequantize_scalar(q + done, scales + full, n - done, block, yt + done, out_type);
}

void dequantize_avx2(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  switch (out_type) {
    case InputType::kFloat32:
      return dequantize_typed<StoreF32>(q, scales, n, block, y, out_type);
    case InputType::kBFloat16:
      return dequantize_typed<StoreBF16>(q, scales, n, block, y, out_type);
    case InputType::kFloat16:
      return dequantize_typed<StoreF16>(q, scales, n, block, y, out_type);
  }
}

void dequantize_add_avx2(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      // multiply, then add (never fused)
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), decode8(q + i, s)));
      _mm256_storeu_ps(acc + i + 8, _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), decode8(q + i + 8, s)));
    }
  }
  const int64_t done = full * block;
  if (done < n) dequantize_add_scalar(acc + done, q + done, scales + full, n - done, block);
}

// codec.h's quantize_error_sq over whole blocks: 8 values at a time, widened to
// float64 (exact) before the subtraction, two float64 accumulators per sum.
template <class In>
void error_full_blocks(const typename In::Elem* x, const int8_t* q, const float* scales, int64_t nblocks,
                       int64_t block, double* err, double* ref) {
  __m256d e0 = _mm256_setzero_pd(), e1 = _mm256_setzero_pd(), r0 = _mm256_setzero_pd(), r1 = _mm256_setzero_pd();
  for (int64_t b = 0; b < nblocks; ++b) {
    if ((float_bits(scales[b]) & kAbsMask) >= kInfBits) continue;  // the block held NaN or Inf
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 8) {
      const __m256 v = In::load(x + i);
      const __m256 dq = decode8(q + i, s);  // dequantized, as dequantize rounds it
      const __m256d vl = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d vh = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      const __m256d dl = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(dq)), vl);
      const __m256d dh = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(dq, 1)), vh);
      e0 = _mm256_add_pd(e0, _mm256_mul_pd(dl, dl));  // multiply, then add
      e1 = _mm256_add_pd(e1, _mm256_mul_pd(dh, dh));
      r0 = _mm256_add_pd(r0, _mm256_mul_pd(vl, vl));
      r1 = _mm256_add_pd(r1, _mm256_mul_pd(vh, vh));
    }
  }
  alignas(32) double e[4], r[4];
  _mm256_store_pd(e, _mm256_add_pd(e0, e1));
  _mm256_store_pd(r, _mm256_add_pd(r0, r1));
  *err += (e[0] + e[1]) + (e[2] + e[3]);
  *ref += (r[0] + r[1]) + (r[2] + r[3]);
}

template <class In>
void error_typed(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n, int64_t block,
                 double* err, double* ref) {
  const auto* xt = static_cast<const typename In::Elem*>(x);
  const int64_t full = n / block;
  error_full_blocks<In>(xt, q, scales, full, block, err, ref);
  const int64_t done = full * block;
  if (done < n) quantize_error_sq_scalar(xt + done, type, q + done, scales + full, n - done, block, err, ref);
}

}  // namespace

void quantize_error_sq_avx2(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                            int64_t block, double* err, double* ref) {
  switch (type) {
    case InputType::kFloat32:
      return error_typed<LoadF32>(x, type, q, scales, n, block, err, ref);
    case InputType::kBFloat16:
      return error_typed<LoadBF16>(x, type, q, scales, n, block, err, ref);
    case InputType::kFloat16:
      return error_typed<LoadF16>(x, type, q, scales, n, block, err, ref);
  }
}

}  // namespace prime::codec::cpu

#pragma GCC pop_options

namespace prime::codec::cpu {
Kernels avx2_kernels() { return {&quantize_avx2, &dequantize_avx2, &dequantize_add_avx2}; }
}  // namespace prime::codec::cpu

#endif  // PRIME_CODEC_X86
