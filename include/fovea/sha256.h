// fovea/sha256.h: SHA-256 (FIPS 180-4), for content keys of the encoder cache (fovea/ec-cache.h).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace fovea {

// The digest of `data` as 64 lowercase hex digits.
std::string sha256_hex(std::span<const uint8_t> data);
// The same for text (a URL, a data URL): its bytes as they are.
std::string sha256_hex(std::string_view text);

}  // namespace fovea
