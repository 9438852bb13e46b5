// Image decoding: the format from the first bytes, the header (probe), the pixel guard, then the
// format's decoder (decode-jpeg.cpp: libjpeg-turbo, decode-png.cpp: libpng, decode-gif.cpp: giflib,
// decode-webp.cpp: libwebp, decode-bmp.cpp: fovea's own). The RGB conversion is what transformers'
// processor gets from PIL's convert("RGB"), measured against transformers 5.17 (tests/data/processor):
// alpha is dropped without compositing, a palette image's transparent index keeps its palette colour.
// Checked against Pillow 12.3.0 (its bundled libjpeg-turbo 3.1.4, libwebp 1.6), 2026-12-01: 64 files
// of every layout each decoder reads (fuzz/corpus/image-* and the cases of tests/test-image.cpp:
// CMYK/YCCK and progressive JPEG, 1..16-bit and interlaced PNG, offset and interlaced GIF frames,
// lossy/lossless/alpha/animated WebP, every BMP depth and bit-field layout) decode to Pillow's
// convert("RGB") bytes exactly, and the processor golden sets (tests/data/processor, photographs)
// give identical levels for every format, JPEG included.
//
// The libraries are Debian's hardened, maintained ones, linked statically (CMakeLists.txt): stb_image,
// used before, is not meant for untrusted input and Debian's 2.27 overflows its heap on a JPEG
// Huffman table of more than 256 codes (tests/fuzz-regressions/image-jpeg/).
#include <algorithm>
#include <cstring>
#include <new>

#include "fovea/checked.h"
#include "fovea/io.h"
#include "image/decoders.h"

