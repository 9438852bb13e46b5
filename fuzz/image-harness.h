// The body shared by the image decoders' harnesses (fuzz/image-<format>.cpp): probe, the memory
// bound, then decode_memory under a 2^18-pixel guard (512x512: a run stays in milliseconds). Any
// input gives an image or a fovea::Error naming it; the decoded size must be the probed one and the
// bound must cover the RGB image.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fovea/error.h"
#include "fovea/image.h"

namespace fovea::fuzz {

inline int decode_image(const uint8_t* data, size_t size) {
  image::PreprocessConfig cfg;
  cfg.max_image_pixels = int64_t(1) << 18;
  cfg.min_pixels = 4096, cfg.max_pixels = 65536;
  const std::span<const uint8_t> bytes(data, size);
  try {
    const image::ImageInfo info = image::probe(bytes, "fuzz", cfg);
    const int64_t peak = image::decode_peak_bytes(info, cfg);
    const image::Rgb8 img = image::decode_memory(bytes, "fuzz", cfg);
    if (img.width != info.width || img.height != info.height) std::abort();
    if (img.data.size() != size_t(img.width) * size_t(img.height) * 3) std::abort();
    if (peak < int64_t(img.data.size())) std::abort();
  } catch (const Error& e) {
    if (std::string(e.what()).find("image 'fuzz'") == std::string::npos) std::abort();
  }
  return 0;
}

}  // namespace fovea::fuzz
