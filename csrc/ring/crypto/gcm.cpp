#include "gcm.h"

#include <algorithm>
#include <climits>
#include <string>
#include <stdexcept>
#include <utility>

#include "libcrypto.h"

namespace prime::ring::crypto {
namespace {

// EVP_*Update take an int length.
constexpr size_t kMaxUpdate = size_t{1} << 30;

void check(int ok, const char* what) {
  if (ok != 1) throw std::runtime_error(std::string("AES-256-GCM: ") + what + " failed in libcrypto");
}

}  // namespace

Gcm::Gcm(const Key256& key, Mode mode) : mode_(mode) {
  const auto& c = libcrypto();
  ctx_ = c.ctx_new();
  if (ctx_ == nullptr) throw std::bad_alloc();
  // The key schedule is computed once here; start() only sets the IV (12 bytes, GCM's default).
  const int ok = mode_ == Mode::kSeal ? c.encrypt_init(ctx_, c.aes_256_gcm(), nullptr, key.data(), nullptr)
                                      : c.decrypt_init(ctx_, c.aes_256_gcm(), nullptr, key.data(), nullptr);
  if (ok != 1) {
    c.ctx_free(ctx_);
    ctx_ = nullptr;
    check(ok, "key setup");
  }
}

Gcm::~Gcm() {
  if (ctx_ != nullptr) libcrypto().ctx_free(ctx_);
}

Gcm::Gcm(Gcm&& other) noexcept : ctx_(std::exchange(other.ctx_, nullptr)), mode_(other.mode_) {}

Gcm& Gcm::operator=(Gcm&& other) noexcept {
  if (this != &other) {
    if (ctx_ != nullptr) libcrypto().ctx_free(ctx_);
    ctx_ = std::exchange(other.ctx_, nullptr);
    mode_ = other.mode_;
  }
  return *this;
}

void Gcm::start(uint64_t counter) {
  unsigned char iv[12] = {};
  for (int i = 0; i < 8; ++i) iv[i] = static_cast<unsigned char>(counter >> (8 * i));
  const auto& c = libcrypto();
  check(mode_ == Mode::kSeal ? c.encrypt_init(ctx_, nullptr, nullptr, nullptr, iv)
                             : c.decrypt_init(ctx_, nullptr, nullptr, nullptr, iv),
        "IV setup");
}

void Gcm::authenticate(const void* data, size_t n) {
  const auto& c = libcrypto();
  auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const int len = static_cast<int>(std::min(n, kMaxUpdate));
    int out = 0;
    check(mode_ == Mode::kSeal ? c.encrypt_update(ctx_, nullptr, &out, p, len)
                               : c.decrypt_update(ctx_, nullptr, &out, p, len),
          "authenticating");
    p += len;
    n -= static_cast<size_t>(len);
  }
}

void Gcm::crypt(const void* in, void* out, size_t n) {
  const auto& c = libcrypto();
  auto* src = static_cast<const unsigned char*>(in);
  auto* dst = static_cast<unsigned char*>(out);
  while (n > 0) {
    const int len = static_cast<int>(std::min(n, kMaxUpdate));
    int written = 0;
    check(mode_ == Mode::kSeal ? c.encrypt_update(ctx_, dst, &written, src, len)
                               : c.decrypt_update(ctx_, dst, &written, src, len),
          mode_ == Mode::kSeal ? "encrypting" : "decrypting");
    if (written != len) throw std::runtime_error("AES-256-GCM: libcrypto buffered a partial block");
    src += len;
    dst += len;
    n -= static_cast<size_t>(len);
  }
}

void Gcm::seal_tag(uint8_t* tag) {
  const auto& c = libcrypto();
  unsigned char rest[16];
  int out = 0;
  check(c.encrypt_final(ctx_, rest, &out), "finishing");
  check(c.ctx_ctrl(ctx_, kCtrlGcmGetTag, static_cast<int>(kGcmTagBytes), tag), "reading the tag");
}

bool Gcm::open_tag(const uint8_t* tag) {
  const auto& c = libcrypto();
  unsigned char expected[kGcmTagBytes];
  std::copy(tag, tag + kGcmTagBytes, expected);
  check(c.ctx_ctrl(ctx_, kCtrlGcmSetTag, static_cast<int>(kGcmTagBytes), expected), "setting the tag");
  unsigned char rest[16];
  int out = 0;
  // DecryptFinal compares the tags in constant time; <= 0 means they differ.
  return c.decrypt_final(ctx_, rest, &out) > 0;
}

}  // namespace prime::ring::crypto