namespace fovea::image {

const char* format_name(ImageFormat f) {
  switch (f) {
    case ImageFormat::JPEG: return "JPEG";
    case ImageFormat::PNG: return "PNG";
    case ImageFormat::GIF: return "GIF";
    case ImageFormat::WEBP: return "WebP";
    case ImageFormat::BMP: return "BMP";
  }
  return "image";
}

int64_t image_pixel_limit(const PreprocessConfig& cfg) {
  if (cfg.max_image_pixels > 0) return cfg.max_image_pixels;
  constexpr int64_t kShippedMaxPixels = int64_t(4096) * 4096;
  const int64_t budget = std::max(cfg.max_pixels, kShippedMaxPixels);
  return budget > INT64_MAX / 4 ? INT64_MAX : 4 * budget;
}

namespace {

bool starts_with(std::span<const uint8_t> b, const char* magic, size_t n, size_t at = 0) {
  return b.size() >= at + n && std::memcmp(b.data() + at, magic, n) == 0;
}

}  // namespace

ImageInfo probe(std::span<const uint8_t> b, const std::string& name, const PreprocessConfig& cfg) {
  if (b.empty()) fail("image '{}': empty file", name);
  if (b.size() > kMaxEncodedImageBytes)
    fail("image '{}': {} bytes is more than an image may have ({} MiB)", name, b.size(), kMaxEncodedImageBytes >> 20);
  ImageInfo info;
  if (starts_with(b, "\xFF\xD8\xFF", 3)) {
    info = detail::probe_jpeg(b, name);
  } else if (starts_with(b, "\x89PNG\r\n\x1A\n", 8)) {
    info = detail::probe_png(b, name);
  } else if (starts_with(b, "GIF87a", 6) || starts_with(b, "GIF89a", 6)) {
    info = detail::probe_gif(b, name);
  } else if (starts_with(b, "RIFF", 4) && starts_with(b, "WEBP", 4, 8)) {
    info = detail::probe_webp(b, name);
  } else if (starts_with(b, "BM", 2)) {
    info = detail::probe_bmp(b, name);
  } else {
    fail("image '{}': not a JPEG, PNG, WebP, BMP or GIF image", name);
  }
  if (info.width <= 0 || info.height <= 0) fail("image '{}': invalid size {}x{}", name, info.width, info.height);
  const int64_t pixels = int64_t(info.width) * info.height, limit = image_pixel_limit(cfg);  // < 2^62
  if (pixels > limit)
    fail("image '{}': {}x{} = {} pixels exceeds the limit of {} (--max-image-pixels); refusing to decode", name,
         info.width, info.height, pixels, limit);
  return info;
}

// How the bound was set: the buffers alive together in each phase, from the code, then checked
// against the peak RSS (VmHWM growth, glibc's mmap threshold fixed at 1 MiB so freed buffers leave;
// a decode first so code pages do not count) of decoding and preprocessing one file:
//   decode      RGB (3 bytes/pixel) + the decoder's own (ImageInfo::decoder_bytes, per format)
//   resize      RGB + the horizontal pass (3 x in_h x out_w) + the vertical pass (3 x out_h x out_w)
//   patchify    RGB + the resized image + the float patches (4 x 3 x temporal x out_h x out_w)
// plus 8 MiB (allocator, thread stacks, resize taps, libraries' small state). Measured 2026-12-01
// on the 2-core development machine (bound / peak):
//   7680x4320 baseline JPEG, shipped budget (patches decide)    559.1 / 551.3 MB
//   7680x4320 progressive JPEG, 1 MP budget (coefficients)      209.3 / 199.4 MB
//   4000x3000 progressive CMYK JPEG, 1 MP budget                142.0 / 132.3 MB
//   4000x3000 interlaced 16-bit RGBA PNG, 1 MP budget           141.5 / 132.3 MB
//   1600x1200 of every format at 3 budgets: tests/test-image.cpp (ProbeAndPeakBytesBoundWhatDecodingTakes)
// A long-running server's heap also keeps freed chunks resident (fragmentation): the bound counts
// live buffers, which is what reserving it against a byte budget needs.
int64_t decode_peak_bytes(const ImageInfo& info, const PreprocessConfig& cfg) {
  const int64_t w = info.width, h = info.height, rgb = checked_mul<int64_t>(3 * w, h, "decode_peak_bytes");
  const int64_t decode_phase = rgb + info.decoder_bytes;
  int64_t resize_phase = 0, patch_phase = 0;
  try {
    const auto [oh, ow] = resized_size(info.height, info.width, cfg);
    const int64_t out = 3 * int64_t(oh) * ow;
    const bool resized = oh != h || ow != w;
    if (resized) resize_phase = rgb + 3 * h * ow + (oh != h ? out : 0);
    patch_phase = rgb + (resized ? out : 0) + 4 * out * cfg.temporal;
  } catch (const Error&) {
    // preprocess refuses this size before it allocates: decoding is the peak.
  }
  return std::max({decode_phase, resize_phase, patch_phase}) + (int64_t(8) << 20);
}

namespace detail {

Rgb8 blank_image(const ImageInfo& info) {
  Rgb8 img;
  img.width = info.width;
  img.height = info.height;
  img.name = info.name;
  img.data.resize(
      checked_mul<size_t>(checked_mul<size_t>(size_t(info.width), size_t(info.height), "image size"), 3, "image size"));
  return img;
}

}  // namespace detail

Rgb8 decode_memory(std::span<const uint8_t> bytes, const std::string& name, const PreprocessConfig& cfg) {
  const ImageInfo info = probe(bytes, name, cfg);
  try {
    switch (info.format) {
      case ImageFormat::JPEG: return detail::decode_jpeg(bytes, info);
      case ImageFormat::PNG: return detail::decode_png(bytes, info);
      case ImageFormat::GIF: return detail::decode_gif(bytes, info);
      case ImageFormat::WEBP: return detail::decode_webp(bytes, info);
      case ImageFormat::BMP: return detail::decode_bmp(bytes, info);
    }
  } catch (const std::bad_alloc&) {
    fail("image '{}': out of memory decoding a {}x{} {}", name, info.width, info.height, format_name(info.format));
  }
  fail("image '{}': unknown format", name);
}

Rgb8 decode_file(const std::string& path, const PreprocessConfig& cfg) {
  const std::string s = read_file(path, "image", kMaxEncodedImageBytes);
  return decode_memory({reinterpret_cast<const uint8_t*>(s.data()), s.size()}, path, cfg);
}

}  // namespace fovea::image
