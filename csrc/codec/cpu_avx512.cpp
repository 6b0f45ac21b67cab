// AVX-512F block kernels of the CPU codec, 16 fp32 lanes. Chosen at run time by
// codec_cpu.cpp when the CPU has AVX-512F. Same structure as cpu_avx2.cpp: each
// block is read twice, both times from L1 (max |x|, then scale-round-pack), and
// one block loop serves int8 and stochastic fp4 (Int8Out, Fp4Out encode and store 16
// values); fp4 round to nearest has its own, which packs its bytes with 256-bit AVX2
// instructions (AVX-512F has no byte shuffles; every AVX-512F CPU has AVX2).
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

#include "cpu_simd_shared.h"

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

// Pass 1 of quantize: max |x| of a whole block as bits (finite values order like their
// bits; Inf and NaN above all of them).
template <class In>
inline uint32_t block_amax(const typename In::Elem* xb, int64_t block) {
  __m512i m0 = _mm512_setzero_si512(), m1 = m0;
  for (int64_t i = 0; i < block; i += 32) {
    prefetch32<typename In::Elem>(xb + i);
    m0 = _mm512_max_epu32(m0, abs_bits(In::load(xb + i)));
    m1 = _mm512_max_epu32(m1, abs_bits(In::load(xb + i + 16)));
  }
  return _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
}

inline __m512i fmix32x16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// u in [0, 1) of the counter hash at the low index bits `lo` (exact).
inline __m512 uniform16(__m512i lo, __m512i key) {
  const __m512i h = fmix32x16(_mm512_add_epi32(fmix32x16(_mm512_xor_si512(lo, key)), key));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
}

// ---- int8: 16 values -> 16 bytes ----
struct Int8Out {
  using Code = int8_t;
  static constexpr float kQMax = 127.0f;
  static constexpr bool kGridScale = true;  // scales on the scale grid (1 byte on the wire)
  static constexpr int64_t kBytesPer16 = 16;
  static constexpr auto& scalar = quantize_scalar;

  // 16 int32 -> 16 int8 clamped to [-127, 127] (vpmovsdb saturates to [-128, 127]).
  static void store16(int8_t* q, __m512i r) {
    const __m128i b = _mm_max_epi8(_mm512_cvtsepi32_epi8(r), _mm_set1_epi8(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), b);
  }
  static __m512i nearest(__m512 v) { return _mm512_cvt_roundps_epi32(v, kNearest); }
  // floor(v) + (u < v - floor(v)).
  static __m512i stochastic(__m512 v, __m512 u) {
    const __m512 f = _mm512_floor_ps(v);
    const __mmask16 up = _mm512_cmp_ps_mask(u, _mm512_sub_ps(v, f), _CMP_LT_OQ);
    return _mm512_cvt_roundps_epi32(_mm512_mask_add_ps(f, up, f, _mm512_set1_ps(1.0f)), kNearest);  // exact
  }
};

// ---- fp4: 16 values -> 8 bytes ----
inline __m512 abs_ps(__m512 v) { return _mm512_castsi512_ps(abs_bits(v)); }

// +1 in every lane where `mask` is set.
inline __m512i count_if(__m512i m, __mmask16 mask) { return _mm512_mask_add_epi32(m, mask, m, _mm512_set1_epi32(1)); }

struct Fp4Out {
  using Code = uint8_t;
  static constexpr float kQMax = kFp4Max;
  static constexpr bool kGridScale = false;
  static constexpr int64_t kBytesPer16 = 8;
  static constexpr auto& scalar = quantize_fp4_scalar;

  // 16 codes (int32 in [0, 16)) -> 8 bytes, value 2j in the low nibble of byte j: as 8
  // qwords (code 2j | code 2j+1 << 32), the low byte of q | q >> 28 is the pair's byte.
  static void store16(uint8_t* q, __m512i c) {
    const __m128i b = _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), b);
  }
  // Adds the sign (8) to a nonzero magnitude m of a negative v.
  static __m512i signed_code(__m512 v, __m512i m) {
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ) & _mm512_test_epi32_mask(m, m);
    return _mm512_mask_or_epi32(m, neg, m, _mm512_set1_epi32(8));
  }
  // The magnitude l just below |v|, one up when u < (|v| - M[l]) * (1 / gap): exact, the
  // gap being 0.5, 1 or 2 (index 7: the inverse gap is 0, so it stays).
  static __m512i stochastic(__m512 v, __m512 u) {
    const __m512 t = abs_ps(v);
    __m512i l = _mm512_setzero_si512();
    for (int k = 1; k < 8; ++k) l = count_if(l, _mm512_cmp_ps_mask(t, _mm512_set1_ps(kFp4Values[k]), _CMP_GE_OQ));
    const __m512 low = _mm512_permutexvar_ps(l, _mm512_loadu_ps(kFp4Values));
    const __m512 inv_gap = _mm512_permutexvar_ps(
        l, _mm512_setr_ps(2.f, 2.f, 2.f, 2.f, 1.f, 1.f, .5f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f));
    const __m512 frac = _mm512_mul_ps(_mm512_sub_ps(t, low), inv_gap);
    return signed_code(v, count_if(l, _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ)));
  }
};

