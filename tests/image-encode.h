// Test-only image writers, with the same libraries fovea decodes with (libpng, libjpeg-turbo,
// giflib, libwebp's encoder; all in the static archives fovea_core links) and a hand-built BMP, so
// tests can make any layout they need. A library error aborts the test binary: these only ever
// encode what the test itself describes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gif_lib.h>
#include <jpeglib.h>
#include <png.h>
#include <webp/encode.h>

namespace fovea::test {

// PNG of any colour type and depth. `samples`: one row after another, each sample one byte (depth
// <= 8; packed here for 1/2/4 bits) or two big-endian bytes (16). `plte`: RGB triples; `trns`: the
// tRNS chunk's bytes.
inline std::vector<uint8_t> encode_png(int w, int h, int color_type, int depth, const std::vector<uint8_t>& samples,
                                       bool interlace = false, const std::vector<uint8_t>& plte = {},
                                       const std::vector<uint8_t>& trns = {}) {
  std::vector<uint8_t> out;
  png_structp png = png_create_write_struct(
      PNG_LIBPNG_VER_STRING, nullptr,
      [](png_structp, png_const_charp m) {
        std::fprintf(stderr, "libpng: %s\n", m);
        std::abort();
      },
      nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(
      png, &out,
      [](png_structp p, png_bytep d, size_t n) {
        static_cast<std::vector<uint8_t>*>(png_get_io_ptr(p))
            ->insert(static_cast<std::vector<uint8_t>*>(png_get_io_ptr(p))->end(), d, d + n);
      },
      [](png_structp) {});
  png_set_IHDR(png, info, png_uint_32(w), png_uint_32(h), depth, color_type,
               interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  std::vector<png_color> pal;
  for (size_t i = 0; i + 2 < plte.size(); i += 3) pal.push_back({plte[i], plte[i + 1], plte[i + 2]});
  if (!pal.empty()) png_set_PLTE(png, info, pal.data(), int(pal.size()));
  if (!trns.empty()) {
    if (color_type == PNG_COLOR_TYPE_PALETTE) {
      png_set_tRNS(png, info, trns.data(), int(trns.size()), nullptr);
    } else {
      png_color_16 c{};
      c.gray = png_uint_16(trns[0] << 8 | trns[1]);
      if (trns.size() >= 6)
        c.red = c.gray, c.green = png_uint_16(trns[2] << 8 | trns[3]), c.blue = png_uint_16(trns[4] << 8 | trns[5]);
      png_set_tRNS(png, info, nullptr, 0, &c);
    }
  }
  png_write_info(png, info);
  if (depth < 8) png_set_packing(png);
  const int channels = color_type == PNG_COLOR_TYPE_GRAY || color_type == PNG_COLOR_TYPE_PALETTE ? 1
                       : color_type == PNG_COLOR_TYPE_GRAY_ALPHA                                 ? 2
                       : color_type == PNG_COLOR_TYPE_RGB                                        ? 3
                                                                                                 : 4;
  const size_t row = size_t(w) * size_t(channels) * (depth == 16 ? 2 : 1);
  std::vector<uint8_t> copy = samples;
  std::vector<png_bytep> rows(static_cast<size_t>(h));
  for (int y = 0; y < h; ++y) rows[size_t(y)] = copy.data() + size_t(y) * row;
  if (interlace) png_set_interlace_handling(png);
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

inline std::vector<uint8_t> encode_png_rgb(int w, int h, const std::vector<uint8_t>& rgb) {
  return encode_png(w, h, PNG_COLOR_TYPE_RGB, 8, rgb);
}

// JPEG of 1 (grey), 3 (RGB) or 4 (CMYK, written with libjpeg's Adobe marker; `ycck` stores it as
// YCCK) components; 2 writes a two-component file of no colour space (Pillow refuses those).
inline std::vector<uint8_t> encode_jpeg(int w, int h, int components, const std::vector<uint8_t>& px, int quality,
                                        bool progressive = false, bool ycck = false) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);  // the default error_exit prints and exits: fine for test input
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = JDIMENSION(w);
  c.image_height = JDIMENSION(h);
  c.input_components = components;
  c.in_color_space = components == 1   ? JCS_GRAYSCALE
                     : components == 3 ? JCS_RGB
                     : components == 4 ? JCS_CMYK
                                       : JCS_UNKNOWN;
  jpeg_set_defaults(&c);
  if (components == 4) jpeg_set_colorspace(&c, ycck ? JCS_YCCK : JCS_CMYK);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  std::vector<uint8_t> copy = px;
  while (c.next_scanline < c.image_height) {
    JSAMPROW r = copy.data() + size_t(c.next_scanline) * size_t(w) * size_t(components);
    jpeg_write_scanlines(&c, &r, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<uint8_t> out(buf, buf + size);
  jpeg_destroy_compress(&c);
  std::free(buf);
  return out;
}

inline std::vector<uint8_t> encode_jpeg_rgb(int w, int h, const std::vector<uint8_t>& rgb, int quality) {
  return encode_jpeg(w, h, 3, rgb, quality);
}

// A GIF of one frame (`indices`: frame_w x frame_h palette indices) at (left, top) on a screen of
// screen_w x screen_h; the palette (RGB triples, a power of two of them) global or local; a
// graphic control extension with the transparent index when transparent >= 0; a second frame when
// `second` is not empty (same geometry), which decoders must ignore.
struct GifSpec {
  int screen_w = 0, screen_h = 0, left = 0, top = 0, frame_w = 0, frame_h = 0;
  std::vector<uint8_t> palette, indices, second;
  bool local_palette = false, interlace = false;
  int transparent = -1;
};

inline std::vector<uint8_t> encode_gif(const GifSpec& s) {
  std::vector<uint8_t> out;
  int err = 0;
  GifFileType* g = EGifOpen(
      &out,
      [](GifFileType* f, const GifByteType* d, int n) {
        static_cast<std::vector<uint8_t>*>(f->UserData)
            ->insert(static_cast<std::vector<uint8_t>*>(f->UserData)->end(), d, d + n);
        return n;
      },
      &err);
  if (!g) std::abort();
  EGifSetGifVersion(g, true);
  std::vector<GifColorType> colours;
  for (size_t i = 0; i + 2 < s.palette.size(); i += 3)
    colours.push_back({s.palette[i], s.palette[i + 1], s.palette[i + 2]});
  ColorMapObject* map = GifMakeMapObject(int(colours.size()), colours.data());
  if (!map) std::abort();
  auto ok = [](int r) {
    if (r != GIF_OK) std::abort();
  };
  ok(EGifPutScreenDesc(g, s.screen_w, s.screen_h, 8, 0, s.local_palette ? nullptr : map));
  auto frame = [&](const std::vector<uint8_t>& px) {
    if (s.transparent >= 0) {
      const GifByteType gce[4] = {1, 10, 0, GifByteType(s.transparent)};
      ok(EGifPutExtension(g, GRAPHICS_EXT_FUNC_CODE, 4, gce));
    }
    ok(EGifPutImageDesc(g, s.left, s.top, s.frame_w, s.frame_h, s.interlace, s.local_palette ? map : nullptr));
    std::vector<GifPixelType> copy(px.begin(), px.end());
    static constexpr int kStart[4] = {0, 4, 2, 1}, kStep[4] = {8, 8, 4, 2};
    for (int pass = 0; pass < (s.interlace ? 4 : 1); ++pass)
      for (int y = s.interlace ? kStart[pass] : 0; y < s.frame_h; y += s.interlace ? kStep[pass] : 1)
        ok(EGifPutLine(g, copy.data() + size_t(y) * size_t(s.frame_w), s.frame_w));
  };
  frame(s.indices);
  if (!s.second.empty()) frame(s.second);
  ok(EGifCloseFile(g, &err));
  GifFreeMapObject(map);
  return out;
}

// Lossless WebP of RGB (channels 3) or RGBA (4) pixels.
inline std::vector<uint8_t> encode_webp_lossless(int w, int h, int channels, const std::vector<uint8_t>& px) {
  uint8_t* buf = nullptr;
  const size_t n = channels == 4 ? WebPEncodeLosslessRGBA(px.data(), w, h, w * 4, &buf)
                                 : WebPEncodeLosslessRGB(px.data(), w, h, w * 3, &buf);
  if (!n) std::abort();
  std::vector<uint8_t> out(buf, buf + n);
  WebPFree(buf);
  return out;
}

inline std::vector<uint8_t> encode_webp_lossy(int w, int h, const std::vector<uint8_t>& rgb, float quality) {
  uint8_t* buf = nullptr;
  const size_t n = WebPEncodeRGB(rgb.data(), w, h, w * 3, quality, &buf);
  if (!n) std::abort();
  std::vector<uint8_t> out(buf, buf + n);
  WebPFree(buf);
  return out;
}

inline void put_le(std::vector<uint8_t>& v, uint64_t x, int bytes) {
  for (int i = 0; i < bytes; ++i) v.push_back(uint8_t(x >> (8 * i)));
}

// An animated WebP built by hand (RIFF, VP8X, ANIM, one ANMF per frame) from still lossless files:
// frame i at offsets[i] (even numbers), sizes taken from the files.
struct WebpFrame {
  std::vector<uint8_t> still;  // a RIFF/VP8L file (encode_webp_lossless)
  int x = 0, y = 0, w = 0, h = 0;
};

inline std::vector<uint8_t> make_animated_webp(int canvas_w, int canvas_h, const std::vector<WebpFrame>& frames) {
  auto chunk = [](std::vector<uint8_t>& v, const char* id, const std::vector<uint8_t>& payload) {
    v.insert(v.end(), id, id + 4);
    put_le(v, payload.size(), 4);
    v.insert(v.end(), payload.begin(), payload.end());
    if (payload.size() & 1) v.push_back(0);
  };
  std::vector<uint8_t> body = {'W', 'E', 'B', 'P'}, vp8x, anim;
  vp8x.push_back(0x02 | 0x10);  // animation, alpha
  put_le(vp8x, 0, 3);
  put_le(vp8x, uint64_t(canvas_w - 1), 3);
  put_le(vp8x, uint64_t(canvas_h - 1), 3);
  chunk(body, "VP8X", vp8x);
  put_le(anim, 0, 4);  // background colour
  put_le(anim, 0, 2);  // loop forever
  chunk(body, "ANIM", anim);
  for (const WebpFrame& f : frames) {
    std::vector<uint8_t> anmf;
    put_le(anmf, uint64_t(f.x / 2), 3);
    put_le(anmf, uint64_t(f.y / 2), 3);
    put_le(anmf, uint64_t(f.w - 1), 3);
    put_le(anmf, uint64_t(f.h - 1), 3);
    put_le(anmf, 100, 3);                                          // duration
    anmf.push_back(0x02);                                          // no blending, no disposal
    anmf.insert(anmf.end(), f.still.begin() + 12, f.still.end());  // the file's chunks after RIFF....WEBP
    chunk(body, "ANMF", anmf);
  }
  std::vector<uint8_t> out = {'R', 'I', 'F', 'F'};
  put_le(out, body.size(), 4);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

// A BMP by hand. `rows_top_first`: the pixel rows as they appear on screen, already in the file's
// pixel format (bits per pixel, unpadded); `palette`: BGRX quads (BGR triples for header 12).
struct BmpSpec {
  int width = 0, height = 0, bits = 24;
  uint32_t header = 40, compression = 0;
  bool top_down = false;
  std::vector<uint8_t> palette;
  uint32_t colours_used = 0;
  std::vector<uint32_t> masks;  // 3 or 4, for BI_BITFIELDS
  std::vector<std::vector<uint8_t>> rows_top_first;
};

inline std::vector<uint8_t> make_bmp(const BmpSpec& s) {
  std::vector<uint8_t> info;
  if (s.header == 12) {
    put_le(info, 12, 4);
    put_le(info, uint64_t(s.width), 2);
    put_le(info, uint64_t(s.height), 2);
    put_le(info, 1, 2);
    put_le(info, uint64_t(s.bits), 2);
  } else {
    put_le(info, s.header, 4);
    put_le(info, uint64_t(uint32_t(s.width)), 4);
    put_le(info, uint64_t(uint32_t(s.top_down ? -s.height : s.height)), 4);
    put_le(info, 1, 2);
    put_le(info, uint64_t(s.bits), 2);
    put_le(info, s.compression, 4);
    put_le(info, 0, 4);  // image size
    put_le(info, 2835, 4), put_le(info, 2835, 4);
    put_le(info, s.colours_used, 4), put_le(info, 0, 4);
    if (s.header >= 52)
      for (size_t i = 0; i < 4 && info.size() < s.header; ++i) put_le(info, i < s.masks.size() ? s.masks[i] : 0, 4);
    while (info.size() < s.header) info.push_back(0);
  }
  std::vector<uint8_t> extra;  // the 40-byte header's masks
  if (s.header == 40 && s.compression == 3)
    for (size_t i = 0; i < 3; ++i) put_le(extra, s.masks[i], 4);
  const size_t stride = ((size_t(s.width) * size_t(s.bits) + 31) / 32) * 4;
  const size_t offset = 14 + info.size() + extra.size() + s.palette.size();
  std::vector<uint8_t> out = {'B', 'M'};
  put_le(out, offset + stride * size_t(s.height), 4);
  put_le(out, 0, 4);
  put_le(out, offset, 4);
  out.insert(out.end(), info.begin(), info.end());
  out.insert(out.end(), extra.begin(), extra.end());
  out.insert(out.end(), s.palette.begin(), s.palette.end());
  for (int i = 0; i < s.height; ++i) {
    const auto& r = s.rows_top_first[size_t(s.top_down ? i : s.height - 1 - i)];
    std::vector<uint8_t> padded(stride, 0);
    std::memcpy(padded.data(), r.data(), std::min(r.size(), stride));
    out.insert(out.end(), padded.begin(), padded.end());
  }
  return out;
}

// 24-bit bottom-up BMP of RGB pixels (Pillow's default BMP).
inline std::vector<uint8_t> encode_bmp_rgb(int w, int h, const std::vector<uint8_t>& rgb) {
  BmpSpec s;
  s.width = w, s.height = h, s.bits = 24;
  for (int y = 0; y < h; ++y) {
    std::vector<uint8_t> r;
    for (int x = 0; x < w; ++x)
      for (int c = 2; c >= 0; --c) r.push_back(rgb[(size_t(y) * size_t(w) + size_t(x)) * 3 + size_t(c)]);
    s.rows_top_first.push_back(r);
  }
  return make_bmp(s);
}

}  // namespace fovea::test
