// Little-endian integer fields in frame headers and handshake messages
// (byte by byte, so the wire format does not depend on the host's byte order).
#pragma once

#include <cstddef>
#include <cstdint>

namespace prime::ring::le {

template <typename T>
inline void put(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
}

template <typename T>
inline T get(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace prime::ring::le
