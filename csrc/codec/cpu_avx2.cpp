// AVX2 (+F16C) block kernels of the CPU codec, 8 fp32 lanes. Chosen at run time
// by codec_cpu.cpp when the CPU has AVX2 and F16C.
//
// Quantize reads each block twice, both times from L1: once for max |x|, once
// to scale, round and pack 32 values (int8: one 32-byte store; fp4: 16 bytes).
// The block loop is shared by int8 and stochastic fp4 (Int8Out and Fp4Out encode
// and store 32 values); fp4 round to nearest has its own (quantize_fp4_nearest_blocks).
// No FMA: the target below does not enable it and the build has -ffp-contract=off.
#include "cpu_kernels.h"

#if PRIME_CODEC_X86

#include <immintrin.h>

// Everything after this line is compiled for AVX2 + F16C. Keep it free of
// templates or inline functions from other headers (see cpu_kernels.h).
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

#include "cpu_simd_shared.h"

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

// Pass 1 of quantize: max |x| of a whole block as bits (finite values order like their
// bits; Inf and NaN above all of them).
template <class In>
inline uint32_t block_amax(const typename In::Elem* xb, int64_t block) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  for (int64_t i = 0; i < block; i += 32) {
    prefetch32<typename In::Elem>(xb + i);
    m0 = _mm256_max_epi32(m0, abs_bits(In::load(xb + i)));
    m1 = _mm256_max_epi32(m1, abs_bits(In::load(xb + i + 8)));
    m2 = _mm256_max_epi32(m2, abs_bits(In::load(xb + i + 16)));
    m3 = _mm256_max_epi32(m3, abs_bits(In::load(xb + i + 24)));
  }
  return horizontal_max(_mm256_max_epi32(_mm256_max_epi32(m0, m1), _mm256_max_epi32(m2, m3)));
}

inline __m256i fmix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// u in [0, 1) of the counter hash at the low index bits `lo` (exact).
inline __m256 uniform8(__m256i lo, __m256i key) {
  const __m256i h = fmix32x8(_mm256_add_epi32(fmix32x8(_mm256_xor_si256(lo, key)), key));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
}

// ---- int8: 32 values -> 32 bytes ----
struct Int8Out {
  using Code = int8_t;
  static constexpr float kQMax = 127.0f;
  static constexpr bool kGridScale = true;  // scales on the scale grid (1 byte on the wire)
  static constexpr int64_t kBytesPer32 = 32;
  static constexpr auto& scalar = quantize_scalar;

  // 32 int32 (in [-2^31, 2^31)) -> 32 int8 clamped to [-127, 127], in order.
  static void store32(int8_t* q, __m256i r0, __m256i r1, __m256i r2, __m256i r3) {
    // packs work per 128-bit lane; the permute below puts the dwords back in order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
    const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // saturation clamped to [-128, 127]; -128 is not in the format
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_max_epi8(ordered, _mm256_set1_epi8(-127)));
  }
  // Round to nearest even (vcvtps2dq in the default MXCSR mode).
  static __m256i nearest(__m256 v) { return _mm256_cvtps_epi32(v); }
  // floor(v) + (u < v - floor(v)).
  static __m256i stochastic(__m256 v, __m256 u) {
    const __m256 f = _mm256_floor_ps(v);
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(u, _mm256_sub_ps(v, f), _CMP_LT_OQ), _mm256_set1_ps(1.0f));
    return _mm256_cvtps_epi32(_mm256_add_ps(f, up));  // an integer already: exact
  }
};

// ---- fp4: 32 values -> 16 bytes ----
inline __m256 abs_ps(__m256 v) { return _mm256_castsi256_ps(abs_bits(v)); }

// +1 in every lane where a compare (all ones: -1) held.
inline __m256i count_if(__m256i m, __m256 cmp) { return _mm256_sub_epi32(m, _mm256_castps_si256(cmp)); }

struct Fp4Out {
  using Code = uint8_t;
  static constexpr float kQMax = kFp4Max;
  static constexpr bool kGridScale = false;
  static constexpr int64_t kBytesPer32 = 16;
  static constexpr auto& scalar = quantize_fp4_scalar;

