#include "frame.h"

#include <cstdio>
#include <cstring>

#include "../str_builder.h"
#include "le_bytes.h"

namespace prime::ring {
namespace {

using le::get;
using le::put;

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
  put<uint32_t>(out + 44, h.link_frame);
  put<uint64_t>(out + 48, h.nonfinite_mask);
  put<uint64_t>(out + 56, h.frame_no);
}

}  // namespace

// ---------------------------------------------------------------------------
// sending

FrameSealer::FrameSealer(const crypto::Key256& key, bool encrypt)
    : gcm_(key, crypto::Gcm::Mode::kSeal), encrypt_(encrypt) {}

void FrameSealer::begin(FrameHeader& h, uint8_t* out) {
  h.frame_no = next_++;  // counted here, so an abandoned frame never reuses its IV
  h.flags = static_cast<uint16_t>(encrypt_ ? (h.flags | kFlagEncrypted) : (h.flags & ~kFlagEncrypted));
  encode_header(h, out);
  gcm_.start(h.frame_no);
  gcm_.authenticate(out, kHeaderBytes);
}

const char* FrameSealer::payload(const char* in, char* scratch, size_t n) {
  if (!encrypt_) {
    gcm_.authenticate(in, n);
    return in;
  }
  gcm_.crypt(in, scratch, n);
  return scratch;
}

void FrameSealer::tag(uint8_t* out) { gcm_.seal_tag(out); }

// ---------------------------------------------------------------------------
// receiving

FrameOpener::FrameOpener(const crypto::Key256& key, bool encrypt)
    : gcm_(key, crypto::Gcm::Mode::kOpen), encrypt_(encrypt) {}

std::string FrameOpener::begin(const uint8_t* in, FrameHeader* h, uint32_t max_data_payload) {
  char text[160];
  const uint32_t magic = get<uint32_t>(in);
  if (magic != kFrameMagic) {
    std::snprintf(text, sizeof(text), "bad magic 0x%08x (expected 0x%08x): not a prime ring frame", magic, kFrameMagic);
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
  h->link_frame = get<uint32_t>(in + 44);
  h->nonfinite_mask = get<uint64_t>(in + 48);
  h->frame_no = get<uint64_t>(in + 56);
  // Checked before anything is allocated or read for the payload.
  const uint32_t limit = h->kind == FrameKind::kData ? max_data_payload : kMaxControlPayload;
  if (h->payload_len > limit) {
    std::snprintf(text, sizeof(text), "payload length %u exceeds the limit %u", h->payload_len, limit);
    return text;
  }
  // The IV is the number this frame must have, not the one it claims.
  gcm_.start(next_);
  gcm_.authenticate(in, kHeaderBytes);
  return "";
}

void FrameOpener::payload(char* data, size_t n) {
  if (encrypt_) {
    gcm_.crypt(data, data, n);
  } else {
    gcm_.authenticate(data, n);
  }
}

std::string FrameOpener::finish(const FrameHeader& h, const uint8_t* tag) {
  const uint64_t expected = next_++;
  if (gcm_.open_tag(tag)) return "";
  StrBuilder s;
  s << "authentication failed (bad tag on frame #" << expected << " of this stream";
  if (h.frame_no != expected) {
    s << "; it claims to be frame #" << h.frame_no << ": replayed, dropped or reordered on the way";
  } else {
    s << ": its header or payload was altered on the way, or the sender does not hold this session's key";
  }
  s << ")";
  return s.str();
}

std::string check_link(const FrameHeader& h, int expected_rank, uint64_t job, bool encrypt) {
  if (h.src_rank != expected_rank || h.job != job) {
    return "frame claims to come from rank " + std::to_string(h.src_rank) + (h.job != job ? " of another job" : "");
  }
  if (((h.flags & kFlagEncrypted) != 0) != encrypt) {
    return std::string("frame is ") + (encrypt ? "not " : "") + "encrypted, unlike this ring's setting";
  }
  return "";
}

std::string check_expected(const FrameHeader& h, const ExpectedFrame& e) {
  StrBuilder s;
  if (h.seq != e.seq) {
    s << "it belongs to all_reduce #" << h.seq << "; the ranks issued their collectives in different orders or numbers";
  } else if (h.desc != e.desc) {
    s << "rank " << e.sender << " called all_reduce #" << e.seq << " with other arguments than this rank";
    if (e.spec_text) s << " (" << *e.spec_text << ")";
    s << ": every rank must pass a tensor of the same size and dtype, and the same op, codec and block_size "
         "(topk: and keep, keep_average)";
  } else if (h.phase != e.phase || h.step != e.step || h.segment != e.segment) {
    s << "got " << phase_name(h.phase) << " step " << h.step << ", segment " << h.segment;
  } else if (h.payload_len != e.payload_len) {
    s << "payload of " << h.payload_len << " bytes, expected " << e.payload_len;
  }
  return s.str();
}

// ---------------------------------------------------------------------------
// control frames

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
