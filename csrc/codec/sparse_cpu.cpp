// The sparse top-k format on the CPU (sparse.h; docs/wire-format-sparse.md). One chunk at a
// time, chunks over threads with at::parallel_for. Selection finds the k-th largest magnitude
// with nth_element on the magnitudes' bit patterns (non-negative floats order as their
// bits), then takes positions in ascending order: every magnitude above it, and as many
// equal to it as are still needed, lowest position first (the format's tie rule).
#include "sparse.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

#include "cpu_kernels.h"

namespace prime::codec::sparse {
namespace {

using cpu::kAbsMask;
using cpu::kInfBits;
using cpu::bits_float;
using cpu::float_bits;
// fp32 -> bf16, round to nearest even (finite input; a value past bf16's largest gives infinity).
inline uint16_t bf16_bits(float f) {
  const uint32_t b = float_bits(f);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
// The format's rounding of a float64 mean: to fp32, then to bf16 (each to nearest even).
inline uint16_t bf16_of_mean(double m) { return bf16_bits(static_cast<float>(m)); }

struct BitWriter {
  uint8_t* out;
  uint64_t acc = 0;
  int have = 0;
  void put(uint32_t v, int bits) {
    acc |= static_cast<uint64_t>(v) << have;
    have += bits;
    while (have >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
  uint8_t* flush() {
    if (have > 0) *out++ = static_cast<uint8_t>(acc);
    acc = 0;
    have = 0;
    return out;
  }
};

struct BitReader {
  const uint8_t* in;
  uint64_t acc = 0;
  int have = 0;
  uint32_t get(int bits) {
    while (have < bits) {
      acc |= static_cast<uint64_t>(*in++) << have;
      have += 8;
    }
    const uint32_t v = static_cast<uint32_t>(acc & ((uint64_t{1} << bits) - 1));
    acc >>= bits;
    have -= bits;
    return v;
  }
};

// The keep-th largest of m[0, len) (magnitude bits), 1 <= keep <= len, and in *above how many
// are larger. A histogram of the exponent and two mantissa bits finds the bin that holds it;
// only that bin's values are then ordered (nth_element), so a chunk costs about two passes,
// not a selection over all of it.
uint32_t kth_largest(const uint32_t* m, int64_t len, int64_t keep, uint32_t* scratch, int64_t* above) {
  constexpr int kShift = 21;  // finite magnitudes are below 0x7f800000: bins 0..1019
  // Two histograms, alternate values: fewer stalls on the same counter.
  uint32_t hist[2][1024] = {};
  int64_t i = 0;
  for (; i + 1 < len; i += 2) {
    ++hist[0][m[i] >> kShift];
    ++hist[1][m[i + 1] >> kShift];
  }
  if (i < len) ++hist[0][m[i] >> kShift];
  int64_t higher = 0;
  uint32_t bin = 1023;
  while (higher + hist[0][bin] + hist[1][bin] < keep) {
    higher += hist[0][bin] + hist[1][bin];
    --bin;
  }
  int64_t nc = 0;
  for (int64_t j = 0; j < len; ++j) {
    scratch[nc] = m[j];
    nc += (m[j] >> kShift) == bin;
  }
  const int64_t need = keep - higher;  // in [1, the bin's count]
  std::nth_element(scratch, scratch + need - 1, scratch + nc, std::greater<uint32_t>());
  const uint32_t t = scratch[need - 1];
  for (int64_t j = 0; j < need - 1; ++j) higher += scratch[j] > t;  // the bin's values above t
  *above = higher;
  return t;
}

// The `keep` values of m[0, len) (magnitude bits) ranked highest by (magnitude desc, position
// asc): writes their positions, ascending, to pos; `scratch` holds len values.
void select_top(const uint32_t* m, int64_t len, int64_t keep, uint32_t* scratch, uint16_t* pos) {
  int64_t above = 0;
  const uint32_t t = kth_largest(m, len, keep, scratch, &above);
  int64_t ties = keep - above;
  int64_t np = 0;
  for (int64_t i = 0; i < len && np < keep; ++i) {
    if (m[i] > t || (m[i] == t && ties-- > 0)) pos[np++] = static_cast<uint16_t>(i);
  }
}

EncodeStatus encode_chunk(const float* x, int64_t len, int64_t keep, int64_t chunk, uint8_t* out) {
  uint32_t m[kMaxChunk], scratch[kMaxChunk], km[kMaxChunk];
  uint16_t pos[kMaxChunk], upper_pos[kMaxChunk];
  uint32_t largest = 0;
  for (int64_t i = 0; i < len; ++i) {
    m[i] = float_bits(x[i]) & kAbsMask;
    largest = std::max(largest, m[i]);
  }
  if (largest >= kInfBits) return EncodeStatus::kNonFinite;
  select_top(m, len, keep, scratch, pos);
  // The ceil(keep / 2) largest of the kept (same ranking): the halves whose means split the levels.
  for (int64_t j = 0; j < keep; ++j) km[j] = m[pos[j]];
  const int64_t upper = (keep + 1) / 2;
  select_top(km, keep, upper, scratch, upper_pos);  // indices into km, ascending
  double s_hi = 0, s_lo = 0;
  for (int64_t j = 0, u = 0; j < keep; ++j) {
    const double v = static_cast<double>(bits_float(km[j]));
    if (u < upper && upper_pos[u] == j) {
      s_hi += v;
      ++u;
    } else {
      s_lo += v;
    }
  }
  const double c_hi = s_hi / static_cast<double>(upper);
  const double c_lo = keep > upper ? s_lo / static_cast<double>(keep - upper) : c_hi;
  const double mid = (c_lo + c_hi) / 2;
  double sum_hi = 0, sum_lo = 0;
  int64_t n_hi = 0;
  for (int64_t j = 0; j < keep; ++j) {
    const double v = static_cast<double>(bits_float(km[j]));
    if (v >= mid) {
      sum_hi += v;
      ++n_hi;
    } else {
      sum_lo += v;
    }
  }
  const uint16_t hi = bf16_of_mean(sum_hi / static_cast<double>(n_hi));
  const uint16_t lo = keep > n_hi ? bf16_of_mean(sum_lo / static_cast<double>(keep - n_hi)) : hi;
  if ((hi & 0x7fffu) >= 0x7f80u) return EncodeStatus::kOverflow;
  std::memcpy(out, &lo, 2);  // little-endian hosts only, as the whole frame
  std::memcpy(out + 2, &hi, 2);
  const RecordLayout layout = record_layout(keep, chunk);
  uint8_t* unary = out + 4;
  std::memset(unary, 0, static_cast<size_t>(layout.upper));
  for (int64_t j = 0; j < keep; ++j) {
    const int64_t bit = (pos[j] >> layout.b) + j;
    unary[bit >> 3] = static_cast<uint8_t>(unary[bit >> 3] | (1u << (bit & 7)));
  }
  BitWriter w{unary + layout.upper};
  const uint32_t low_mask = (1u << layout.b) - 1;
  for (int64_t j = 0; j < keep; ++j) w.put(pos[j] & low_mask, layout.b);
  w.out = w.flush();
  for (int64_t j = 0; j < keep; ++j) {
    const uint32_t level = static_cast<double>(bits_float(km[j])) >= mid ? 1u : 0u;
    const uint32_t negative = x[pos[j]] < 0.f ? 1u : 0u;  // -0 codes as positive, as the reference
    w.put(level | (negative << 1), 2);
  }
  w.flush();
  return EncodeStatus::kOk;
}

// Calls f(start value, length, keep, record offset) for the chunks [c0, c1).
template <class F>
void for_chunks(int64_t n, int64_t chunk, int64_t k, int64_t c0, int64_t c1, F&& f) {
  const int64_t full_record = record_bytes(k, chunk);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t start = c * chunk;
    const int64_t len = std::min(chunk, n - start);
    f(start, len, chunk_keep(len, chunk, k), c * full_record);
  }
}

template <class F>
void parallel_chunks(int64_t n, int64_t chunk, int64_t k, F&& f) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / chunk);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) { for_chunks(n, chunk, k, c0, c1, f); });
}

