// The int8 scale grid (docs/wire-format.md, "Encoding one block"): every int8 scale is 0
// or 2^e * G[j] for an fp32 exponent e and G[j] = 2^(j / 18) rounded to fp32 (j < 18),
// so a scale is one integer k = 18 e + j, its grid index, and a ring payload sends it as
// one byte below the payload's largest k. Host code: the CPU codec rounds to the grid, the
// ring packs and unpacks indices. (The CUDA kernels do the same with comparisons,
// formats_cuda.cuh; tests/test_golden.py pins both.)
#pragma once

#include <cstdint>

namespace prime::codec {

constexpr int kGridSteps = 18;
// The mantissa bits of G[0..17], and G[18] = 2^23: added to the exponent field, the
// carry into the next octave.
constexpr uint32_t kGridMantissa[kGridSteps + 1] = {
    0x000000, 0x050672, 0x0a3f66, 0x0facd6, 0x1550d3, 0x1b2d80, 0x214518, 0x2799ea, 0x2e2e5e, 0x3504f3,
    0x3c2043, 0x4382ff, 0x4b2ff5, 0x532a10, 0x5b7457, 0x6411f0, 0x6d0620, 0x76544d, 0x800000};
constexpr uint32_t kMinNormalBits = 0x00800000u;  // 2^-126: the smallest scale but 0

// kGridBuckets.below[m >> 15] = how many G[j] lie below the first mantissa of that bucket of 2^15.
// The grid's mantissas are at least 2^17 apart, so a bucket holds at most one of them.
struct GridBuckets {
  uint8_t below[256];
  constexpr GridBuckets() : below() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint8_t n = 0;
      for (int j = 0; j < kGridSteps; ++j) n += kGridMantissa[j] < (b << 15) ? 1 : 0;
      below[b] = n;
    }
  }
};
constexpr GridBuckets kGridBuckets{};

// The inverse of a grid value is a table lookup: for s = 2^(E - 127) * G[j], 1 / s is
// 2^(127 - E) / G[j], and fp32(1 / G[j]) (in (1/2, 1] for j < 18) times a power of two is
// exact, so its bits are ((254 - E) << 23) - kGridInverseSub[j] for the exponent field E of
// t and the j below (j = 18: the next octave's 2^(E + 1 - 127), whose inverse is
// one octave down). kGridInverseSub[j] = 2^23 - the mantissa bits of fp32(1 / G[j]) for
// 0 < j < 18 (one exponent step down, then that mantissa). Equal, bit for bit, to the IEEE
// division 1 / s of the other backends for every grid value from 2^-126 to 2^125 (exponent
// fields up to 252; the largest scale the rule makes, from FLT_MAX / 127, has 248).
constexpr uint32_t kGridInverseSub[kGridSteps + 1] = {
    0x000000, 0x09abb2, 0x12f9e0, 0x1bee10, 0x248ba9, 0x2cd5ef, 0x34d00b, 0x3c7d02, 0x43dfbe, 0x4afb0d,
    0x51d1a3, 0x586616, 0x5ebae8, 0x64d280, 0x6aaf2d, 0x70532a, 0x75c09a, 0x7af98e, 0x800000};

// The bits of the smallest grid value >= t, for the bits of a non-negative finite fp32 t
// (0 stays 0, t below 2^-126, subnormal, gives 2^-126; never Inf for t <= FLT_MAX / 127),
// and the bits of 1 / that (0 for 0): one division fewer than dividing.
inline void grid_round_up_and_inverse(uint32_t t, uint32_t* scale, uint32_t* inverse) {
  if (t < kMinNormalBits) {
    *scale = t == 0 ? 0 : kMinNormalBits;
    *inverse = t == 0 ? 0 : 253u << 23;  // 1 / 2^-126
    return;
  }
  const uint32_t m = t & 0x7fffffu;
  uint32_t j = kGridBuckets.below[m >> 15];
  j += kGridMantissa[j] < m ? 1 : 0;
  const uint32_t e = t & 0x7f800000u;
  *scale = e + kGridMantissa[j];
  *inverse = ((254u << 23) - e) - kGridInverseSub[j];
}

// The grid index k = 18 e + j of a grid value's bits (positive, normal), -1 off the grid.
inline int32_t grid_index(uint32_t s) {
  const uint32_t m = s & 0x7fffffu;
  const uint32_t j = kGridBuckets.below[m >> 15];
  if (s < kMinNormalBits || s >= 0x7f800000u || kGridMantissa[j] != m) return -1;
  return static_cast<int32_t>((s >> 23) * kGridSteps + j);
}

// A ring payload's packed int8 scales (docs/wire-format.md, "On the wire"), for the host and
// the CUDA packers alike: a 2-byte header K (the largest grid index of the payload's nonzero
// finite scales, 0 when none, little-endian), then a byte a block: K - k for a scale of
// index k when that is at most kPackedMaxSteps, kPackedZero for a zero scale (or one further
// below K), kPackedNaN for the NaN flag. Indices from kGridSteps to kGridIndexEnd - 1 are
// grid values; a header and byte that name any other index decode as the NaN flag.
constexpr int kPackedHeaderBytes = 2;
constexpr int kPackedMaxSteps = 253;
constexpr uint8_t kPackedZero = 254, kPackedNaN = 255;
constexpr int kGridIndexEnd = kGridSteps * 255;

// The bits of the grid value of index k (kGridSteps <= k < kGridIndexEnd).
inline uint32_t grid_value(int32_t k) {
  return (static_cast<uint32_t>(k / kGridSteps) << 23) | kGridMantissa[k % kGridSteps];
}

}  // namespace prime::codec
