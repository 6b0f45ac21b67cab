#include "handshake.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "../crypto/sha256.h"
#include "../str_builder.h"
#include "connection.h"
#include "le_bytes.h"

namespace prime::ring {
namespace {

constexpr char kMagic[8] = {'P', 'R', 'I', 'M', 'E', 'H', 'S', '1'};
constexpr size_t kHelloBytes = 72;
constexpr uint16_t kServerStream = 0xFFFF;

enum Status : uint8_t {
  kAccepted = 0,
  kBadMac = 1,
  kWrongJob = 2,
  kWrongRank = 3,
  kConfigMismatch = 4,
};

constexpr uint16_t kHelloVersion = 6;  // 2: frames carry AES-256-GCM tags; 3: a mesh, streams per link;
                                       // 4: int8 payloads with 2-byte scales (a version 3 peer could not read them);
                                       // 5: int8 payloads with 1-byte grid scales; 6: topk positions Elias-Fano coded
constexpr uint16_t kFlagAuthenticated = 1u << 0;  // always set since version 2
constexpr uint16_t kFlagEncrypted = 1u << 1;

struct Hello {
  uint16_t version = kHelloVersion;
  uint16_t world_size = 0;
  uint16_t streams = 0;
  uint16_t flags = 0;  // kFlagAuthenticated | kFlagEncrypted
  uint64_t segment_elems = 0;
  uint64_t job = 0;
  uint16_t rank = 0;
  uint16_t stream = 0;
  uint32_t link_streams = 0;  // client: the streams of this link; server: 0
  uint8_t nonce[32] = {};
};

using le::get;
using le::put;

void encode(const Hello& h, uint8_t* out) {
  std::memcpy(out, kMagic, 8);
  put<uint16_t>(out + 8, h.version);
  put<uint16_t>(out + 10, h.world_size);
  put<uint16_t>(out + 12, h.streams);
  put<uint16_t>(out + 14, h.flags);
  put<uint64_t>(out + 16, h.segment_elems);
  put<uint64_t>(out + 24, h.job);
  put<uint16_t>(out + 32, h.rank);
  put<uint16_t>(out + 34, h.stream);
  put<uint32_t>(out + 36, h.link_streams);
  std::memcpy(out + 40, h.nonce, 32);
}

bool decode(const uint8_t* in, Hello* h) {
  if (std::memcmp(in, kMagic, 8) != 0) return false;
  h->version = get<uint16_t>(in + 8);
  h->world_size = get<uint16_t>(in + 10);
  h->streams = get<uint16_t>(in + 12);
  h->flags = get<uint16_t>(in + 14);
  h->segment_elems = get<uint64_t>(in + 16);
  h->job = get<uint64_t>(in + 24);
  h->rank = get<uint16_t>(in + 32);
  h->stream = get<uint16_t>(in + 34);
  h->link_streams = get<uint32_t>(in + 36);
  std::memcpy(h->nonce, in + 40, 32);
  return true;
}

Hello make_hello(const HandshakeConfig& c, int rank, uint16_t stream, uint32_t link_streams = 0) {
  Hello h;
  h.world_size = static_cast<uint16_t>(c.world_size);
  h.streams = static_cast<uint16_t>(c.streams);
  h.flags = static_cast<uint16_t>(kFlagAuthenticated | (c.encrypt ? kFlagEncrypted : 0));
  h.segment_elems = c.segment_elems;
  h.job = c.job;
  h.rank = static_cast<uint16_t>(rank);
  h.stream = stream;
  h.link_streams = link_streams;
  size_t got = 0;
  while (got < sizeof(h.nonce)) {
    const ssize_t k = ::getrandom(h.nonce + got, sizeof(h.nonce) - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw HandshakeError("getrandom failed: " + errno_text(errno));
    got += static_cast<size_t>(k);
  }
  return h;
}

// What differs between the peer's ring shape and ours, "" when nothing.
std::string config_mismatch(const Hello& peer, const Hello& mine) {
  StrBuilder s;
  if (peer.version != mine.version) s << "protocol version " << peer.version << " vs " << mine.version << "; ";
  if (peer.world_size != mine.world_size) s << "world_size " << peer.world_size << " vs " << mine.world_size << "; ";
  if (peer.streams != mine.streams) s << "streams " << peer.streams << " vs " << mine.streams << "; ";
  if (peer.flags != mine.flags) {
    auto text = [](uint16_t f) {
      return std::string((f & kFlagAuthenticated) ? "" : "unauthenticated frames, ") +
             ((f & kFlagEncrypted) ? "encryption on" : "encryption off");
    };
    s << text(peer.flags) << " vs " << text(mine.flags) << "; ";
  }
  if (peer.segment_elems != mine.segment_elems) {
    s << "segment " << peer.segment_elems << " vs " << mine.segment_elems << " values; ";
  }
  return s.str();
}

Digest mac(const std::string& secret, const char* label, const uint8_t* hello_s, const uint8_t* hello_c) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(hello_s), kHelloBytes);
  msg.append(reinterpret_cast<const char*>(hello_c), kHelloBytes);
  return hmac_sha256(secret, msg.data(), msg.size());
}

SessionKeys derive_keys(const std::string& secret, const uint8_t* hello_s, const uint8_t* hello_c) {
  std::string salt(reinterpret_cast<const char*>(hello_s), kHelloBytes);
  salt.append(reinterpret_cast<const char*>(hello_c), kHelloBytes);
  const std::string c2s = hkdf_sha256(secret, salt, "prime-ring v2 frames client->server", 32);
  const std::string s2c = hkdf_sha256(secret, salt, "prime-ring v2 frames server->client", 32);
  SessionKeys k;
  std::memcpy(k.client_to_server.data(), c2s.data(), 32);
  std::memcpy(k.server_to_client.data(), s2c.data(), 32);
  return k;
}

const char* status_text(uint8_t status) {
  switch (status) {
    case kBadMac: return "authentication failed (the secret differs: set the same PRIME_RING_SECRET / secret= on every rank)";
    case kWrongJob: return "the job id differs (a rank of another job or an older ring generation?)";
    case kWrongRank: return "the server did not accept our rank (not a rank of its ring, or its own)";
    case kConfigMismatch: return "the ring configuration differs (protocol version, streams, segment_bytes or encryption)";
    default: return "refused";
  }
}

IoLimits limits(Deadline d) {
  IoLimits l;
  l.deadline = d;
  return l;
}

void send_status(const Socket& s, uint8_t status, Deadline deadline) {
  uint8_t reply[33] = {};
  reply[0] = status;
  try {
    send_all(s, reply, sizeof(reply), limits(deadline));
  } catch (const IoError&) {
    // The peer is being refused anyway; the status is only a courtesy.
  }
}

}  // namespace

