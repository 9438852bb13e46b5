// JPEG through libjpeg-turbo's libjpeg API (Debian's libjpeg62-turbo), the decoder family under
// Pillow, with Pillow's decoding parameters: JDCT_ISLOW, fancy upsampling, no scaling; grey is
// replicated; CMYK and YCCK are converted as Pillow does (its JpegImagePlugin reads every 4-component
// JPEG as "CMYK;I", inverted Adobe-style, and convert("RGB") is cmyk2rgb: r = nk - nk*c/255 with
// nk = 255 - k, rounded as its MULDIV255). Pillow refuses 2-component JPEGs; so does fovea.
//
// Errors: libjpeg's error_exit longjmps back here (never exit()). Warnings (libjpeg's "corrupt data"
// messages) are errors too, except the ones that describe metadata rather than pixels: junk bytes
// between markers (which some cameras write and every reader skips), an unknown JFIF revision or
// Adobe transform code, and a bad ICC marker (ignored: fovea reads no ICC). Pillow ignores every
// warning and decodes the damaged entropy data to garbage; fovea refuses it, so a client learns its
// file is damaged instead of getting tokens of a broken picture. A truncated file (libjpeg's
// "Premature end of JPEG file") is an error, as in Pillow by default ("image file is truncated"); so
// is a file that lacks only its EOI marker, since libjpeg reads ahead into where it should be.
//
// Hostile input: the pixel guard (decode.cpp) bounds the output before any pixel is decoded; a
// multi-scan (progressive) file's coefficient buffer is bounded the same way (decoder_bytes), and
// libjpeg's allocator is capped at that estimate plus 64 MiB; more than kMaxScans scans is refused
// (a scan bomb re-decodes the whole image per scan).
#include <algorithm>
#include <climits>
#include <csetjmp>
#include <cstdio>  // jpeglib.h uses FILE and size_t without including them
#include <memory>
#include <vector>

#include <jerror.h>
#include <jpeglib.h>

#include "image/decoders.h"

