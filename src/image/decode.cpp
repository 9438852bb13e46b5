// Image decoding with stb_image (Debian's libstb), with a header check before any pixel is decoded
// (decompression bombs) and RGB conversion as transformers' processor does it. Measured against
// transformers 5.17 (tests/data/processor): it calls PIL's convert("RGB"), which drops alpha without
// compositing, and maps a palette image's transparent index to that index's palette colour.
#include <stb_image.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <optional>

#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"

namespace fovea::image {

namespace {

// The palette colour of a GIF's transparent index for its first frame (stb returns those pixels as
// (0, 0, 0, 0), PIL as that colour); nullopt when the first frame has none or the file is odd.
std::optional<std::array<uint8_t, 3>> gif_transparent_colour(const std::vector<uint8_t>& b) {
  if (b.size() < 13 || std::memcmp(b.data(), "GIF8", 4) != 0) return std::nullopt;
  auto table_bytes = [](uint8_t packed) { return size_t(3) << ((packed & 7) + 1); };
  const uint8_t screen = b[10];
  size_t pos = 13, global = 0;
  if (screen & 0x80) global = pos, pos += table_bytes(screen);
  int transparent = -1;
  while (pos < b.size()) {
    if (b[pos] == 0x21 && pos + 1 < b.size()) {  // extension: label, then sub-blocks
      const uint8_t label = b[pos + 1];
      pos += 2;
      if (label == 0xF9 && pos + 4 < b.size() && b[pos] >= 4 && (b[pos + 1] & 1)) transparent = b[pos + 4];
      while (pos < b.size() && b[pos] != 0) pos += size_t(b[pos]) + 1;
      ++pos;
    } else if (b[pos] == 0x2C && pos + 9 < b.size()) {  // the first image descriptor
      if (transparent < 0) return std::nullopt;
      const uint8_t packed = b[pos + 9];
      const size_t table = (packed & 0x80) ? pos + 10 : global;
      const size_t entries = (packed & 0x80) ? table_bytes(packed) / 3 : table_bytes(screen) / 3;
      if (table == 0 || size_t(transparent) >= entries || table + 3 * size_t(transparent) + 2 >= b.size()) return std::nullopt;
      const uint8_t* c = b.data() + table + 3 * size_t(transparent);
      return std::array<uint8_t, 3>{c[0], c[1], c[2]};
    } else {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

Rgb8 decode_memory(const std::vector<uint8_t>& bytes, const std::string& name, const PreprocessConfig& cfg) {
  if (bytes.empty()) fail("image '{}': empty file", name);
  if (bytes.size() > size_t(INT32_MAX)) fail("image '{}': {} bytes is larger than the decoder takes (2 GiB)", name, bytes.size());
  int w = 0, h = 0, n = 0;
  if (!stbi_info_from_memory(bytes.data(), int(bytes.size()), &w, &h, &n))
    fail("image '{}': not a JPEG, PNG, BMP or GIF image ({})", name, stbi_failure_reason());
  if (w <= 0 || h <= 0) fail("image '{}': invalid size {}x{}", name, w, h);
  if (int64_t(w) * h > cfg.max_image_pixels)
    fail("image '{}': {}x{} = {} pixels exceeds the limit of {} (--max-image-pixels); refusing to decode", name, w, h,
         int64_t(w) * h, cfg.max_image_pixels);
  stbi_uc* px = stbi_load_from_memory(bytes.data(), int(bytes.size()), &w, &h, &n, 0);
  if (!px) fail("image '{}': cannot decode: {} (corrupt or truncated?)", name, stbi_failure_reason());
  Rgb8 out;
  out.width = w;
  out.height = h;
  out.name = name;
  out.data.resize(size_t(w) * h * 3);
  const auto gif_colour = n == 4 ? gif_transparent_colour(bytes) : std::nullopt;
  for (size_t i = 0; i < size_t(w) * h; ++i) {
    const stbi_uc* p = px + i * size_t(n);
    uint8_t* o = out.data.data() + i * 3;
    if (n == 1 || n == 2) {
      o[0] = o[1] = o[2] = p[0];  // grey (+ alpha) -> RGB
    } else if (gif_colour && p[3] == 0) {
      std::memcpy(o, gif_colour->data(), 3);
    } else {
      o[0] = p[0], o[1] = p[1], o[2] = p[2];  // alpha dropped, as PIL's convert("RGB")
    }
  }
  stbi_image_free(px);
  return out;
}

Rgb8 decode_file(const std::string& path, const PreprocessConfig& cfg) {
  const std::string s = read_file(path, "image");
  return decode_memory(std::vector<uint8_t>(s.begin(), s.end()), path, cfg);
}

}  // namespace fovea::image