Accepted handshake_server(const Socket& s, const HandshakeConfig& config, int my_rank, Deadline deadline) {
  const Hello mine = make_hello(config, my_rank, kServerStream);
  uint8_t hello_s[kHelloBytes];
  encode(mine, hello_s);
  uint8_t hello_c[kHelloBytes + 32];
  try {
    send_all(s, hello_s, kHelloBytes, limits(deadline));
    recv_all(s, hello_c, sizeof(hello_c), limits(deadline));
  } catch (const IoError& e) {
    throw HandshakeError(std::string("no valid handshake: ") + e.what(), true);
  }
  Hello peer;
  if (!decode(hello_c, &peer)) throw HandshakeError("garbage instead of a handshake (bad magic)");
  if (peer.job != config.job) {
    send_status(s, kWrongJob, deadline);
    throw HandshakeError("peer belongs to another job id or ring generation");
  }
  const std::string mismatch = config_mismatch(peer, mine);
  if (!mismatch.empty()) {
    send_status(s, kConfigMismatch, deadline);
    throw HandshakeError("ring configuration differs: " + mismatch);
  }
  const Digest want = mac(config.secret, "prime-ring client", hello_s, hello_c);
  Digest got;
  std::memcpy(got.data(), hello_c + kHelloBytes, 32);
  if (!digests_equal(want, got)) {
    send_status(s, kBadMac, deadline);
    throw HandshakeError("authentication failed: wrong secret");
  }
  if (peer.rank >= config.world_size || peer.rank == my_rank) {
    send_status(s, kWrongRank, deadline);
    throw HandshakeError("peer proved the secret but claims to be rank " + std::to_string(peer.rank) +
                         ", not another rank of this ring of " + std::to_string(config.world_size));
  }
  const bool streams_ok = peer.link_streams >= 1 && peer.link_streams <= static_cast<uint32_t>(kMaxLinkStreams) &&
                          (config.streams == 0 || peer.link_streams == static_cast<uint32_t>(config.streams));
  if (!streams_ok || peer.stream >= peer.link_streams) {
    send_status(s, kConfigMismatch, deadline);
    throw HandshakeError("stream " + std::to_string(peer.stream) + " of " + std::to_string(peer.link_streams) +
                         " out of range");
  }
  uint8_t reply[33];
  reply[0] = kAccepted;
  const Digest proof = mac(config.secret, "prime-ring server", hello_s, hello_c);
  std::memcpy(reply + 1, proof.data(), 32);
  try {
    send_all(s, reply, sizeof(reply), limits(deadline));
  } catch (const IoError& e) {
    throw HandshakeError(std::string("peer vanished during the handshake: ") + e.what(), true);
  }
  return Accepted{peer.rank, peer.stream, static_cast<int>(peer.link_streams),
                  derive_keys(config.secret, hello_s, hello_c)};
}

