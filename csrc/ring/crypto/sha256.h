// SHA-256, HMAC-SHA256 (RFC 2104) and HKDF-SHA256 (RFC 5869), computed by OpenSSL's
// libcrypto (crypto/libcrypto.h), for the ring handshake, session keys and job ids.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace prime::ring {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t n);
Digest hmac_sha256(const std::string& key, const void* message, size_t n);
// HKDF-SHA256: extract with `salt`, expand with `info` to `length` bytes (at most 8160).
std::string hkdf_sha256(const std::string& ikm, const std::string& salt, const std::string& info, size_t length);

// Constant-time comparison, so a forger learns nothing from how long a rejection takes.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace prime::ring
