#include "frame.h"

#include <cstdio>
#include <cstring>

#include "../crypto/crc32c.h"
#include "le_bytes.h"

namespace prime::ring {
namespace {

using le::get;
using le::put;

}  // namespace

void encode_header(const FrameHeader& h, uint8_t* out) {
  put<uint32_t>(out + 0, kFrameMagic);
  put<uint16_t>(out + 4, kProtocolVersion);
  put<uint8_t>(out + 6, static_cast<uint8_t>(h.kind));
  put<uint8_t>(out + 7, static_cast<uint8_t>(h.phase));
  put<uint16_t>(out + 8, h.flags);
  put<uint16_t>(out + 10, h.src_rank);
  put<uint32_t>(out + 12, h.payload_len);
  put<uint64_t>(out + 16, h.job);
  put<uint64_t>(out + 24, h.seq);
  put<uint32_t>(out + 32, h.step);
  put<uint32_t>(out + 36, h.segment);
  put<uint32_t>(out + 40, h.desc);
  put<uint32_t>(out + 44, h.payload_crc);
  put<uint64_t>(out + 48, h.nonfinite_mask);
  put<uint32_t>(out + 56, 0);
  put<uint32_t>(out + 60, crc32c(out, 60));
}

std::string decode_header(const uint8_t* in, FrameHeader* h) {
  char text[160];
  const uint32_t magic = get<uint32_t>(in);
  if (magic != kFrameMagic) {
    std::snprintf(text, sizeof(text), "bad magic 0x%08x (expected 0x%08x): not a prime ring frame", magic, kFrameMagic);
    return text;
  }
  const uint32_t want_crc = get<uint32_t>(in + 60);
  const uint32_t got_crc = crc32c(in, 60);
  if (want_crc != got_crc) {
    std::snprintf(text, sizeof(text), "header checksum mismatch (header says 0x%08x, computed 0x%08x)", want_crc,
                  got_crc);
    return text;
  }
  const uint16_t version = get<uint16_t>(in + 4);
  if (version != kProtocolVersion) {
    std::snprintf(text, sizeof(text), "protocol version %u, this build speaks %u", version, kProtocolVersion);
    return text;
  }
  const uint8_t kind = get<uint8_t>(in + 6);
  if (kind < 1 || kind > 3) {
    std::snprintf(text, sizeof(text), "unknown frame kind %u", kind);
    return text;
  }
  const uint8_t phase = get<uint8_t>(in + 7);
  if (phase > 2) {
    std::snprintf(text, sizeof(text), "unknown phase %u", phase);
    return text;
  }
  h->kind = static_cast<FrameKind>(kind);
  h->phase = static_cast<Phase>(phase);
  h->flags = get<uint16_t>(in + 8);
  h->src_rank = get<uint16_t>(in + 10);
  h->payload_len = get<uint32_t>(in + 12);
  h->job = get<uint64_t>(in + 16);
  h->seq = get<uint64_t>(in + 24);
  h->step = get<uint32_t>(in + 32);
  h->segment = get<uint32_t>(in + 36);
  h->desc = get<uint32_t>(in + 40);
  h->payload_crc = get<uint32_t>(in + 44);
  h->nonfinite_mask = get<uint64_t>(in + 48);
  return "";
}

std::string encode_control(int origin, const std::string& message) {
  std::string out(4, '\0');
  put<uint32_t>(reinterpret_cast<uint8_t*>(out.data()), static_cast<uint32_t>(origin));
  out += message.substr(0, kMaxControlPayload - 4);
  return out;
}

bool decode_control(const char* data, size_t n, int* origin, std::string* message) {
  if (n < 4 || n > kMaxControlPayload) return false;
  *origin = static_cast<int>(get<uint32_t>(reinterpret_cast<const uint8_t*>(data)));
  message->assign(data + 4, n - 4);
  return true;
}

}  // namespace prime::ring
