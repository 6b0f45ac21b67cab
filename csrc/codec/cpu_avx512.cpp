// AVX-512F block kernels of the CPU codec, 16 fp32 lanes. Chosen at run time by
// codec_cpu.cpp when the CPU has AVX-512F. Same structure as cpu_avx2.cpp: each
// block is read twice, both times from L1 (max |x|, then scale-round-pack).
// No FMA: -ffp-contract=off and no fused intrinsics.
#include "cpu_kernels.h"

#if PRIME_CODEC_X86

#include <immintrin.h>

// Everything after this line is compiled for AVX-512F. Keep it free of
// templates or inline functions from other headers (see cpu_kernels.h).
#pragma GCC push_options
#pragma GCC target("avx512f")
// GCC 12 warns about the deliberately undefined vector inside its own
// _mm512_undefined_* helpers; nothing here reads an uninitialized value.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace prime::codec::cpu {
namespace {

constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// ---- loading 16 inputs widened to fp32 (exact) ----
struct LoadF32 {
  using Elem = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};
struct LoadBF16 {
  using Elem = uint16_t;
  static __m512 load(const uint16_t* p) {  // bf16 is the top half of an fp32
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
};
struct LoadF16 {
  using Elem = uint16_t;
  static __m512 load(const uint16_t* p) {  // vcvtph2ps: exact, subnormals included
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

// Prefetches the cache lines of 32 elements kPrefetchBytes ahead (never faults).
template <class Elem>
inline void prefetch32(const Elem* p) {
  const char* c = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  _mm_prefetch(c, _MM_HINT_T0);
  if constexpr (sizeof(Elem) == 4) _mm_prefetch(c + 64, _MM_HINT_T0);
}

inline __m512i abs_bits(__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kAbsMask)); }

inline __m512i fmix32x16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

inline __m512i round_nearest(__m512 v) { return _mm512_cvt_roundps_epi32(v, kNearest); }

// floor(v) + (u < v - floor(v)), u from the counter hash of the low index bits.
inline __m512i round_stochastic(__m512 v, __m512i lo, __m512i key) {
  const __m512i h = fmix32x16(_mm512_add_epi32(fmix32x16(_mm512_xor_si512(lo, key)), key));
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
  const __m512 f = _mm512_floor_ps(v);
  const __mmask16 up = _mm512_cmp_ps_mask(u, _mm512_sub_ps(v, f), _CMP_LT_OQ);
  return _mm512_cvt_roundps_epi32(_mm512_mask_add_ps(f, up, f, _mm512_set1_ps(1.0f)), kNearest);  // exact
}

// 16 int32 -> 16 int8 clamped to [-127, 127] (vpmovsdb saturates to [-128, 127]).
inline void store16(int8_t* q, __m512i r) {
  const __m128i b = _mm_max_epi8(_mm512_cvtsepi32_epi8(r), _mm_set1_epi8(-127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), b);
}

template <class In, bool kStochastic>
int64_t quantize_full_blocks(const typename In::Elem* x, InputType type, int64_t nblocks, int64_t block, int8_t* q,
                             float* scales, uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const typename In::Elem* xb = x + b * block;
    int8_t* qb = q + b * block;
    // pass 1: max |x| as bits (finite values order like their bits; Inf/NaN above all)
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    for (int64_t i = 0; i < block; i += 32) {
      prefetch32<typename In::Elem>(xb + i);
      m0 = _mm512_max_epu32(m0, abs_bits(In::load(xb + i)));
      m1 = _mm512_max_epu32(m1, abs_bits(In::load(xb + i + 16)));
    }
    const uint32_t amax = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
    if (amax >= kInfBits) {
      scales[b] = bits_float(kCanonicalNaN);
      std::memset(qb, 0, block);
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, scales + b, &inv);
    const __m512 vinv = _mm512_set1_ps(inv);
    // pass 2, from L1: scale, round, pack
    if constexpr (!kStochastic) {
      for (int64_t i = 0; i < block; i += 32) {
        store16(qb + i, round_nearest(_mm512_mul_ps(In::load(xb + i), vinv)));
        store16(qb + i + 16, round_nearest(_mm512_mul_ps(In::load(xb + i + 16), vinv)));
      }
    } else {
      const int64_t first = first_index + b * block;
      if (!same_key_range(first, block)) {  // indices cross a multiple of 2^32: rare, plain code
        float scale_unused;
        quantize_scalar(xb, type, block, block, qb, &scale_unused, true, seed, first);
        continue;
      }
      const __m512i key = _mm512_set1_epi32(static_cast<int>(
          stochastic_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32))));
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < block; i += 32) {
        // low 32 bits of the index; wraps like the uint32 arithmetic of the format
        const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first + i))), lane);
        const __m512i lo1 = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
        store16(qb + i, round_stochastic(_mm512_mul_ps(In::load(xb + i), vinv), lo, key));
        store16(qb + i + 16, round_stochastic(_mm512_mul_ps(In::load(xb + i + 16), vinv), lo1, key));
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

