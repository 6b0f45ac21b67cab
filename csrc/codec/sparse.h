// The sparse top-k format (docs/wire-format-sparse.md) on raw CPU memory: per chunk of C
// values, the k largest magnitudes at 2 bits each with their positions. Used by the torch
// ops (ops_cpu.cpp) and by the ring's sparse wire codec. prime/sparse.py is the reference:
// these give its bytes and its values bit for bit.
#pragma once

#include <cstdint>

namespace prime::codec::sparse {

constexpr int64_t kMinChunk = 16;
constexpr int64_t kMaxChunk = 4096;

inline bool valid_chunk(int64_t chunk) {
  return chunk >= kMinChunk && chunk <= kMaxChunk && (chunk & (chunk - 1)) == 0;
}
inline bool valid_keep(int64_t chunk, int64_t k) { return k >= 1 && k <= chunk; }
// Positions are Elias-Fano coded: b lower bits each, kept directly, and the upper parts in unary.
// b is the largest with keep 2^b <= chunk.
inline int lower_bits(int64_t keep, int64_t chunk) {
  int b = 0;
  while ((keep << (b + 1)) <= chunk) ++b;
  return b;
}
// Values kept of a chunk of `len` values: k for a full one, ceil(len k / chunk) for the last.
inline int64_t chunk_keep(int64_t len, int64_t chunk, int64_t k) { return (len * k + chunk - 1) / chunk; }
// A record's areas after lo and hi: the upper parts (bit (p_i >> b) + i set for the i-th position),
// the lower parts (b bits each, LSB first) and the codes (2 bits each).
struct RecordLayout {
  int b;
  int64_t upper, lower, codes;  // bytes
  int64_t bytes() const { return 4 + upper + lower + codes; }
};
inline RecordLayout record_layout(int64_t keep, int64_t chunk) {
  const int b = lower_bits(keep, chunk);
  return RecordLayout{b, (keep + (chunk >> b) + 7) / 8, (keep * b + 7) / 8, (keep + 3) / 4};
}
inline int64_t record_bytes(int64_t keep, int64_t chunk) { return record_layout(keep, chunk).bytes(); }
inline int64_t payload_bytes(int64_t n, int64_t chunk, int64_t k) {
  const int64_t full = n / chunk, rest = n % chunk;
  return full * record_bytes(k, chunk) + (rest ? record_bytes(chunk_keep(rest, chunk, k), chunk) : 0);
}

// Ordered by precedence: encoders keep the largest status of any chunk, so input that is not finite is
// reported as such even where another chunk overflows.
enum class EncodeStatus : int { kOk = 0, kOverflow = 1, kNonFinite = 2 };

// out[0, payload_bytes(n)) = the payload of x[0, n) (fp32). kNonFinite: x holds NaN or Inf;
// kOverflow: a chunk's larger magnitude rounds to bf16 infinity (out is then not a payload).
// Multithreaded over chunks (at::parallel_for).
EncodeStatus encode(const float* x, int64_t n, int64_t chunk, int64_t k, uint8_t* out);

// Whether every record of a payload of n values codes ascending positions inside its chunk
// (exactly keep upper bits set; the only way a payload of the right size can be malformed).
// decode and decode_add assume it.
bool well_formed(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k);

// y[0, n) = the values the payload stands for (0 where nothing was kept).
void decode(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* y);
// acc[i] = acc[i] + value at every kept position i (other values untouched).
void decode_add(const uint8_t* payload, int64_t n, int64_t chunk, int64_t k, float* acc);

}  // namespace prime::codec::sparse