namespace fovea::image::detail {

namespace {

constexpr int kMaxScans = 500;  // TurboJPEG's own scan limit for untrusted input

struct Decoder {
  jpeg_decompress_struct cinfo{};
  jpeg_error_mgr err{};
  jpeg_progress_mgr progress{};
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 64] = {};
  bool truncated = false;
  ~Decoder() { jpeg_destroy_decompress(&cinfo); }  // a no-op on a struct never created
};

Decoder& decoder_of(j_common_ptr c) { return *static_cast<Decoder*>(c->client_data); }

[[noreturn]] void error_exit(j_common_ptr c) {
  Decoder& d = decoder_of(c);
  (*c->err->format_message)(c, d.message);
  std::longjmp(d.jump, 1);
}

// Warnings (msg_level -1) that describe metadata, not the pixels: skipped, as every reader does.
bool harmless_warning(int code) {
  return code == JWRN_EXTRANEOUS_DATA || code == JWRN_JFIF_MAJOR || code == JWRN_ADOBE_XFORM || code == JWRN_BOGUS_ICC;
}

void emit_message(j_common_ptr c, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  c->err->num_warnings++;
  if (harmless_warning(c->err->msg_code)) return;
  Decoder& d = decoder_of(c);
  d.truncated = c->err->msg_code == JWRN_JPEG_EOF;
  (*c->err->format_message)(c, d.message);
  std::longjmp(d.jump, 1);
}

void output_message(j_common_ptr) {}

void progress_monitor(j_common_ptr c) {
  const auto* dc = reinterpret_cast<j_decompress_ptr>(c);
  if (dc->input_scan_number > kMaxScans) {
    Decoder& d = decoder_of(c);
    std::snprintf(d.message, sizeof d.message, "more than %d scans (a progressive-scan bomb?)", kMaxScans);
    std::longjmp(d.jump, 1);
  }
}

// Runs `body` (libjpeg calls) under the error handler; false when libjpeg reported an error, with
// d.message set. `body` holds no objects with destructors across its libjpeg calls (longjmp skips
// them); the decoder itself is on the heap, owned by the caller.
template <class F>
bool run(Decoder& d, F&& body) {
  if (setjmp(d.jump)) return false;
  body();
  return true;
}

// Sets up the error manager, the memory source and the scan limit, then reads the header.
void open(Decoder& d, std::span<const uint8_t> b) {
  d.cinfo.err = jpeg_std_error(&d.err);
  d.err.error_exit = error_exit;
  d.err.emit_message = emit_message;
  d.err.output_message = output_message;
  d.cinfo.client_data = &d;
  jpeg_create_decompress(&d.cinfo);
  d.progress.progress_monitor = progress_monitor;
  d.cinfo.progress = &d.progress;
  jpeg_mem_src(&d.cinfo, b.data(), static_cast<unsigned long>(b.size()));
  jpeg_read_header(&d.cinfo, TRUE);
}

// Bytes of libjpeg's own buffers at peak, from the header (after jpeg_read_header). A multi-scan
// file holds every component's DCT coefficients (128 bytes per 8x8 block, whole image); a
// single-scan one a few rows of MCUs (context rows for fancy upsampling). Measured (peak RSS,
// decode.cpp) on 7680x4320 4:2:0: baseline within 1.5 MB of its RGB image, progressive ~100 MB
// above it (3 bytes/pixel), as this estimates.
int64_t decoder_bytes(const jpeg_decompress_struct& c) {
  int64_t coef = 0, rows = 0;
  for (int i = 0; i < c.num_components; ++i) {
    const jpeg_component_info& ci = c.comp_info[i];
    const int64_t bw = (int64_t(ci.width_in_blocks) + ci.h_samp_factor - 1) / ci.h_samp_factor * ci.h_samp_factor;
    const int64_t bh = (int64_t(ci.height_in_blocks) + ci.v_samp_factor - 1) / ci.v_samp_factor * ci.v_samp_factor;
    coef += bw * bh * int64_t(sizeof(JBLOCK));
    rows += bw * 8 * int64_t(ci.v_samp_factor) * 8 * 4;  // main + upsampling context rows, generously
  }
  const int64_t out_row = int64_t(c.image_width) * 4;
  return (jpeg_has_multiple_scans(const_cast<j_decompress_ptr>(&c)) ? coef : 0) + rows + out_row + (int64_t(1) << 20);
}

[[noreturn]] void fail_jpeg(const std::string& name, const Decoder& d) {
  corrupt(name, "JPEG", d.message, d.truncated);
}

// Pillow's MULDIV255: a * b / 255, rounded.
inline int muldiv255(int a, int b) {
  const int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

}  // namespace

ImageInfo probe_jpeg(std::span<const uint8_t> b, const std::string& name) {
  auto d = std::make_unique<Decoder>();
  ImageInfo info{name, ImageFormat::JPEG, 0, 0, 0};
  if (!run(*d, [&] {
        open(*d, b);
        info.width = int(d->cinfo.image_width);
        info.height = int(d->cinfo.image_height);
        info.decoder_bytes = decoder_bytes(d->cinfo);
      }))
    fail_jpeg(name, *d);
  const int n = d->cinfo.num_components;
  if (n != 1 && n != 3 && n != 4) fail("image '{}': a JPEG of {} components is not supported (1, 3 or 4)", name, n);
  return info;
}

Rgb8 decode_jpeg(std::span<const uint8_t> b, const ImageInfo& info) {
  Rgb8 out = blank_image(info);
  std::vector<JSAMPLE> row(size_t(info.width) * 4);  // grey and CMYK scanlines, before conversion
  auto d = std::make_unique<Decoder>();
  int components = 0;
  bool size_changed = false;
  if (!run(*d, [&] {
        open(*d, b);
        jpeg_decompress_struct& c = d->cinfo;
        components = c.num_components;
        if (int(c.image_width) != info.width || int(c.image_height) != info.height) {
          size_changed = true;
          return;
        }
        if (components == 1) {
          c.out_color_space = JCS_GRAYSCALE;
        } else if (components == 3) {
          c.out_color_space = JCS_RGB;
        } else if (components == 4) {
          c.out_color_space = JCS_CMYK;  // libjpeg converts YCCK to CMYK
        } else {
          return;
        }
        c.dct_method = JDCT_ISLOW;
        c.do_fancy_upsampling = TRUE;
        c.mem->max_memory_to_use = long(std::min<int64_t>(info.decoder_bytes + (int64_t(64) << 20), LONG_MAX));
        jpeg_start_decompress(&c);
        const size_t w = size_t(info.width);
        while (c.output_scanline < c.output_height) {
          uint8_t* dst = out.data.data() + size_t(c.output_scanline) * w * 3;
          JSAMPROW r = components == 3 ? dst : row.data();
          if (jpeg_read_scanlines(&c, &r, 1) != 1) break;  // cannot happen with a memory source
          if (components == 1) {
            for (size_t x = 0; x < w; ++x) dst[3 * x] = dst[3 * x + 1] = dst[3 * x + 2] = row[x];
          } else if (components == 4) {
            for (size_t x = 0; x < w; ++x) {
              const uint8_t* p = row.data() + 4 * x;  // Pillow's "CMYK;I": the stored values inverted
              const int nk = p[3];                    // 255 - (255 - k)
              for (int ch = 0; ch < 3; ++ch) {
                const int v = nk - muldiv255(255 - p[ch], nk);
                dst[3 * x + size_t(ch)] = uint8_t(v < 0 ? 0 : v > 255 ? 255 : v);
              }
            }
          }
        }
        // No jpeg_finish_decompress: whatever follows the last scan is not needed (the Decoder's
        // destructor releases libjpeg's memory).
      }))
    fail_jpeg(info.name, *d);
  if (size_changed) fail("image '{}': JPEG header changed between reads", info.name);
  if (components != 1 && components != 3 && components != 4)
    fail("image '{}': a JPEG of {} components is not supported (1, 3 or 4)", info.name, components);
  if (d->cinfo.output_scanline != d->cinfo.output_height)
    corrupt(info.name, "JPEG", "the decoder stopped before the last row", true);
  return out;
}

}  // namespace fovea::image::detail