  // 32 codes (int32 in [0, 16)) -> 16 bytes, value 2j in the low nibble of byte j.
  static void store32(uint8_t* q, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // each 16-bit word holds codes 2j (low byte) and 2j + 1: fold them into its low byte
    const __m256i pairs =
        _mm256_and_si256(_mm256_or_si256(ordered, _mm256_srli_epi16(ordered, 4)), _mm256_set1_epi16(0xff));
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);  // qwords 0, 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(bytes));
  }
  // Adds the sign (8) to a nonzero magnitude m of a negative v.
  static __m256i signed_code(__m256 v, __m256i m) {
    const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256i nonzero = _mm256_cmpgt_epi32(m, _mm256_setzero_si256());
    return _mm256_or_si256(m, _mm256_and_si256(_mm256_and_si256(neg, nonzero), _mm256_set1_epi32(8)));
  }
  // The magnitude l just below |v|, one up when u < (|v| - M[l]) * (1 / gap): exact, the
  // gap being 0.5, 1 or 2 (index 7: the inverse gap is 0, so it stays).
  static __m256i stochastic(__m256 v, __m256 u) {
    const __m256 t = abs_ps(v);
    __m256i l = _mm256_setzero_si256();
    for (int k = 1; k < 8; ++k) l = count_if(l, _mm256_cmp_ps(t, _mm256_set1_ps(kFp4Values[k]), _CMP_GE_OQ));
    const __m256 low = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), l);
    const __m256 inv_gap = _mm256_permutevar8x32_ps(_mm256_setr_ps(2.f, 2.f, 2.f, 2.f, 1.f, 1.f, .5f, 0.f), l);
    const __m256 frac = _mm256_mul_ps(_mm256_sub_ps(t, low), inv_gap);
    return signed_code(v, count_if(l, _mm256_cmp_ps(u, frac, _CMP_LT_OQ)));
  }
};

// ---- fp4, round to nearest: 32 values -> 16 bytes ----
//
// E2M1 is a float format (1 mantissa bit, subnormal spacing 0.5), so the FPU rounds to it:
// adding M = 1.5 * 2^(22 + e), e = 0 for |v| < 2, 1 below 4, 2 from 4, rounds v to a
// multiple of the gap of the levels there (2^(e - 1): 0.5, 1, 2), ties to even, which is
// the format's nearest-even rule (|v| = 2 and 4 are levels of both neighbours' grids). Then
// s = M + v is M + r * gap, r the rounded v in gaps, and the magnitude index is m = |r| + 2e.
// M comes from a table of 8 by trunc(v / 2) (|v| stays below 7) and carries +-2e gaps (the
// sign of v's) in its low mantissa bits (even numbers of gaps: the ties stay on the even
// index), so that the low 4 bits of s are m for v >= 0 and 16 - m (0 for m = 0) for v < 0;
// a table of 16 on them gives the code.

// h = v / 2 (v = x * inv) -> 8 dwords whose low 4 bits are m (v >= 0) or 16 - m (v < 0), and
// the rest 0. Everything is halved (M and the gaps too), which changes no mantissa bit, so
// the table is indexed by trunc(h) directly: one multiply fewer per 8 values than taking v.
// The caller computes h as x * (inv / 2), which is (x * inv) / 2 exactly while inv / 2 is a
// normal number (see quantize_fp4_nearest_blocks); |h| below 2^-126 codes as 0 either way.
inline __m256i fp4_nearest_bits_half(__m256 h) {
  constexpr float e0 = 0x1.8p21f, p1 = 0x1.8p22f + 1.f, p2 = 0x1.8p23f + 4.f;  // gaps 0.25, 0.5, 1
  constexpr float n1 = 0x1.8p22f - 1.f, n2 = 0x1.8p23f - 4.f;
  const __m256i key = _mm256_cvttps_epi32(h);
  //                                                          trunc(v / 2): 0   1   2   3  -4  -3  -2  -1
  const __m256 m = _mm256_permutevar8x32_ps(_mm256_setr_ps(e0, p1, p2, p2, e0, n2, n2, n1), key);
  return _mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(h, m)), _mm256_set1_epi32(0x0f));
}

// The same from v itself, for blocks whose inv / 2 would be subnormal (scales above 2^125).
inline __m256i fp4_nearest_bits(__m256 v) { return fp4_nearest_bits_half(_mm256_mul_ps(v, _mm256_set1_ps(0.5f))); }