// ---- fp4, round to nearest: 32 values -> 16 bytes ----
//
// E2M1 is a float format (1 mantissa bit, subnormal spacing 0.5), so the FPU rounds to it:
// adding M = 1.5 * 2^(22 + e), e = 0 for |v| < 2, 1 below 4, 2 from 4, rounds v to a
// multiple of the gap of the levels there (2^(e - 1): 0.5, 1, 2), ties to even, which is
// the format's nearest-even rule (|v| = 2 and 4 are levels of both neighbours' grids). Then
// s = M + v is M + r * gap, r the rounded v in gaps, and the magnitude index is m = |r| + 2e.
// M comes from a table by floor(v) (|v| stays below 7) and carries 2e gaps for v >= 0 and
// 16 - 2e for v < 0 in its low mantissa bits (even numbers of gaps: the ties stay on the
// even index), so that s's low byte is m or 16 - m; a table of 16 on its low 4 bits (16 -
// m: 0 for m = 0) gives the code.

// M plus the offset by the low 4 bits of floor(v).
inline __m512 fp4_round_table() {
  constexpr float p0 = 0x1.8p22f, p1 = 0x1.8p23f + 2.f, p2 = 0x1.8p24f + 8.f;  // gaps 0.5, 1, 2
  constexpr float n0 = 0x1.8p22f + 8.f, n1 = 0x1.8p23f + 14.f, n2 = 0x1.8p24f + 24.f;
  //    floor(v):       0   1   2   3   4   5   6   7   8  -7  -6  -5  -4  -3  -2  -1
  return _mm512_setr_ps(p0, p0, p1, p1, p2, p2, p2, p0, p0, n2, n2, n2, n1, n1, n0, n0);
}

// v = x * inv -> 16 bytes: m for v >= 0, 16 - m for v < 0 (m: the nearest magnitude index).
inline __m128i fp4_nearest_bytes(__m512 v, __m512 table) {
  const __m512i key = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 m = _mm512_permutexvar_ps(key, table);
  return _mm512_cvtepi32_epi8(_mm512_castps_si512(_mm512_add_ps(v, m)));  // the low bytes
}

// 32 such bytes (values 0-15, 16-31) -> 16 bytes of codes, value 2j in the low nibble of byte j.
inline void fp4_store32(uint8_t* q, __m128i b0, __m128i b1) {
  // by the low 4 bits: m -> m, 16 - m -> m | 8 (16: 0)
  const __m256i codes = _mm256_shuffle_epi8(_mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 15, 14, 13, 12, 11, 10, 9,
                                                             0, 1, 2, 3, 4, 5, 6, 7, 0, 15, 14, 13, 12, 11, 10, 9),
                                            _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1));
  const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x1001));  // code 2j + 16 * code 2j+1
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);  // qwords 0, 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(packed));
}

template <class In>
int64_t quantize_fp4_nearest_blocks(const typename In::Elem* x, InputType type, int64_t nblocks, int64_t block,
                                    uint8_t* q, float* scales) {
  int64_t bad_blocks = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const typename In::Elem* xb = x + b * block;
    uint8_t* qb = q + b * (block / 2);
    const uint32_t amax = block_amax<In>(xb, block);
    if (amax >= kInfBits) {
      scales[b] = bits_float(kCanonicalNaN);
      std::memset(qb, 0, static_cast<size_t>(block / 2));
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, kFp4Max, /*grid_scale=*/false, /*stochastic=*/false, scales + b, &inv);
    const __m512 vinv = _mm512_set1_ps(inv), table = fp4_round_table();
    // pass 2, from L1: scale, round, pack
    for (int64_t i = 0; i < block; i += 32) {
      fp4_store32(qb + i / 2, fp4_nearest_bytes(_mm512_mul_ps(In::load(xb + i), vinv), table),
                  fp4_nearest_bytes(_mm512_mul_ps(In::load(xb + i + 16), vinv), table));
    }
  }
  return bad_blocks;
}

