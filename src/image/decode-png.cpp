// PNG through libpng 1.6 (Debian's libpng-dev), converted to RGB as Pillow's PngImagePlugin modes
// followed by convert("RGB") give it (Pillow's _MODES table, checked against tests/data/processor):
//   grey 1/2/4/8 bit ("1", "L;2", "L;4", "L")   -> the value scaled to 0..255 (x255, x85, x17, x1), replicated
//   grey 16 bit ("I;16", convert I16_RGB)        -> min(value, 255): Pillow clips, it does not rescale
//   grey+alpha, RGB, RGBA at 16 bit (";16B")     -> the high byte of each sample
//   palette 1/2/4/8 bit                          -> the PLTE colour; an index past PLTE is black
//   alpha, tRNS                                  -> dropped, not composited (convert("RGB") ignores them)
// libpng applies no gamma (Pillow neither).
//
// Errors longjmp back from libpng's error callback (never exit()); libpng's warnings and benign
// errors (an ancillary chunk's CRC, extra compressed data) are ignored as Pillow ignores them.
// Truncated data is an error. Limits for hostile input: width and height at most kMaxSide (libpng's
// default, set explicitly), at most 128 ancillary chunks cached and 4 MiB per chunk, and every
// ancillary chunk but tRNS skipped unread (no zTXt/iCCP inflation: fovea needs none of them). The
// pixel guard (decode.cpp) is applied to the IHDR, read by hand in probe_png, before libpng starts.
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include <png.h>

#include "fovea/checked.h"
#include "image/decoders.h"

namespace fovea::image::detail {

namespace {

constexpr uint32_t kMaxSide = 1000000;  // libpng's PNG_USER_WIDTH_MAX / HEIGHT_MAX
constexpr png_uint_32 kMaxCachedChunks = 128;
constexpr png_alloc_size_t kMaxChunkBytes = png_alloc_size_t(4) << 20;
constexpr uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

struct Reader {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
  bool truncated = false;
  char message[256] = {};
};

void read_data(png_structp png, png_bytep out, size_t n) {
  auto* r = static_cast<Reader*>(png_get_io_ptr(png));
  if (n > r->bytes.size() - r->pos) {
    r->truncated = true;
    png_error(png, "unexpected end of file");
  }
  std::memcpy(out, r->bytes.data() + r->pos, n);
  r->pos += n;
}

[[noreturn]] void on_error(png_structp png, png_const_charp msg) {
  auto* r = static_cast<Reader*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof r->message, "%s", msg ? msg : "libpng error");
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}

struct Png {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~Png() { png_destroy_read_struct(&png, info ? &info : nullptr, nullptr); }
};

// Runs `body` (libpng calls) under libpng's longjmp; false when libpng reported an error. `body`
// holds no objects with destructors across its libpng calls.
template <class F>
bool run(Png& p, F&& body) {
  if (setjmp(png_jmpbuf(p.png))) return false;
  body();
  return true;
}

// One decoded row (after png_set_packing: one byte per sample below 8 bits) to RGB.
void convert_row(const uint8_t* s, uint8_t* d, size_t w, int color_type, int depth, const uint8_t* palette) {
  const bool wide = depth == 16;
  switch (color_type) {
    case PNG_COLOR_TYPE_GRAY: {
      if (wide) {
        for (size_t x = 0; x < w; ++x) {
          const unsigned v = unsigned(s[2 * x]) << 8 | s[2 * x + 1];
          d[3 * x] = d[3 * x + 1] = d[3 * x + 2] = uint8_t(v > 255 ? 255 : v);
        }
      } else {
        const int scale = depth == 1 ? 255 : depth == 2 ? 85 : depth == 4 ? 17 : 1;
        for (size_t x = 0; x < w; ++x) d[3 * x] = d[3 * x + 1] = d[3 * x + 2] = uint8_t(s[x] * scale);
      }
      break;
    }
    case PNG_COLOR_TYPE_GRAY_ALPHA: {
      const size_t step = wide ? 4 : 2;
      for (size_t x = 0; x < w; ++x) d[3 * x] = d[3 * x + 1] = d[3 * x + 2] = s[step * x];
      break;
    }
    case PNG_COLOR_TYPE_RGB:
    case PNG_COLOR_TYPE_RGB_ALPHA: {
      const size_t channels = color_type == PNG_COLOR_TYPE_RGB ? 3 : 4, bytes = wide ? 2 : 1;
      for (size_t x = 0; x < w; ++x)
        for (size_t c = 0; c < 3; ++c) d[3 * x + c] = s[(channels * x + c) * bytes];  // the high byte
      break;
    }
    case PNG_COLOR_TYPE_PALETTE:
      for (size_t x = 0; x < w; ++x) std::memcpy(d + 3 * x, palette + 3 * size_t(s[x]), 3);
      break;
  }
}

// Bytes per decoded row as convert_row reads it.
int64_t row_bytes(int64_t w, int color_type, int depth) {
  const int64_t channels = color_type == PNG_COLOR_TYPE_GRAY || color_type == PNG_COLOR_TYPE_PALETTE ? 1
                           : color_type == PNG_COLOR_TYPE_GRAY_ALPHA                                 ? 2
                           : color_type == PNG_COLOR_TYPE_RGB                                        ? 3
                                                                                                     : 4;
  return w * channels * (depth == 16 ? 2 : 1);
}

}  // namespace