// Packing (value 2j in the low nibble of byte j). 8 dwords from fp4_nearest_bits of 32 values
// (0-7, 8-15, 16-23, 24-31) -> their 16 pair words (code 2j + 16 * code 2j+1), per 128-bit lane
// as the packs leave them: lane 0 pairs values 0-3, 8-11, 16-19, 24-27, lane 1 values 4-7,
// 12-15, 20-23, 28-31 (the values of a pair are neighbours in their lane either way).
inline __m256i fp4_lane_pairs32(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(s0, s1), _mm256_packus_epi32(s2, s3));
  // m -> m, 16 - m -> m | 8
  const __m256i codes = _mm256_shuffle_epi8(_mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 15, 14, 13, 12, 11, 10, 9,
                                                             0, 1, 2, 3, 4, 5, 6, 7, 0, 15, 14, 13, 12, 11, 10, 9),
                                            b);
  return _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x1001));
}

// The pair words of values 0-31 and 32-63 -> 32 bytes of codes in order. Packed, the qwords hold
// pair bytes 0,1,4,5,8,9,12,13 (of 2j, 2j+1), the same + 16, then 2,3,6,7,10,11,14,15 and those
// + 16; qwords 0, 2, 1, 3 put each half in one lane, and one shuffle orders it.
inline __m256i fp4_in_order(__m256i pairs_lo, __m256i pairs_hi) {
  const __m256i x = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs_lo, pairs_hi), 0xD8);
  return _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                                 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

// 32 values (blocks of 32) -> 16 bytes; 64 (blocks of 64 and up) -> 32 bytes in one store.
inline void fp4_store32(uint8_t* q, __m256i pairs) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(fp4_in_order(pairs, pairs)));
}
inline void fp4_store64(uint8_t* q, __m256i pairs_lo, __m256i pairs_hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), fp4_in_order(pairs_lo, pairs_hi));
}

// Pass 2 of one block: x * mul, rounded (kHalved: mul = inv / 2), packed.
template <class In, bool kHalved>
inline void fp4_nearest_block(const typename In::Elem* xb, int64_t block, float mul, uint8_t* qb) {
  const __m256 vmul = _mm256_set1_ps(mul);
  auto bits = [&](int64_t i) {
    const __m256 t = _mm256_mul_ps(In::load(xb + i), vmul);
    if constexpr (kHalved) return fp4_nearest_bits_half(t);
    else return fp4_nearest_bits(t);
  };
  auto pairs = [&](int64_t i) { return fp4_lane_pairs32(bits(i), bits(i + 8), bits(i + 16), bits(i + 24)); };
  if (block % 64 == 0) {
    for (int64_t i = 0; i < block; i += 64) fp4_store64(qb + i / 2, pairs(i), pairs(i + 32));
  } else {
    for (int64_t i = 0; i < block; i += 32) fp4_store32(qb + i / 2, pairs(i));
  }
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
    // pass 2, from L1: scale, round, pack. Normally on h = x * (inv / 2), which is (x * inv) / 2
    // bit for bit while inv / 2 is normal; from v = x * inv in blocks whose scale is above 2^125.
    if (inv >= 0x1p-125f) {
      fp4_nearest_block<In, true>(xb, block, inv * 0.5f, qb);
    } else {
      fp4_nearest_block<In, false>(xb, block, inv, qb);
    }
  }
  return bad_blocks;
}

