// CRC32C (Castagnoli), the payload checksum of ring frames.
#pragma once

#include <cstddef>
#include <cstdint>

namespace prime::ring {

// CRC32C of data[0, n). Chaining: crc32c(b, nb, crc32c(a, na)) == crc32c(a ++ b).
// Uses the SSE4.2 crc32 instruction when the CPU has it (checked once at run time),
// else a slicing-by-8 table.
uint32_t crc32c(const void* data, size_t n, uint32_t previous = 0);

// The table version alone, for tests that compare both paths.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t previous = 0);

bool crc32c_uses_hardware();

}  // namespace prime::ring
