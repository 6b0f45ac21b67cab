// The system's OpenSSL libcrypto, loaded at run time (dlopen), so that building
// prime needs no OpenSSL headers and a host without libcrypto still imports prime
// (the ring then refuses to form, saying why). Only the few EVP / HMAC entry points
// the ring uses are declared, with opaque pointers; their signatures are the same
// in OpenSSL 1.1 and 3.x.
#pragma once

#include <cstddef>

namespace prime::ring::crypto {

struct EvpCipher;     // EVP_CIPHER
struct EvpCipherCtx;  // EVP_CIPHER_CTX
struct EvpMd;         // EVP_MD

// EVP_CIPHER_CTX_ctrl codes for GCM (include/openssl/evp.h).
constexpr int kCtrlGcmGetTag = 0x10;
constexpr int kCtrlGcmSetTag = 0x11;

struct LibCrypto {
  const char* soname = nullptr;  // which library was loaded
  const char* (*version_text)(int) = nullptr;

  const EvpCipher* (*aes_256_gcm)() = nullptr;
  EvpCipherCtx* (*ctx_new)() = nullptr;
  void (*ctx_free)(EvpCipherCtx*) = nullptr;
  int (*ctx_ctrl)(EvpCipherCtx*, int, int, void*) = nullptr;
  int (*encrypt_init)(EvpCipherCtx*, const EvpCipher*, void* engine, const unsigned char* key,
                      const unsigned char* iv) = nullptr;
  int (*encrypt_update)(EvpCipherCtx*, unsigned char* out, int* outl, const unsigned char* in, int inl) = nullptr;
  int (*encrypt_final)(EvpCipherCtx*, unsigned char* out, int* outl) = nullptr;
  int (*decrypt_init)(EvpCipherCtx*, const EvpCipher*, void* engine, const unsigned char* key,
                      const unsigned char* iv) = nullptr;
  int (*decrypt_update)(EvpCipherCtx*, unsigned char* out, int* outl, const unsigned char* in, int inl) = nullptr;
  int (*decrypt_final)(EvpCipherCtx*, unsigned char* out, int* outl) = nullptr;

  const EvpMd* (*sha256)() = nullptr;
  int (*digest)(const void* data, size_t n, unsigned char* md, unsigned int* md_len, const EvpMd* type,
                void* engine) = nullptr;
  unsigned char* (*hmac)(const EvpMd* md, const void* key, int key_len, const unsigned char* data, size_t n,
                         unsigned char* out, unsigned int* out_len) = nullptr;
  int (*memcmp_ct)(const void* a, const void* b, size_t n) = nullptr;  // CRYPTO_memcmp, constant time
};

// The loaded library (loaded on first use, kept for the life of the process).
// Throws std::runtime_error saying what to install when it cannot be loaded.
const LibCrypto& libcrypto();

}  // namespace prime::ring::crypto
