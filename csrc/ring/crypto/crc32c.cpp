// CRC32C: reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF.
// The table path processes 8 bytes per step with 8 tables (slicing-by-8). The
// hardware path feeds 8 bytes per crc32 instruction; the instruction has a latency
// of 3 cycles but a throughput of 1, so it runs three independent lanes over three
// consecutive blocks and joins them: the register update is linear, so
//   crc(s, A || B) = shift_|B|(crc(s, A)) ^ crc(0, B)
// where shift_L (feeding L zero bytes) is a fixed linear map, applied with four
// 256-entry tables. Measured on the CI machine (64 MiB): 12 GB/s, against
// 2.3 GB/s for the table path.
#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PRIME_CRC32C_X86 1
#endif

namespace prime::ring {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPolynomial : 0u);
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();  // built once, read-only afterwards
  return t;
}

uint32_t update_portable(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;  // little-endian hosts only (x86, arm64)
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// Lane length of the three-lane hardware loop.
constexpr size_t kLane = 4096;

// The linear map "feed kLane zero bytes" as four byte-indexed tables.
struct ZeroShift {
  std::array<std::array<uint32_t, 256>, 4> t{};
  uint32_t operator()(uint32_t x) const {
    return t[0][x & 0xFF] ^ t[1][(x >> 8) & 0xFF] ^ t[2][(x >> 16) & 0xFF] ^ t[3][x >> 24];
  }
};

ZeroShift make_zero_shift() {
  ZeroShift z;
  const std::array<uint8_t, kLane> zeros{};
  for (int j = 0; j < 4; ++j) {
    for (uint32_t b = 0; b < 256; ++b) z.t[j][b] = update_portable(b << (8 * j), zeros.data(), zeros.size());
  }
  return z;
}

const ZeroShift& zero_shift() {
  static const ZeroShift z = make_zero_shift();  // ~4 MB of table steps, once
  return z;
}

#ifdef PRIME_CRC32C_X86
__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
#if defined(__x86_64__)
  if (n >= 3 * kLane) {
    const ZeroShift& shift = zero_shift();
    while (n >= 3 * kLane) {
      uint64_t c0 = crc, c1 = 0, c2 = 0;
      for (size_t i = 0; i < kLane; i += 8) {
        uint64_t v0, v1, v2;
        std::memcpy(&v0, p + i, 8);
        std::memcpy(&v1, p + kLane + i, 8);
        std::memcpy(&v2, p + 2 * kLane + i, 8);
        c0 = _mm_crc32_u64(c0, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
      }
      crc = shift(shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
      p += 3 * kLane;
      n -= 3 * kLane;
    }
  }
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(c);
#endif
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

bool detect_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool crc32c_uses_hardware() {
#ifdef PRIME_CRC32C_X86
  static const bool has = detect_sse42();
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_portable(const void* data, size_t n, uint32_t previous) {
  return ~update_portable(~previous, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c(const void* data, size_t n, uint32_t previous) {
#ifdef PRIME_CRC32C_X86
  if (crc32c_uses_hardware()) return ~update_sse42(~previous, static_cast<const uint8_t*>(data), n);
#endif
  return crc32c_portable(data, n, previous);
}

}  // namespace prime::ring
