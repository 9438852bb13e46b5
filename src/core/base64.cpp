// Base64 encode / strict decode (see base64.h).
#include "fovea/base64.h"

#include <array>

#include "fovea/error.h"
#include "fovea/threads.h"

namespace fovea {

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

// n bytes into (n + 2) / 3 * 4 characters at out, padded.
void encode_into(const uint8_t* data, size_t n, char* out) {
  size_t i = 0;
  for (; i + 3 <= n; i += 3, out += 4) {
    const uint32_t w = uint32_t(data[i]) << 16 | uint32_t(data[i + 1]) << 8 | data[i + 2];
    out[0] = kAlphabet[w >> 18];
    out[1] = kAlphabet[(w >> 12) & 63];
    out[2] = kAlphabet[(w >> 6) & 63];
    out[3] = kAlphabet[w & 63];
  }
  if (i < n) {  // 1 or 2 bytes left: 2 or 3 characters and padding
    const uint32_t w = uint32_t(data[i]) << 16 | (i + 1 < n ? uint32_t(data[i + 1]) << 8 : 0u);
    out[0] = kAlphabet[(w >> 18) & 63];
    out[1] = kAlphabet[(w >> 12) & 63];
    out[2] = i + 1 < n ? kAlphabet[(w >> 6) & 63] : '=';
    out[3] = '=';
  }
}

// Whole quanta of four alphabet characters from s (n long) into 3 bytes each at out, up to the first
// quantum holding anything else (whitespace, '=', an invalid byte) or fewer than 4 characters left;
// returns the characters taken, a multiple of 4.
size_t decode_quanta(const char* s, size_t n, uint8_t* out) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4, out += 3) {
    const int a = kValues[uint8_t(s[i])], b = kValues[uint8_t(s[i + 1])], c = kValues[uint8_t(s[i + 2])],
              d = kValues[uint8_t(s[i + 3])];
    if ((a | b | c | d) < 0) break;
    const uint32_t w = uint32_t(a) << 18 | uint32_t(b) << 12 | uint32_t(c) << 6 | uint32_t(d);
    out[0] = uint8_t(w >> 16);
    out[1] = uint8_t(w >> 8);
    out[2] = uint8_t(w);
  }
  return i;
}

}  // namespace

void base64_append(std::string& out, const uint8_t* data, size_t n, size_t parallel_from) {
  const size_t at = out.size();
  out.resize(at + base64_size(n));
  char* dst = out.data() + at;
  if (n < parallel_from) return encode_into(data, n, dst);
  // Ranges of whole 3-byte groups each fill their own 4-character groups: only the last range can
  // end in padding, so the text is the serial encoder's, byte for byte.
  constexpr int64_t kChunk = 3 << 16;
  parallel_ranges(int64_t(n), kChunk,
                  [&](int64_t lo, int64_t hi) { encode_into(data + lo, size_t(hi - lo), dst + size_t(lo) / 3 * 4); });
}

std::string base64_encode(const uint8_t* data, size_t n, size_t parallel_from) {
  std::string out;
  base64_append(out, data, n, parallel_from);
  return out;
}

std::vector<uint8_t> base64_decode(std::string_view text, const std::string& what) {
  std::vector<uint8_t> out(text.size() / 4 * 3 + 2);  // at most 6 bits per character
  uint8_t* o = out.data();
  uint32_t acc = 0;
  int bits = 0;
  size_t digits = 0, pad = 0;
  for (size_t i = 0; i < text.size();) {
    if (bits == 0 && pad == 0) {  // between quanta: the fast path takes what it can
      const size_t k = decode_quanta(text.data() + i, text.size() - i, o);
      i += k;
      o += k / 4 * 3;
      digits += k;
      if (i == text.size()) break;
    }
    // One character at a time: whitespace, padding, an error, or the rest of a quantum after them.
    const size_t at = i++;
    const char c = text[at];
    if (is_space(c)) continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    const int v = kValues[uint8_t(c)];
    if (v < 0) fail("{}: invalid base64: {} at offset {}", what, printable(c), at);
    if (pad > 0) fail("{}: invalid base64: data after '=' padding at offset {}", what, at);
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    ++digits;
    if (bits >= 8) {
      bits -= 8;
      *o++ = uint8_t(acc >> bits);
      acc &= (1u << bits) - 1;
    }
  }
  if (digits % 4 == 1)
    fail("{}: invalid base64: truncated ({} characters is not a whole number of bytes)", what, digits);
  if (pad > 0 && (digits + pad) % 4 != 0) fail("{}: invalid base64: wrong '=' padding", what);
  out.resize(size_t(o - out.data()));
  return out;
}

}  // namespace fovea