// Reads a record's positions into pos; false unless its upper area holds exactly keep set bits
// and the positions ascend inside [0, len).
bool read_positions(const uint8_t* record, int64_t len, int64_t keep, const RecordLayout& layout, uint16_t* pos) {
  const uint8_t* upper = record + 4;
  BitReader lower{upper + layout.upper};
  int64_t j = 0, last = -1;
  for (int64_t q = 0; q < layout.upper; ++q) {
    for (uint32_t bits = upper[q]; bits != 0; bits &= bits - 1) {
      if (j == keep) return false;
      const int64_t high = q * 8 + __builtin_ctz(bits) - j;
      const int64_t p = (high << layout.b) | lower.get(layout.b);
      if (p <= last || p >= len) return false;
      pos[j++] = static_cast<uint16_t>(p);
      last = p;
    }
  }
  return j == keep;
}

// Calls put(position, value) for every kept value of a well-formed record.
template <class Put>
void decode_record(const uint8_t* record, int64_t len, int64_t keep, int64_t chunk, Put&& put) {
  uint16_t lo_bits, hi_bits;
  std::memcpy(&lo_bits, record, 2);
  std::memcpy(&hi_bits, record + 2, 2);
  const float lo = bf16_value(lo_bits), hi = bf16_value(hi_bits);
  uint16_t pos[kMaxChunk];
  const RecordLayout layout = record_layout(keep, chunk);
  read_positions(record, len, keep, layout, pos);
  BitReader codes{record + 4 + layout.upper + layout.lower};
  for (int64_t j = 0; j < keep; ++j) {
    const uint32_t c = codes.get(2);
    const float mag = (c & 1u) ? hi : lo;
    put(pos[j], (c & 2u) ? -mag : mag);
  }
}

}  // namespace

EncodeStatus encode(const float* x, int64_t n, int64_t chunk, int64_t k, uint8_t* out) {
  std::atomic<int> worst{0};
  parallel_chunks(n, chunk, k, [&](int64_t start, int64_t len, int64_t keep, int64_t at) {
    const int s = static_cast<int>(encode_chunk(x + start, len, keep, chunk, out + at));
    int seen = worst.load();
    while (s > seen && !worst.compare_exchange_weak(seen, s)) {
    }
  });
  return static_cast<EncodeStatus>(worst.load());
}

bool well_formed(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k) {
  std::atomic<bool> ok{true};
  parallel_chunks(n, chunk, k, [&](int64_t, int64_t len, int64_t keep, int64_t at) {
    uint16_t pos[kMaxChunk];
    if (!read_positions(payload + at, len, keep, record_layout(keep, chunk), pos)) ok = false;
  });
  return ok.load();
}

void decode(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* y) {
  parallel_chunks(n, chunk, k, [&](int64_t start, int64_t len, int64_t keep, int64_t at) {
    float* out = y + start;
    std::fill(out, out + len, 0.f);
    decode_record(payload + at, len, keep, chunk, [out](int64_t p, float v) { out[p] = v; });
  });
}

void decode_add(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* acc) {
  parallel_chunks(n, chunk, k, [&](int64_t start, int64_t len, int64_t keep, int64_t at) {
    float* out = acc + start;
    decode_record(payload + at, len, keep, chunk, [out](int64_t p, float v) { out[p] = out[p] + v; });
  });
}

}  // namespace prime::codec::sparse