int64_t quantize_avx512(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
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

inline __m512 decode16(const int8_t* q, __m512 scale) {
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(w), scale);
}

struct StoreF32 {
  using Elem = float;
  static void store(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
};
struct StoreBF16 {
  using Elem = uint16_t;
  // round to nearest even on the bits, as c10::BFloat16 does; NaN -> 0x7fc0.
  // (Not vcvtneps2bf16: it flushes subnormal inputs to zero.)
  static void store(uint16_t* y, __m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(r));
  }
};
struct StoreF16 {
  using Elem = uint16_t;
  static void store(uint16_t* y, __m512 v) {  // vcvtps2ph, nearest even, overflow -> Inf
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtps_ph(v, kNearest));
  }
};

template <class Out>
void dequantize_typed(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  auto* yt = static_cast<typename Out::Elem*>(y);
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 32) {
      Out::store(yt + i, decode16(q + i, s));
      Out::store(yt + i + 16, decode16(q + i + 16, s));
    }
  }
  const int64_t done = full * block;
  if (done < n) dequantize_scalar(q + done, scales + full, n - done, block, yt + done, out_type);
}

void dequantize_avx512(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  switch (out_type) {
    case InputType::kFloat32:
      return dequantize_typed<StoreF32>(q, scales, n, block, y, out_type);
    case InputType::kBFloat16:
      return dequantize_typed<StoreBF16>(q, scales, n, block, y, out_type);
    case InputType::kFloat16:
      return dequantize_typed<StoreF16>(q, scales, n, block, y, out_type);
  }
}

void dequantize_add_avx512(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 32) {
      // multiply, then add (never fused)
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), decode16(q + i, s)));
      _mm512_storeu_ps(acc + i + 16, _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), decode16(q + i + 16, s)));
    }
  }
  const int64_t done = full * block;
  if (done < n) dequantize_add_scalar(acc + done, q + done, scales + full, n - done, block);
}

// codec.h's quantize_error_sq over whole blocks: 16 values at a time, widened to
// float64 (exact) before the subtraction, two float64 accumulators per sum.
template <class In>
void error_full_blocks(const typename In::Elem* x, const int8_t* q, const float* scales, int64_t nblocks,
                       int64_t block, double* err, double* ref) {
  __m512d e0 = _mm512_setzero_pd(), e1 = _mm512_setzero_pd(), r0 = _mm512_setzero_pd(), r1 = _mm512_setzero_pd();
  for (int64_t b = 0; b < nblocks; ++b) {
    if ((float_bits(scales[b]) & kAbsMask) >= kInfBits) continue;  // the block held NaN or Inf
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      const __m512 v = In::load(x + i);
      const __m512 dq = decode16(q + i, s);  // dequantized, as dequantize rounds it
      const __m512d vl = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d vh = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      const __m512d dl = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(dq)), vl);
      const __m512d dh =
          _mm512_sub_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dq), 1))), vh);
      e0 = _mm512_add_pd(e0, _mm512_mul_pd(dl, dl));  // multiply, then add
      e1 = _mm512_add_pd(e1, _mm512_mul_pd(dh, dh));
      r0 = _mm512_add_pd(r0, _mm512_mul_pd(vl, vl));
      r1 = _mm512_add_pd(r1, _mm512_mul_pd(vh, vh));
    }
  }
  alignas(64) double e[8], r[8];
  _mm512_store_pd(e, _mm512_add_pd(e0, e1));
  _mm512_store_pd(r, _mm512_add_pd(r0, r1));
  *err += ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
  *ref += ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
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

void quantize_error_sq_avx512(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
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

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace prime::codec::cpu {
Kernels avx512_kernels() { return {&quantize_avx512, &dequantize_avx512, &dequantize_add_avx512}; }
}  // namespace prime::codec::cpu

#endif  // PRIME_CODEC_X86
