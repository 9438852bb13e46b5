// Image decoding with stb_image (Debian's libstb), with a header check before any pixel is decoded
// (decompression bombs) and RGB conversion as transformers' convert_to_rgb does it.
#include <stb_image.h>

#include <filesystem>

#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"

namespace fovea::image {

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
  out.data.resize(size_t(w) * h * 3);
  for (size_t i = 0; i < size_t(w) * h; ++i) {
    const stbi_uc* p = px + i * size_t(n);
    uint8_t* o = out.data.data() + i * 3;
    if (n == 1 || n == 2) {
      o[0] = o[1] = o[2] = p[0];  // grey (+ alpha) -> RGB
    } else {
      o[0] = p[0], o[1] = p[1], o[2] = p[2];
    }
    if (n == 2 || n == 4) {  // alpha: composite over white, rounded
      const int a = p[n - 1];
      for (int c = 0; c < 3; ++c) o[c] = uint8_t((o[c] * a + 255 * (255 - a) + 127) / 255);
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
