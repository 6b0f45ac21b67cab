// Mutual authentication of a new stream: HMAC-SHA256 challenge-response in both
// directions, binding the job, the ring's shape and both ranks.
//
//   server -> client   hello_s: magic "PRIMEHS1", config, job, server rank, nonce_s
//   client -> server   hello_c: the same fields for the client (+ stream index),
//                      mac_c = HMAC(secret, "prime-ring client" || hello_s || hello_c)
//   server -> client   status (0 accepted, else the reason) || mac_s =
//                      HMAC(secret, "prime-ring server" || hello_s || hello_c)
//
// Each side checks the other's job, ring shape and rank in clear first (for a
// clear error), then the MAC. Fresh 32-byte nonces on both sides stop replays.
#pragma once

#include <cstdint>
#include <string>

#include "../deadline.h"
#include "socket.h"

namespace prime::ring {

struct HandshakeConfig {
  std::string secret;
  uint64_t job = 0;  // hash of the job id and world size
  int world_size = 0;
  int streams = 1;
  bool checksum = true;
  uint64_t segment_elems = 0;
};

// Refused by us (server) or by the peer (client side): the connection must be dropped.
class HandshakeError : public std::runtime_error {
 public:
  explicit HandshakeError(const std::string& what) : std::runtime_error(what) {}
};

// Server side. Returns the client's stream index; the client must be `expected_rank`.
int handshake_server(const Socket& s, const HandshakeConfig& config, int my_rank, int expected_rank,
                     Deadline deadline);

// Client side, for stream `stream` to `expected_rank`.
void handshake_client(const Socket& s, const HandshakeConfig& config, int my_rank, int expected_rank, int stream,
                      Deadline deadline);

}  // namespace prime::ring
