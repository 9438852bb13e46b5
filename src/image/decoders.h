// The per-format decoders behind image::probe / image::decode_memory (src/image/decode.cpp, which
// detects the format and applies the pixel guard between the two steps):
//   probe_<fmt>(bytes, name)  reads the header only: size and the decoder's own peak buffers;
//   decode_<fmt>(bytes, info) decodes to RGB as Pillow's convert("RGB") gives it, `info` being what
//                             probe_<fmt> returned (the guard already applied to it).
// Every error is a fovea::Error "image '<name>': <corrupt|truncated> <FORMAT>: <detail>".
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include "fovea/error.h"
#include "fovea/image.h"

namespace fovea::image::detail {

ImageInfo probe_jpeg(std::span<const uint8_t> b, const std::string& name);
ImageInfo probe_png(std::span<const uint8_t> b, const std::string& name);
ImageInfo probe_gif(std::span<const uint8_t> b, const std::string& name);
ImageInfo probe_webp(std::span<const uint8_t> b, const std::string& name);
ImageInfo probe_bmp(std::span<const uint8_t> b, const std::string& name);

Rgb8 decode_jpeg(std::span<const uint8_t> b, const ImageInfo& info);
Rgb8 decode_png(std::span<const uint8_t> b, const ImageInfo& info);
Rgb8 decode_gif(std::span<const uint8_t> b, const ImageInfo& info);
Rgb8 decode_webp(std::span<const uint8_t> b, const ImageInfo& info);
Rgb8 decode_bmp(std::span<const uint8_t> b, const ImageInfo& info);

// The RGB image `info` describes, zero-filled (width x height x 3, the size checked for overflow).
Rgb8 blank_image(const ImageInfo& info);

// fovea::Error "image '<name>': corrupt <format>: <detail>" (or "truncated <format>: ...").
[[noreturn]] inline void corrupt(const std::string& name, const char* format, const std::string& detail,
                                 bool truncated = false) {
  fail("image '{}': {} {}: {}", name, truncated ? "truncated" : "corrupt", format, detail);
}

}  // namespace fovea::image::detail