template <class In, class Out, bool kStochastic>
int64_t quantize_full_blocks(const typename In::Elem* x, InputType type, int64_t nblocks, int64_t block,
                             typename Out::Code* q, float* scales, uint32_t seed, int64_t first_index) {
  int64_t bad_blocks = 0;
  const int64_t block_bytes = block / 32 * Out::kBytesPer32;
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
    const __m256 vinv = _mm256_set1_ps(inv);
    // pass 2, from L1: scale, round, pack
    if constexpr (!kStochastic) {
      for (int64_t i = 0; i < block; i += 32) {
        Out::store32(qb + i / 32 * Out::kBytesPer32, Out::nearest(_mm256_mul_ps(In::load(xb + i), vinv)),
                     Out::nearest(_mm256_mul_ps(In::load(xb + i + 8), vinv)),
                     Out::nearest(_mm256_mul_ps(In::load(xb + i + 16), vinv)),
                     Out::nearest(_mm256_mul_ps(In::load(xb + i + 24), vinv)));
      }
    } else {
      const int64_t first = first_index + b * block;
      if (!same_key_range(first, block)) {  // indices cross a multiple of 2^32: rare, plain code
        float scale_unused;
        Out::scalar(xb, type, block, block, qb, &scale_unused, true, seed, first);
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
        Out::store32(qb + i / 32 * Out::kBytesPer32,
                     Out::stochastic(_mm256_mul_ps(In::load(xb + i), vinv), uniform8(lo, key)),
                     Out::stochastic(_mm256_mul_ps(In::load(xb + i + 8), vinv), uniform8(lo1, key)),
                     Out::stochastic(_mm256_mul_ps(In::load(xb + i + 16), vinv), uniform8(lo2, key)),
                     Out::stochastic(_mm256_mul_ps(In::load(xb + i + 24), vinv), uniform8(lo3, key)));
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
    bad += Out::scalar(xt + done, type, n - done, block, q + done / 32 * Out::kBytesPer32, scales + full, stochastic,
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

int64_t quantize_avx2(const void* x, InputType type, int64_t n, int64_t block, int8_t* q, float* scales,
                      bool stochastic, uint32_t seed, int64_t first_index) {
  return quantize_as<Int8Out>(x, type, n, block, q, scales, stochastic, seed, first_index);
}

int64_t quantize_fp4_avx2(const void* x, InputType type, int64_t n, int64_t block, uint8_t* q, float* scales,
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

// ---- decoding: 8 values at element i of a block's codes, times the scale ----

struct Int8In : Int8Codes {
  static __m256 decode8(const int8_t* q, int64_t i, __m256 scale) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), scale);
  }
};

struct Fp4In : Fp4Codes {
  // i: a multiple of 8. The 4 bytes widen to 4 qwords; each becomes its two codes as dwords
  // (low nibble | high nibble << 32): 8 codes in order. The magnitude comes from a table of
  // 8, the sign bit from bit 3 of the code.
  static __m256 decode8(const uint8_t* q, int64_t i, __m256 scale) {
    int32_t word;
    std::memcpy(&word, q + i / 2, 4);
    const __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(word));
    const __m256i codes = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi64x(0xf)),
                                          _mm256_slli_epi64(_mm256_and_si256(b, _mm256_set1_epi64x(0xf0)), 28));
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), codes);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_or_ps(magnitude, _mm256_castsi256_ps(sign)), scale);
  }
};

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

template <class Codes, class Out>
void dequantize_typed(const typename Codes::Code* q, const float* scales, int64_t n, int64_t block, void* y,
                      InputType out_type) {
  auto* yt = static_cast<typename Out::Elem*>(y);
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      Out::store(yt + i, Codes::decode8(q, i, s));
      Out::store(yt + i + 8, Codes::decode8(q, i + 8, s));
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
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 16) {
      // multiply, then add (never fused)
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), Codes::decode8(q, i, s)));
      _mm256_storeu_ps(acc + i + 8, _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), Codes::decode8(q, i + 8, s)));
    }
  }
  const int64_t done = full * block;
  if (done < n) Codes::dequantize_add_rest(acc + done, q + Codes::bytes(done), scales + full, n - done, block);
}

void dequantize_avx2(const int8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  dequantize_as<Int8In>(q, scales, n, block, y, out_type);
}
void dequantize_add_avx2(float* acc, const int8_t* q, const float* scales, int64_t n, int64_t block) {
  dequantize_add_as<Int8In>(acc, q, scales, n, block);
}
// ---- fp4 decoding, 32 values (16 bytes) at a time ----
//
// Byte shuffles instead of Fp4In's 8 at a time: the fp32 bits of every E2M1 value (times
// its sign) have only the high 16 bits set, so two 16-entry byte tables (vpshufb) give
// them from the codes, and interleaving them above zero words makes the floats.

// The floats of the 32 codes in q[0, 16), in order: f[k] holds values 8k .. 8k + 7.
inline void fp4_decode32(const uint8_t* q, __m256 f[4]) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  // 16-bit words, zero-extended: lane 0 <- bytes 0, 1, 4, 5, 8, 9, 12, 13; lane 1 <- 2, 3, 6, 7, ...
  // (so that the unpacks below leave 8 consecutive values in each result)
  const __m256i w = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                                            2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1));
  // each word 0x00ab becomes 0x0a0b: the byte's two codes, value 2j (low nibble) first
  const __m256i codes = _mm256_and_si256(_mm256_or_si256(w, _mm256_slli_epi16(w, 4)), _mm256_set1_epi16(0x0f0f));
  // bits 31..24 and 23..16 of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8: -0.0)
  const __m256i high = _mm256_shuffle_epi8(
      _mm256_setr_epi8(0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41, -0x40, -0x40, -0x40, -0x40,
                       0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41, -0x40, -0x40, -0x40, -0x40),
      codes);
  const __m256i low = _mm256_shuffle_epi8(
      _mm256_setr_epi8(0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40, 0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40,
                       0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40, 0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40),
      codes);
  const __m256i w0 = _mm256_unpacklo_epi8(low, high);  // values 0-3, 8-11 | 4-7, 12-15
  const __m256i w1 = _mm256_unpackhi_epi8(low, high);  // values 16-19, 24-27 | 20-23, 28-31
  const __m256i zero = _mm256_setzero_si256();
  f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w0));
  f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w0));
  f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w1));
  f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w1));
}