template <class In, class Out, bool kStochastic>
int64_t quantize_full_blocks(const typename In::Elem* x, InputType type, int64_t nblocks, int64_t block,
                             typename Out::Code* q, float* scales, uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  const int64_t block_bytes = block / 16 * Out::kBytesPer16;
  for (int64_t b = 0; b < nblocks; ++b) {
    const typename In::Elem* xb = x + b * block;
    typename Out::Code* qb = q + b * block_bytes;
    const uint32_t amax = block_amax<In>(xb, block);
    if (amax >= kInfBits) {
      scales[b] = bits_float(kCanonicalNaN);
      std::memset(qb, 0, static_cast<size_t>(block_bytes));
      ++bad_blocks;
      continue;
    }
    float inv;
    block_scale(amax, Out::kQMax, Out::kGridScale, kStochastic, scales + b, &inv);
    const __m512 vinv = _mm512_set1_ps(inv);
    // pass 2, from L1: scale, round, pack
    if constexpr (!kStochastic) {
      for (int64_t i = 0; i < block; i += 32) {
        typename Out::Code* qi = qb + i / 16 * Out::kBytesPer16;
        Out::store16(qi, Out::nearest(_mm512_mul_ps(In::load(xb + i), vinv)));
        Out::store16(qi + Out::kBytesPer16, Out::nearest(_mm512_mul_ps(In::load(xb + i + 16), vinv)));
      }
    } else {
      const int64_t first = first_index + b * block;
      if (!same_key_range(first, block)) {  // indices cross a multiple of 2^32: rare, plain code
        float scale_unused;
        Out::scalar(xb, type, block, block, qb, &scale_unused, true, seed, first);
        continue;
      }
      const __m512i key = _mm512_set1_epi32(static_cast<int>(
          stochastic_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32))));
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < block; i += 32) {
        // low 32 bits of the index; wraps like the uint32 arithmetic of the format
        const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first + i))), lane);
        const __m512i lo1 = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
        typename Out::Code* qi = qb + i / 16 * Out::kBytesPer16;
        Out::store16(qi, Out::stochastic(_mm512_mul_ps(In::load(xb + i), vinv), uniform16(lo, key)));
        Out::store16(qi + Out::kBytesPer16,
                     Out::stochastic(_mm512_mul_ps(In::load(xb + i + 16), vinv), uniform16(lo1, key)));
      }
    }
  }
  return bad_blocks;
}

template <class In, class Out>
int64_t quantize_typed(const void* x, InputType type, int64_t n, int64_t block, typename Out::Code* q, float* scales,
                       bool stochastic, uint32_t seed, int64_t first_index) {
  const auto* xt = static_cast<const typename In::Elem*>(x);
  const int64_t full = n / block;
  int64_t bad = stochastic ? quantize_full_blocks<In, Out, true>(xt, type, full, block, q, scales, seed, first_index)
                           : quantize_full_blocks<In, Out, false>(xt, type, full, block, q, scales, seed, first_index);
  const int64_t done = full * block;
  if (done < n) {  // the short last block
    bad += Out::scalar(xt + done, type, n - done, block, q + done / 16 * Out::kBytesPer16, scales + full, stochastic,
                       seed, first_index + done);
  }
  return bad;
}

template <class Out>
int64_t quantize_as(const void* x, InputType type, int64_t n, int64_t block, typename Out::Code* q, float* scales,
                    bool stochastic, uint32_t seed, int64_t first_index) {
  return with_type<LoadF32, LoadBF16, LoadF16>(type, [&](auto in) {
    return quantize_typed<decltype(in), Out>(x, type, n, block, q, scales, stochastic, seed, first_index);
  });
}

int64_t quantize_avx512(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                        bool stochastic, uint32_t seed, int64_t first_index) {
  return quantize_as<Int8Out>(x, type, n, block, q, scales, stochastic, seed, first_index);
}

int64_t quantize_fp4_avx512(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
                            bool stochastic, uint32_t seed, int64_t first_index) {
  return with_type<LoadF32, LoadBF16, LoadF16>(type, [&](auto in) {
    using In = decltype(in);
    const auto* xt = static_cast<const typename In::Elem*>(x);
    const int64_t full = n / block;
    int64_t bad = stochastic ? quantize_full_blocks<In, Fp4Out, true>(xt, type, full, block, q, scales, seed, first_index)
                             : quantize_fp4_nearest_blocks<In>(xt, type, full, block, q, scales);
    const int64_t done = full * block;
    if (done < n) {  // the short last block
      bad += quantize_fp4_scalar(xt + done, type, n - done, block, q + done / 2, scales + full, stochastic, seed,
                                 first_index + done);
    }
    return bad;
  });
}

// ---- decoding: 16 values at element i of a block's codes, times the scale ----

struct Int8In : Int8Codes {
  static __m512 decode16(const int8_t* q, int64_t i, __m512 scale) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(w), scale);
  }
};

