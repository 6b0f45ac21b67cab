#include "libcrypto.h"

#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace prime::ring::crypto {
namespace {

// libcrypto.so.3 is OpenSSL 3 (every current distribution); libcrypto.so is the
// development link (any version); 1.1 is what older distributions ship.
constexpr const char* kNames[] = {"libcrypto.so.3", "libcrypto.so", "libcrypto.so.1.1"};

template <typename F>
void bind(void* lib, const char* name, F* slot, std::string* missing) {
  *slot = reinterpret_cast<F>(::dlsym(lib, name));
  if (*slot == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

LibCrypto load() {
  void* lib = nullptr;
  const char* soname = nullptr;
  std::string tried;
  for (const char* name : kNames) {
    // RTLD_LOCAL: our symbols stay ours; a libcrypto the process already loaded
    // (Python's _ssl / _hashlib) is shared rather than loaded twice.
    lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      soname = name;
      break;
    }
    const char* why = ::dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + (why ? why : name);
  }
  if (lib == nullptr) {
    throw std::runtime_error(
        "prime ring: cannot load OpenSSL's libcrypto, which authenticates (and optionally encrypts) the ring's "
        "frames; install it (Debian/Ubuntu: apt-get install libssl3, RHEL: dnf install openssl-libs) or put it on "
        "LD_LIBRARY_PATH. Tried: " + tried);
  }
  LibCrypto c;
  c.soname = soname;
  std::string missing;
  bind(lib, "OpenSSL_version", &c.version_text, &missing);
  bind(lib, "EVP_aes_256_gcm", &c.aes_256_gcm, &missing);
  bind(lib, "EVP_CIPHER_CTX_new", &c.ctx_new, &missing);
  bind(lib, "EVP_CIPHER_CTX_free", &c.ctx_free, &missing);
  bind(lib, "EVP_CIPHER_CTX_ctrl", &c.ctx_ctrl, &missing);
  bind(lib, "EVP_EncryptInit_ex", &c.encrypt_init, &missing);
  bind(lib, "EVP_EncryptUpdate", &c.encrypt_update, &missing);
  bind(lib, "EVP_EncryptFinal_ex", &c.encrypt_final, &missing);
  bind(lib, "EVP_DecryptInit_ex", &c.decrypt_init, &missing);
  bind(lib, "EVP_DecryptUpdate", &c.decrypt_update, &missing);
  bind(lib, "EVP_DecryptFinal_ex", &c.decrypt_final, &missing);
  bind(lib, "EVP_sha256", &c.sha256, &missing);
  bind(lib, "EVP_Digest", &c.digest, &missing);
  bind(lib, "HMAC", &c.hmac, &missing);
  bind(lib, "CRYPTO_memcmp", &c.memcmp_ct, &missing);
  if (!missing.empty()) {
    throw std::runtime_error(std::string("prime ring: ") + soname +
                             " lacks functions the ring needs (OpenSSL 1.1 or newer is required): " + missing);
  }
  return c;  // the handle stays open for the life of the process
}

}  // namespace

const LibCrypto& libcrypto() {
  // A failed load throws out of the initializer, so the next call tries again.
  static const LibCrypto loaded = load();
  return loaded;
}

}  // namespace prime::ring::crypto