// Decodes the whole blocks of q, 32 values at a time, and hands each 8 of them, times their
// block's scale, to put(index of the first, values); returns the number of whole blocks.
template <class Put>
inline int64_t decode_fp4_blocks(const uint8_t* q, const float* scales, int64_t n, int64_t block, Put&& put) {
  const int64_t full = n / block;
  for (int64_t b = 0; b < full; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    for (int64_t i = b * block; i < (b + 1) * block; i += 32) {
      __m256 f[4];
      fp4_decode32(q + i / 2, f);
      for (int k = 0; k < 4; ++k) put(i + 8 * k, _mm256_mul_ps(f[k], s));
    }
  }
  return full;
}

template <class Out>
void dequantize_fp4_typed(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y, InputType out_type) {
  auto* yt = static_cast<typename Out::Elem*>(y);
  const int64_t full = decode_fp4_blocks(q, scales, n, block, [&](int64_t at, __m256 v) { Out::store(yt + at, v); });
  const int64_t done = full * block;
  if (done < n) dequantize_fp4_scalar(q + done / 2, scales + full, n - done, block, yt + done, out_type);
}

void dequantize_fp4_avx2(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* y,
                         InputType out_type) {
  with_type<StoreF32, StoreBF16, StoreF16>(out_type, [&](auto out) {
    dequantize_fp4_typed<decltype(out)>(q, scales, n, block, y, out_type);
  });
}

void dequantize_add_fp4_avx2(float* acc, const uint8_t* q, const float* scales, int64_t n, int64_t block) {
  // multiply (in decode_fp4_blocks), then add: never fused
  const int64_t full = decode_fp4_blocks(q, scales, n, block, [&](int64_t at, __m256 v) {
    _mm256_storeu_ps(acc + at, _mm256_add_ps(_mm256_loadu_ps(acc + at), v));
  });
  const int64_t done = full * block;
  if (done < n) dequantize_add_fp4_scalar(acc + done, q + done / 2, scales + full, n - done, block);
}

// codec.h's quantize_error_sq over whole blocks: 8 values at a time, widened to
// float64 (exact) before the subtraction, two float64 accumulators per sum.
template <class In, class Codes>
void error_full_blocks(const typename In::Elem* x, const typename Codes::Code* q, const float* scales,
                       int64_t nblocks, int64_t block, double* err, double* ref) {
  __m256d e0 = _mm256_setzero_pd(), e1 = _mm256_setzero_pd(), r0 = _mm256_setzero_pd(), r1 = _mm256_setzero_pd();
  for (int64_t b = 0; b < nblocks; ++b) {
    if ((float_bits(scales[b]) & kAbsMask) >= kInfBits) continue;  // the block held NaN or Inf
    const __m256 s = _mm256_set1_ps(scales[b]);
    const int64_t start = b * block;
    for (int64_t i = start; i < start + block; i += 8) {
      const __m256 v = In::load(x + i);
      const __m256 dq = Codes::decode8(q, i, s);  // dequantized, as dequantize rounds it
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

void quantize_error_sq_avx2(const void* x, InputType type, const int8_t* q, const float* scales, int64_t n,
                            int64_t block, double* err, double* ref) {
  error_as<Int8In>(x, type, q, scales, n, block, err, ref);
}

void quantize_error_sq_fp4_avx2(const void* x, InputType type, const uint8_t* q, const float* scales, int64_t n,
                                int64_t block, double* err, double* ref) {
  error_as<Fp4In>(x, type, q, scales, n, block, err, ref);
}

}  // namespace prime::codec::cpu

#pragma GCC pop_options

namespace prime::codec::cpu {
Kernels avx2_kernels() {
  return {&quantize_avx2,     &dequantize_avx2,     &dequantize_add_avx2,
          &quantize_fp4_avx2, &dequantize_fp4_avx2, &dequantize_add_fp4_avx2};
}
}  // namespace prime::codec::cpu

#endif  // PRIME_CODEC_X86