SessionKeys handshake_client(const Socket& s, const HandshakeConfig& config, int my_rank, int expected_rank,
                             int stream, int link_streams, Deadline deadline, double* rtt_s) {
  const Hello mine = make_hello(config, my_rank, static_cast<uint16_t>(stream), static_cast<uint32_t>(link_streams));
  uint8_t hello_s[kHelloBytes];
  uint8_t hello_c[kHelloBytes + 32];
  uint8_t reply[33];
  try {
    recv_all(s, hello_s, kHelloBytes, limits(deadline));
  } catch (const IoError& e) {
    throw HandshakeError(std::string("no handshake from the server: ") + e.what(), true);
  }
  Hello peer;
  if (!decode(hello_s, &peer)) throw HandshakeError("the server is not a prime ring rank (bad magic)");
  if (peer.job != config.job) throw HandshakeError("the server belongs to another job id or ring generation");
  const std::string mismatch = config_mismatch(peer, mine);
  if (!mismatch.empty()) throw HandshakeError("ring configuration differs (theirs vs ours): " + mismatch);
  if (peer.rank != expected_rank) {
    throw HandshakeError("the server is rank " + std::to_string(peer.rank) + ", expected rank " +
                         std::to_string(expected_rank));
  }
  encode(mine, hello_c);
  const Digest proof = mac(config.secret, "prime-ring client", hello_s, hello_c);
  std::memcpy(hello_c + kHelloBytes, proof.data(), 32);
  try {
    const auto t0 = Clock::now();
    send_all(s, hello_c, sizeof(hello_c), limits(deadline));
    recv_all(s, reply, sizeof(reply), limits(deadline));
    if (rtt_s) *rtt_s = seconds_since(t0);
  } catch (const IoError& e) {
    throw HandshakeError(std::string("the server dropped the handshake: ") + e.what(), true);
  }
  if (reply[0] != kAccepted) throw HandshakeError(std::string("refused by the server: ") + status_text(reply[0]));
  const Digest want = mac(config.secret, "prime-ring server", hello_s, hello_c);
  Digest got;
  std::memcpy(got.data(), reply + 1, 32);
  if (!digests_equal(want, got)) {
    throw HandshakeError("the server could not prove the secret (wrong secret, or not our neighbour)");
  }
  return derive_keys(config.secret, hello_s, hello_c);
}

}  // namespace prime::ring
