#include "digest.h"

#include <fstream>
#include <memory>
#include <vector>

#include <openssl/evp.h>

#include "error.h"

namespace llmnpu {
namespace {

struct Sha256 {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx{EVP_MD_CTX_new(), &EVP_MD_CTX_free};

  Sha256() {
    if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) throw RunError("SHA-256 is not available");
  }
  void update(const void* data, size_t n) {
    if (EVP_DigestUpdate(ctx.get(), data, n) != 1) throw RunError("SHA-256 failed");
  }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx.get(), md, &len) != 1) throw RunError("SHA-256 failed");
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
      out += digits[md[i] >> 4];
      out += digits[md[i] & 15];
    }
    return out;
  }
};

}  // namespace

std::string sha256_hex(const std::string& bytes) {
  Sha256 h;
  h.update(bytes.data(), bytes.size());
  return h.hex();
}

std::string file_sha256_hex(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot read " + path);
  Sha256 h;
  std::vector<char> block(1 << 20);
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    if (in.gcount() > 0) h.update(block.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw InputError("cannot read " + path);
  return h.hex();
}

}  // namespace llmnpu
