// Base64 encode / strict decode (see base64.h).
#include "server/base64.h"

#include <array>

#include "fovea/error.h"

namespace fovea::server {

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// Value of each byte in the alphabet, -1 for anything else.
constexpr std::array<int8_t, 256> make_values() {
  std::array<int8_t, 256> v{};
  for (auto& x : v) x = -1;
  for (int i = 0; i < 64; ++i) v[uint8_t(kAlphabet[i])] = int8_t(i);
  return v;
}
constexpr std::array<int8_t, 256> kValues = make_values();

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string printable(char c) {
  const auto u = uint8_t(c);
  return u >= 0x20 && u < 0x7F ? fmt::format("'{}'", c) : fmt::format("byte 0x{:02X}", u);
}

}  // namespace

std::string base64_encode(const uint8_t* data, size_t n) {
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    const uint32_t w = uint32_t(data[i]) << 16 | uint32_t(data[i + 1]) << 8 | data[i + 2];
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(w >> s) & 63];
  }
  if (i < n) {  // 1 or 2 bytes left: 2 or 3 characters and padding
    const uint32_t w = uint32_t(data[i]) << 16 | (i + 1 < n ? uint32_t(data[i + 1]) << 8 : 0u);
    out += kAlphabet[(w >> 18) & 63];
    out += kAlphabet[(w >> 12) & 63];
    out += i + 1 < n ? kAlphabet[(w >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::vector<uint8_t> base64_decode(std::string_view text, const std::string& what) {
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t digits = 0, pad = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (is_space(c)) continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    const int v = kValues[uint8_t(c)];
    if (v < 0) fail("{}: invalid base64: {} at offset {}", what, printable(c), i);
    if (pad > 0) fail("{}: invalid base64: data after '=' padding at offset {}", what, i);
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    ++digits;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
      acc &= (1u << bits) - 1;
    }
  }
  if (digits % 4 == 1) fail("{}: invalid base64: truncated ({} characters is not a whole number of bytes)", what, digits);
  if (pad > 0 && (digits + pad) % 4 != 0) fail("{}: invalid base64: wrong '=' padding", what);
  return out;
}

}  // namespace fovea::server