// The IHDR by hand: the signature, then the first chunk, 13 bytes of "IHDR".
ImageInfo probe_png(std::span<const uint8_t> b, const std::string& name) {
  if (b.size() < 33) corrupt(name, "PNG", "the file ends inside its header", true);
  if (std::memcmp(b.data(), kSignature, 8) != 0) corrupt(name, "PNG", "bad signature");
  if (be32(b.data() + 8) != 13 || std::memcmp(b.data() + 12, "IHDR", 4) != 0)
    corrupt(name, "PNG", "the first chunk is not a 13-byte IHDR");
  const uint32_t w = be32(b.data() + 16), h = be32(b.data() + 20);
  const int depth = b[24], color_type = b[25], interlace = b[28];
  if (w == 0 || h == 0 || w > kMaxSide || h > kMaxSide)
    fail("image '{}': PNG size {}x{} is outside 1..{} per side", name, w, h, kMaxSide);
  const bool depth_ok =
      (color_type == PNG_COLOR_TYPE_GRAY && (depth == 1 || depth == 2 || depth == 4 || depth == 8 || depth == 16)) ||
      (color_type == PNG_COLOR_TYPE_PALETTE && (depth == 1 || depth == 2 || depth == 4 || depth == 8)) ||
      ((color_type == PNG_COLOR_TYPE_RGB || color_type == PNG_COLOR_TYPE_GRAY_ALPHA ||
        color_type == PNG_COLOR_TYPE_RGB_ALPHA) &&
       (depth == 8 || depth == 16));
  if (!depth_ok)
    corrupt(name, "PNG", fmt::format("bit depth {} with colour type {} is not a valid PNG", depth, color_type));
  // libpng's buffers: two rows (current and previous, filtered) and zlib's window; an interlaced
  // image is read whole (Adam7 passes) unless it is 8-bit RGB, which goes straight into the output.
  const int64_t rb = row_bytes(w, color_type, depth) + 1;
  int64_t bytes = 2 * rb + (int64_t(1) << 20);
  if (interlace && !(color_type == PNG_COLOR_TYPE_RGB && depth == 8)) bytes += rb * int64_t(h) + 8 * int64_t(h);
  return ImageInfo{name, ImageFormat::PNG, int(w), int(h), bytes};
}

Rgb8 decode_png(std::span<const uint8_t> b, const ImageInfo& info) {
  Rgb8 out = blank_image(info);
  auto reader = std::make_unique<Reader>();
  reader->bytes = b;
  Png p;
  p.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, reader.get(), on_error, on_warning);
  if (!p.png) fail("image '{}': cannot start libpng", info.name);
  p.info = png_create_info_struct(p.png);
  if (!p.info) fail("image '{}': cannot start libpng", info.name);
  const size_t w = size_t(info.width), h = size_t(info.height);
  uint8_t palette[256 * 3] = {};  // past PLTE: black, as Pillow's palette
  std::vector<uint8_t> raw;       // decoded rows that are not already RGB8
  std::vector<png_bytep> rows;
  bool mismatch = false;
  int color_type = 0, depth = 0;
  if (!run(p, [&] {
        png_set_read_fn(p.png, reader.get(), read_data);
        png_set_user_limits(p.png, kMaxSide, kMaxSide);
        png_set_chunk_cache_max(p.png, kMaxCachedChunks);
        png_set_chunk_malloc_max(p.png, kMaxChunkBytes);
        png_set_keep_unknown_chunks(p.png, PNG_HANDLE_CHUNK_NEVER, nullptr, -1);  // all ancillary but tRNS
        png_read_info(p.png, p.info);
        png_uint_32 pw = 0, ph = 0;
        int interlace = 0;
        png_get_IHDR(p.png, p.info, &pw, &ph, &depth, &color_type, &interlace, nullptr, nullptr);
        if (pw != w || ph != h) {
          mismatch = true;
          return;
        }
        if (color_type == PNG_COLOR_TYPE_PALETTE) {
          png_colorp plte = nullptr;
          int n = 0;
          if (png_get_PLTE(p.png, p.info, &plte, &n) & PNG_INFO_PLTE)
            for (int i = 0; i < n && i < 256; ++i) {
              palette[3 * i] = plte[i].red;
              palette[3 * i + 1] = plte[i].green;
              palette[3 * i + 2] = plte[i].blue;
            }
        }
        if (depth < 8) png_set_packing(p.png);
        const int passes = png_set_interlace_handling(p.png);
        png_read_update_info(p.png, p.info);
        const size_t rb = size_t(row_bytes(int64_t(w), color_type, depth));
        if (png_get_rowbytes(p.png, p.info) != rb) {
          mismatch = true;
          return;
        }
        const bool direct = color_type == PNG_COLOR_TYPE_RGB && depth == 8;  // rows land in the output as they are
        if (direct) {
          rows.resize(h);
          for (size_t y = 0; y < h; ++y) rows[y] = out.data.data() + y * w * 3;
          png_read_image(p.png, rows.data());
        } else if (passes > 1) {  // Adam7: every pass refines every row, so keep them all
          raw.resize(checked_mul(rb, h, "PNG rows"));
          rows.resize(h);
          for (size_t y = 0; y < h; ++y) rows[y] = raw.data() + y * rb;
          png_read_image(p.png, rows.data());
          for (size_t y = 0; y < h; ++y)
            convert_row(rows[y], out.data.data() + y * w * 3, w, color_type, depth, palette);
        } else {
          raw.resize(rb);
          for (size_t y = 0; y < h; ++y) {
            png_read_row(p.png, raw.data(), nullptr);
            convert_row(raw.data(), out.data.data() + y * w * 3, w, color_type, depth, palette);
          }
        }
        // No png_read_end: what follows the last row (text chunks, IEND) is not needed.
      }))
    corrupt(info.name, "PNG", reader->message, reader->truncated);
  if (mismatch) corrupt(info.name, "PNG", "the header libpng read differs from the IHDR");
  return out;
}

}  // namespace fovea::image::detail
