// Mutual authentication of a new stream: HMAC-SHA256 challenge-response in both
// directions, binding the job, the ring's shape, both ranks and the link's stream count.
// Every rank links to every other (a mesh): the client is the rank that sends data on
// the stream, the server the one that receives it.
//
//   server -> client   hello_s: magic "PRIMEHS1", config, job, server rank, nonce_s
//   client -> server   hello_c: the same fields for the client (+ stream index and the
//                      number of streams of this link, which the client chose),
//                      mac_c = HMAC(secret, "prime-ring client" || hello_s || hello_c)
//   server -> client   status (0 accepted, else the reason) || mac_s =
//                      HMAC(secret, "prime-ring server" || hello_s || hello_c)
//
// Each side checks the other's job, ring shape and rank in clear first (for a
// clear error), then the MAC. Fresh 32-byte nonces on both sides stop replays.
//
// Session keys (one per direction of the stream, for the frames' AES-256-GCM tags):
//   key_dir = HKDF-SHA256(ikm = secret, salt = hello_s || hello_c,
//                         info = "prime-ring v2 frames client->server" / "... server->client")
// so every stream of every ring has fresh keys, bound to both nonces, the job, the
// ring's shape, both ranks and the stream; the client is the rank that sends data.
#pragma once

#include <cstdint>
#include <string>

#include "../crypto/gcm.h"
#include "../deadline.h"
#include "socket.h"

namespace prime::ring {

// The most streams one link may have (the client's choice, or the streams setting).
constexpr int kMaxLinkStreams = 64;

struct HandshakeConfig {
  std::string secret;
  uint64_t job = 0;  // hash of the job id and world size
  int world_size = 0;
  int streams = 1;  // the setting every rank must share: streams per link, 0 = chosen per link
  bool encrypt = false;  // payloads encrypted (else authenticated only)
  uint64_t segment_elems = 0;
};

// Refused by us (server) or by the peer (client side): the connection must be dropped.
// `transient`: the connection broke or went quiet (the server may have dropped it to
// make room for others); a client may try again. Otherwise the peer refused us or
// could not prove the secret.
class HandshakeError : public std::runtime_error {
 public:
  explicit HandshakeError(const std::string& what, bool transient = false)
      : std::runtime_error(what), transient_(transient) {}
  bool transient() const { return transient_; }

 private:
  bool transient_;
};

struct SessionKeys {
  crypto::Key256 client_to_server{};  // the data direction
  crypto::Key256 server_to_client{};  // the return path (abort / close reports)
};

struct Accepted {
  int rank = 0;          // the client, a rank of this ring other than the server
  int stream = 0;        // its index on the link
  int link_streams = 1;  // how many streams the client opens on this link
  SessionKeys keys;
};

// Server side: any other rank of the ring may connect. Returns who it is, the stream's
// place on its link and the session keys.
Accepted handshake_server(const Socket& s, const HandshakeConfig& config, int my_rank, Deadline deadline);

// Client side, for stream `stream` of `link_streams` to `expected_rank`. *rtt_s (when
// not null): the time from sending hello_c to the server's reply, one round trip.
SessionKeys handshake_client(const Socket& s, const HandshakeConfig& config, int my_rank, int expected_rank,
                             int stream, int link_streams, Deadline deadline, double* rtt_s = nullptr);

}  // namespace prime::ring
