#include "sha256.h"

#include <stdexcept>

#include "libcrypto.h"

namespace prime::ring {
namespace {

Digest hmac_raw(const void* key, size_t key_len, const void* message, size_t n) {
  const auto& c = crypto::libcrypto();
  Digest out{};
  unsigned int len = 0;
  if (c.hmac(c.sha256(), key, static_cast<int>(key_len), static_cast<const unsigned char*>(message), n, out.data(),
             &len) == nullptr ||
      len != out.size()) {
    throw std::runtime_error("HMAC-SHA256 failed in libcrypto");
  }
  return out;
}

}  // namespace

Digest sha256(const void* data, size_t n) {
  const auto& c = crypto::libcrypto();
  Digest out{};
  unsigned int len = 0;
  if (c.digest(data, n, out.data(), &len, c.sha256(), nullptr) != 1 || len != out.size()) {
    throw std::runtime_error("SHA-256 failed in libcrypto");
  }
  return out;
}

Digest hmac_sha256(const std::string& key, const void* message, size_t n) {
  return hmac_raw(key.data(), key.size(), message, n);
}

std::string hkdf_sha256(const std::string& ikm, const std::string& salt, const std::string& info, size_t length) {
  if (length > 255 * 32) throw std::invalid_argument("HKDF-SHA256 output is at most 8160 bytes");
  // RFC 5869 2.2: PRK = HMAC(salt, IKM); an absent salt is 32 zero bytes.
  const std::string zero_salt(32, '\0');
  const std::string& s = salt.empty() ? zero_salt : salt;
  const Digest prk = hmac_raw(s.data(), s.size(), ikm.data(), ikm.size());
  // 2.3: T(i) = HMAC(PRK, T(i-1) || info || i), OKM = T(1) || T(2) || ...
  std::string okm;
  std::string block;
  for (uint8_t i = 1; okm.size() < length; ++i) {
    std::string msg = block + info + static_cast<char>(i);
    const Digest t = hmac_raw(prk.data(), prk.size(), msg.data(), msg.size());
    block.assign(reinterpret_cast<const char*>(t.data()), t.size());
    okm += block;
  }
  okm.resize(length);
  return okm;
}

bool digests_equal(const Digest& a, const Digest& b) {
  return crypto::libcrypto().memcmp_ct(a.data(), b.data(), a.size()) == 0;
}

}  // namespace prime::ring
