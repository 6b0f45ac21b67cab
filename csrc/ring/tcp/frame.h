// The frame: a fixed 64-byte header, then `payload_len` payload bytes.
//
//   offset size field
//    0     4   magic 0x474E5250 ("PRNG" as little-endian bytes P R N G)
//    4     2   protocol version (1)
//    6     1   kind: 1 data, 2 abort, 3 close
//    7     1   phase: 1 reduce-scatter, 2 all-gather
//    8     2   flags: bit 0 payload checksum present, bit 1 sum overflowed
//   10     2   sender rank
//   12     4   payload length in bytes
//   16     8   job: first 8 bytes of SHA-256(job id, world size)
//   24     8   collective sequence number
//   32     4   step
//   36     4   segment
//   40     4   descriptor: CRC32C of (n, dtype, op, codec, block size)
//   44     4   payload CRC32C (0 when the checksum flag is clear)
//   48     8   non-finite mask: bit r set when rank r's input held NaN/Inf
//   56     4   reserved, 0
//   60     4   header CRC32C of bytes [0, 60)
//
// All integers little-endian. Abort and close frames carry a payload of
// 4 bytes (origin rank) + a UTF-8 message, at most kMaxControlPayload bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../errors.h"

namespace prime::ring {

constexpr uint32_t kFrameMagic = 0x474E5250u;
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr uint32_t kMaxControlPayload = 4096;

enum class FrameKind : uint8_t { kData = 1, kAbort = 2, kClose = 3 };

constexpr uint16_t kFlagChecksum = 1u << 0;
constexpr uint16_t kFlagOverflow = 1u << 1;

struct FrameHeader {
  FrameKind kind = FrameKind::kData;
  Phase phase = Phase::kNone;
  uint16_t flags = 0;
  uint16_t src_rank = 0;
  uint32_t payload_len = 0;
  uint64_t job = 0;
  uint64_t seq = 0;
  uint32_t step = 0;
  uint32_t segment = 0;
  uint32_t desc = 0;
  uint32_t payload_crc = 0;
  uint64_t nonfinite_mask = 0;
};

void encode_header(const FrameHeader& h, uint8_t* out);  // writes kHeaderBytes, header CRC included

// Parses kHeaderBytes. Returns "" on success, else what is wrong ("bad magic 0x...",
// "header checksum mismatch", ...).
std::string decode_header(const uint8_t* in, FrameHeader* h);

// Payload of abort / close frames.
std::string encode_control(int origin, const std::string& message);
bool decode_control(const char* data, size_t n, int* origin, std::string* message);

}  // namespace prime::ring
