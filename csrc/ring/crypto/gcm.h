// AES-256-GCM (libcrypto's EVP) for one direction of one stream: a context that
// keeps its key schedule and is restarted per message with a new IV. Each
// direction has its own key, so (key, IV) pairs never repeat: the IV is the
// message's number on that direction, which the sender counts up and the receiver
// expects, so a replayed, dropped or reordered message fails its tag.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace prime::ring::crypto {

struct EvpCipherCtx;

using Key256 = std::array<uint8_t, 32>;
constexpr size_t kGcmTagBytes = 16;

class Gcm {
 public:
  enum class Mode { kSeal, kOpen };

  Gcm(const Key256& key, Mode mode);
  ~Gcm();
  Gcm(Gcm&& other) noexcept;
  Gcm& operator=(Gcm&& other) noexcept;
  Gcm(const Gcm&) = delete;
  Gcm& operator=(const Gcm&) = delete;

  // Starts message number `counter`: IV = counter (8 bytes little-endian) || 4 zero bytes.
  void start(uint64_t counter);
  // Bytes covered by the tag but sent as they are (GCM's additional data). All of a
  // message's additional data must come before its first crypt().
  void authenticate(const void* data, size_t n);
  // Seal: encrypts; open: decrypts. `out` may equal `in`.
  void crypt(const void* in, void* out, size_t n);
  // Seal: ends the message and writes its tag.
  void seal_tag(uint8_t* tag);
  // Open: ends the message; true when `tag` is its tag.
  bool open_tag(const uint8_t* tag);

 private:
  EvpCipherCtx* ctx_ = nullptr;
  Mode mode_;
};

}  // namespace prime::ring::crypto