struct Fp4In : Fp4Codes {
  // i: a multiple of 16. The 8 bytes widen to 8 qwords b; in b | b << 28 the low 4 bits of
  // dword 2k are byte k's low nibble and those of dword 2k + 1 its high one, and vpermps
  // reads only those 4 bits of each index: 16 codes in order, looked up in the table of 16.
  static __m512 decode16(const uint8_t* q, int64_t i, __m512 scale) {
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i / 2)));
    const __m512i codes = _mm512_or_si512(b, _mm512_slli_epi64(b, 28));
    return _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(kFp4Values)), scale);
  }
};

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

template <class Codes, class Out>
void dequantize_typed(const typename Codes::Code* q, const float* scales, int64_t n, int64_t block, void* y,
                      InputType out_type) {
  auto* yt = static_cast<typename Out::Elem*>(y);
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 32) {
      Out::store(yt + i, Codes::decode16(q, i, s));
      Out::store(yt + i + 16, Codes::decode16(q, i + 16, s));
    }
  }
  const int64_t done = full * block;
  if (done < n) Codes::dequantize_rest(q + Codes::bytes(done), scales + full, n - done, block, yt + done, out_type);
}

template <class Codes>
void dequantize_as(const typename Codes::Code* q, const float* scales, int64_t n, int64_t block, void* y,
                   InputType out_type) {
  with_type<StoreF32, StoreBF16, StoreF16>(out_type, [&](auto out) {
    dequantize_typed<Codes, decltype(out)>(q, scales, n, block, y, out_type);
  });
}

template <class Codes>
void dequantize_add_as(float* acc, const typename Codes::Code* q, const float* scales, int64_t n, int64_t block) {
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 32) {
      // multiply, then add (never fused)
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), Codes::decode16(q, i, s)));
      _mm512_storeu_ps(acc + i + 16, _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), Codes::decode16(q, i + 16, s)));
    }
  }
  const int64_t done = full * block;
  if (done < n) Codes::dequantize_add_rest(acc + done, q + Codes::bytes(done), scales + full, n - done, block);
}

void dequantize_avx512(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  dequantize_as<Int8In>(q, scales, n, block, y, out_type);
}
void dequantize_add_avx512(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_as<Int8In>(acc, q, scales, n, block);
}
void dequantize_fp4_avx512(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                           InputType out_type) {
  dequantize_as<Fp4In>(q, scales, n, block, y, out_type);
}
void dequantize_add_fp4_avx512(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_as<Fp4In>(acc, q, scales, n, block);
}

// codec.h's quantize_error_sq over whole blocks: 16 values at a time, widened to
// float64 (exact) before the subtraction, two float64 accumulators per sum.
template <class In, class Codes>
void error_full_blocks(const typename In::Elem* x, const typename Codes::Code* q, const float* scales,
                       int64_t nblocks, int64_t block, double* err, double* ref) {
  __m512d e0 = _mm512_setzero_pd(), e1 = _mm512_setzero_pd(), r0 = _mm512_setzero_pd(), r1 = _mm512_setzero_pd();
  for (int64_t b = 0; b < nblocks; ++b) {
    if ((float_bits(scales[b]) & kAbsMask) >= kInfBits) continue;  // the block held NaN or Inf
    const __m512 s = _mm512_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      const __m512 v = In::load(x + i);
      const __m512 dq = Codes::decode16(q, i, s);  // dequantized, as dequantize rounds it
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

template <class In, class Codes>
void error_typed(const void* x, InputType type, const typename Codes::Code* q, const float* scales, int64_t n,
                 int64_t block, double* err, double* ref) {
  const auto* xt = static_cast<const typename In::Elem*>(x);
  const int64_t full = n / block;
  error_full_blocks<In, Codes>(xt, q, scales, full, block, err, ref);
  const int64_t done = full * block;
  if (done < n) Codes::error_rest(xt + done, type, q + Codes::bytes(done), scales + full, n - done, block, err, ref);
}

template <class Codes>
void error_as(const void* x, InputType type, const typename Codes::Code* q, const float* scales, int64_t n,
              int64_t block, double* err, double* ref) {
  with_type<LoadF32, LoadBF16, LoadF16>(type, [&](auto in) {
    error_typed<decltype(in), Codes>(x, type, q, scales, n, block, err, ref);
  });
}

}  // namespace

void quantize_error_sq_avx512(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                              int64_t block, double* err, double* ref) {
  error_as<Int8In>(x, type, q, scales, n, block, err, ref);
}

void quantize_error_sq_fp4_avx512(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                  int64_t block, double* err, double* ref) {
  error_as<Fp4In>(x, type, q, scales, n, block, err, ref);
}

}  // namespace prime::codec::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace prime::codec::cpu {
Kernels avx512_kernels() {
  return {&quantize_avx512,     &dequantize_avx512,     &dequantize_add_avx512,
          &quantize_fp4_avx512, &dequantize_fp4_avx512, &dequantize_add_fp4_avx512};
}
}  // namespace prime::codec::cpu

#endif  // PRIME_CODEC_X86
