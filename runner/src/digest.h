// SHA-256 for the sidecar's checksums (format/sidecar.py: sidecar_sha256 over its canonical JSON,
// pte_sha256 over the .pte), from OpenSSL's libcrypto (Debian's libssl-dev; `make install` installs
// it with apt where it is missing).
#pragma once
#include <string>

namespace llmnpu {

// Lower-case hex SHA-256 of `bytes`.
std::string sha256_hex(const std::string& bytes);

// Lower-case hex SHA-256 of the file at `path`, read in blocks; throws InputError if it cannot be read.
std::string file_sha256_hex(const std::string& path);

}  // namespace llmnpu
