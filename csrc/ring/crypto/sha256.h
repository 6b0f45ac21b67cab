// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the ring handshake and job ids.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace prime::ring {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest finish();  // the object must not be updated afterwards

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const std::string& key, const void* message, size_t n);

// Constant-time comparison, so a forger learns nothing from how long a rejection takes.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace prime::ring
