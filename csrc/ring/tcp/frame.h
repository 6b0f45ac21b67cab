// The frame: a fixed 64-byte header, `payload_len` payload bytes, a 16-byte tag.
//
//   offset size field
//    0     4   magic 0x474E5250 ("PRNG" as little-endian bytes P R N G)
//    4     2   protocol version (5)
//    6     1   kind: 1 data, 2 abort, 3 close
//    7     1   phase: 1 reduce-scatter, 2 all-gather
//    8     2   flags: bit 1 sum overflowed, bit 2 payload encrypted
//   10     2   sender rank
//   12     4   payload length in bytes
//   16     8   job: first 8 bytes of SHA-256(job id, world size)
//   24     8   collective sequence number
//   32     4   step
//   36     4   segment
//   40     4   descriptor: CRC32C of (n, dtype, op, codec, block size)
//   44     4   link frame: data frames numbered 0, 1, 2, ... per direction of a link,
//              across its streams (the receiver takes them in this order)
//   48     8   non-finite mask: bit r set when rank r's input held NaN/Inf
//   56     8   frame number on this stream and direction (0, 1, 2, ...)
//   64     -   payload (ciphertext when encrypted)
//   64+len 16  tag: AES-256-GCM under the direction's session key (tcp/handshake.h),
//              IV = the frame number; the header is additional data, the payload
//              additional data too (authentication only) or the plaintext (encrypted)
//
// All integers little-endian. Abort and close frames carry a payload of
// 4 bytes (origin rank) + a UTF-8 message, at most kMaxControlPayload bytes.
// Every check of a received header lives here: the structural ones before the
// tag is verified (how many bytes to read), the rest after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../crypto/gcm.h"
#include "../errors.h"

namespace prime::ring {

constexpr uint32_t kFrameMagic = 0x474E5250u;
constexpr uint16_t kProtocolVersion = 5;  // 3: link frame numbers (a link's streams may differ in speed);
                                          // 4: int8 payloads carry 2-byte (bf16-exact) scales;
                                          // 5: int8 scales on a grid, one byte each after a 2-byte header
constexpr size_t kHeaderBytes = 64;
constexpr size_t kTagBytes = crypto::kGcmTagBytes;
constexpr size_t kFrameOverhead = kHeaderBytes + kTagBytes;
constexpr uint32_t kMaxControlPayload = 4096;

enum class FrameKind : uint8_t { kData = 1, kAbort = 2, kClose = 3 };

constexpr uint16_t kFlagOverflow = 1u << 1;
constexpr uint16_t kFlagEncrypted = 1u << 2;

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
  uint32_t link_frame = 0;  // set by the transport
  uint64_t nonfinite_mask = 0;
  uint64_t frame_no = 0;  // set by FrameSealer
};

// Seals the frames one direction of one stream sends. One thread at a time.
class FrameSealer {
 public:
  FrameSealer(const crypto::Key256& key, bool encrypt);
  bool encrypts() const { return encrypt_; }
  // Starts the next frame: numbers it (h.frame_no), sets the encryption flag and
  // writes the header (kHeaderBytes) to `out`. Then payload() over the whole
  // payload, in order, in pieces of any size, then tag().
  void begin(FrameHeader& h, uint8_t* out);
  // The bytes to send for payload[0, n): `in` itself (authentication only) or its
  // ciphertext written to `scratch` (n bytes).
  const char* payload(const char* in, char* scratch, size_t n);
  void tag(uint8_t* out);  // kTagBytes

 private:
  crypto::Gcm gcm_;
  const bool encrypt_;
  uint64_t next_ = 0;
};

// Opens the frames one direction of one stream receives. One thread at a time.
class FrameOpener {
 public:
  FrameOpener(const crypto::Key256& key, bool encrypt);
  // Parses a header and starts checking its frame. "" or what is wrong with its
  // structure (magic, version, kind, phase, a length above max_payload for its kind).
  // Nothing in it is authentic until finish() said so.
  std::string begin(const uint8_t* raw, FrameHeader* h, uint32_t max_data_payload);
  // The payload as received, in order, in pieces of any size; decrypted in place.
  void payload(char* data, size_t n);
  // "" when the tag proves header and payload authentic, in this position of the
  // stream; else what failed.
  std::string finish(const FrameHeader& h, const uint8_t* tag);
  uint64_t frames_opened() const { return next_; }

 private:
  crypto::Gcm gcm_;
  const bool encrypt_;
  uint64_t next_ = 0;
};

// After finish(): "" when an authentic frame belongs on this link (sender rank, job,
// the ring's encryption setting), else what is wrong.
std::string check_link(const FrameHeader& h, int expected_rank, uint64_t job, bool encrypt);

// What the schedule expects of the next data frame.
struct ExpectedFrame {
  uint64_t seq = 0;
  uint32_t desc = 0;
  Phase phase = Phase::kNone;
  uint32_t step = 0;
  uint32_t segment = 0;
  uint64_t payload_len = 0;
  int sender = -1;
  const std::string* spec_text = nullptr;  // this rank's collective arguments, for the message
};

// "" when a data frame is the one expected, else what differs (the ranks disagree
// on the order or the arguments of their collectives).
std::string check_expected(const FrameHeader& h, const ExpectedFrame& e);

// Payload of abort / close frames.
std::string encode_control(int origin, const std::string& message);
bool decode_control(const char* data, size_t n, int* origin, std::string* message);

}  // namespace prime::ring
