// BMP: fovea's own decoder (no Debian library reads BMP on its own), for the uncompressed layouts
// Pillow's BmpImagePlugin reads, with its conventions:
//   - headers of 12 (OS/2 1.x, 16-bit sizes, 3-byte palette entries), 40, 52, 56, 64, 108 and 124 bytes;
//   - 1, 4 and 8 bit palette images: the palette follows the header, biClrUsed entries (0: 2^bits);
//     an index past it is black, unless the palette is the identity grey ramp (Pillow reads that as
//     "L"), when every index is its own grey level; if bfOffBits points at the palette itself (a
//     writer's bug Pillow tolerates), the pixels start after it;
//   - 16 bit 5-5-5 (BI_RGB, or BI_BITFIELDS 7C00/3E0/1F) and 5-6-5 (BI_BITFIELDS F800/7E0/1F), each
//     field scaled as v * 255 / max in integers (Pillow's BGR;15 / BGR;16 unpackers);
//   - 24 bit BGR; 32 bit BI_RGB as BGRX (the fourth byte ignored), BI_BITFIELDS with the 8 masks
//     Pillow lists (alpha dropped);
//   - rows bottom-up, or top-down for a negative height; each row padded to 4 bytes.
// Refused with a message naming the reason: RLE4/RLE8 (Pillow decodes them; fovea does not yet),
// embedded JPEG/PNG, other masks, other bit depths, other header sizes. Every size and offset is
// checked in 64-bit arithmetic against the file's length before a byte is read: a truncated file
// is an error (as in Pillow).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "image/decoders.h"

namespace fovea::image::detail {

namespace {

constexpr uint32_t kRgb = 0, kRle8 = 1, kRle4 = 2, kBitfields = 3, kJpeg = 4, kPng = 5;

uint32_t le16(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8; }
uint32_t le32(const uint8_t* p) { return le16(p) | le16(p + 2) << 16; }

// What the headers say, all checked.
struct Layout {
  int width = 0, height = 0;
  bool top_down = false;
  int bits = 0;
  uint32_t compression = kRgb;
  int64_t offset = 0, stride = 0;       // the first pixel row (as stored) and the bytes per row
  std::array<int, 3> byte_of{2, 1, 0};  // 24/32 bit: which byte of a pixel holds R, G, B
  bool rgb565 = false;                  // 16 bit: 5-6-5, else 5-5-5
  std::array<uint8_t, 256 * 3> palette{};
};

Layout read_layout(std::span<const uint8_t> b, const std::string& name) {
  auto need = [&](int64_t end, const char* what) {
    if (end > int64_t(b.size())) corrupt(name, "BMP", fmt::format("the file ends inside its {}", what), true);
  };
  need(18, "file header");
  if (b[0] != 'B' || b[1] != 'M') corrupt(name, "BMP", "bad signature");
  const int64_t header = le32(b.data() + 14);
  if (header != 12 && header != 40 && header != 52 && header != 56 && header != 64 && header != 108 && header != 124)
    fail("image '{}': BMP header size {} is not supported (12, 40, 52, 56, 64, 108 or 124)", name, header);
  need(14 + header, "info header");
  const uint8_t* h = b.data() + 18;  // after the header's size field
  Layout L;
  int64_t width = 0, height = 0, colours = 0, entry = 4;
  uint32_t masks[4] = {0, 0, 0, 0};
  int64_t after = 14 + header;  // where the palette (or the 40-byte header's masks) starts
  if (header == 12) {
    width = le16(h), height = le16(h + 2), L.bits = int(le16(h + 6));
    entry = 3;
  } else {
    width = int32_t(le32(h));
    const int32_t hh = int32_t(le32(h + 4));
    L.top_down = hh < 0;
    height = L.top_down ? -int64_t(hh) : hh;
    L.bits = int(le16(h + 10));
    L.compression = le32(h + 12);
    colours = le32(h + 28);
    if (L.compression == kBitfields) {
      if (header >= 52) {
        for (int i = 0; i < 3; ++i) masks[i] = le32(h + 36 + 4 * i);
        if (header >= 56) masks[3] = le32(h + 48);
      } else {
        need(after + 12, "colour masks");
        for (int i = 0; i < 3; ++i) masks[i] = le32(b.data() + after + 4 * i);
        after += 12;
      }
    }
  }
  if (width <= 0 || height <= 0 || width > INT32_MAX || height > INT32_MAX)
    fail("image '{}': invalid BMP size {}x{}", name, width, height);
  L.width = int(width), L.height = int(height);
  switch (L.compression) {
    case kRgb:
      if (L.bits != 1 && L.bits != 4 && L.bits != 8 && L.bits != 16 && L.bits != 24 && L.bits != 32)
        fail("image '{}': BMP of {} bits per pixel is not supported", name, L.bits);
      break;
    case kBitfields: {
      const auto rgb = [&](uint32_t r, uint32_t g, uint32_t bl) {
        return masks[0] == r && masks[1] == g && masks[2] == bl;
      };
      bool ok = false;
      if (L.bits == 32) {
        // Pillow's table: (R, G, B, A) masks -> the bytes holding R, G, B.
        struct Known {
          uint32_t m[4];
          std::array<int, 3> bytes;
        };
        static constexpr Known kKnown[] = {
            {{0xFF0000, 0xFF00, 0xFF, 0}, {2, 1, 0}},          {{0xFF000000, 0xFF0000, 0xFF00, 0}, {3, 2, 1}},
            {{0xFF000000, 0xFF00, 0xFF, 0}, {3, 1, 0}},        {{0xFF000000, 0xFF0000, 0xFF00, 0xFF}, {3, 2, 1}},
            {{0xFF, 0xFF00, 0xFF0000, 0xFF000000}, {0, 1, 2}}, {{0xFF0000, 0xFF00, 0xFF, 0xFF000000}, {2, 1, 0}},
            {{0xFF000000, 0xFF00, 0xFF, 0xFF0000}, {3, 1, 0}}, {{0, 0, 0, 0}, {2, 1, 0}}};
        for (const Known& k : kKnown)
          if (std::memcmp(k.m, masks, sizeof masks) == 0) L.byte_of = k.bytes, ok = true;
      } else if (L.bits == 24) {
        ok = rgb(0xFF0000, 0xFF00, 0xFF);
      } else if (L.bits == 16) {
        L.rgb565 = rgb(0xF800, 0x7E0, 0x1F);
        ok = L.rgb565 || rgb(0x7C00, 0x3E0, 0x1F);
      }
      if (!ok)
        fail("image '{}': BMP bit fields {:#x}/{:#x}/{:#x}/{:#x} at {} bits are not supported", name, masks[0],
             masks[1], masks[2], masks[3], L.bits);
      break;
    }
    case kRle8:
    case kRle4: fail("image '{}': RLE-compressed BMP is not supported (save it uncompressed or as PNG)", name);
    case kJpeg:
    case kPng:
      fail("image '{}': a BMP holding a {} stream is not supported", name, L.compression == kJpeg ? "JPEG" : "PNG");
    default: fail("image '{}': BMP compression {} is not supported", name, L.compression);
  }
  // The palette: entries of 4 bytes (3 for the 12-byte header), the first 256 of them used.
  if (L.bits <= 8) {
    if (colours == 0) colours = int64_t(1) << L.bits;
    if (colours > 65536) fail("image '{}': BMP palette of {} colours", name, colours);
    const int64_t used = std::min<int64_t>(colours, 256);
    need(after + used * entry, "palette");
    bool ramp = true;
    for (int64_t i = 0; i < used; ++i) {
      const uint8_t* e = b.data() + after + i * entry;  // B, G, R
      L.palette[size_t(3 * i)] = e[2], L.palette[size_t(3 * i + 1)] = e[1], L.palette[size_t(3 * i + 2)] = e[0];
      const int want = colours == 2 ? int(i) * 255 : int(i);
      ramp = ramp && e[0] == want && e[1] == want && e[2] == want;
    }
    if (ramp && colours != 2)  // Pillow's "L": the index is the grey level, past the palette too
      for (int i = 0; i < 256; ++i)
        L.palette[size_t(3 * i)] = L.palette[size_t(3 * i + 1)] = L.palette[size_t(3 * i + 2)] = uint8_t(i);
  }
  L.offset = le32(b.data() + 10);
  const int64_t palette_bytes = L.bits <= 8 ? colours * entry : 0;
  if (L.offset == 0)
    L.offset = after + palette_bytes;  // Pillow: "offset or fp.tell()"
  else if (L.offset == 14 + header && L.bits <= 8)
    L.offset += palette_bytes;                            // Pillow's tolerance
  L.stride = ((width * L.bits + 31) >> 3) & ~int64_t(3);  // < 2^31 * 32 / 8: no overflow in 64 bits
  return L;
}

}  // namespace

ImageInfo probe_bmp(std::span<const uint8_t> b, const std::string& name) {
  const Layout L = read_layout(b, name);
  return ImageInfo{name, ImageFormat::BMP, L.width, L.height, int64_t(sizeof(Layout))};
}

Rgb8 decode_bmp(std::span<const uint8_t> b, const ImageInfo& info) {
  const Layout L = read_layout(b, info.name);
  if (L.width != info.width || L.height != info.height) fail("image '{}': BMP header changed between reads", info.name);
  // stride * height <= 2^33 * 2^31: fits in 64 bits; compared with what the file holds.
  if (L.offset > int64_t(b.size()) || L.stride * L.height > int64_t(b.size()) - L.offset)
    corrupt(info.name, "BMP",
            fmt::format("{} rows of {} bytes from offset {} need {} bytes; the file has {}", L.height, L.stride,
                        L.offset, L.offset + L.stride * L.height, b.size()),
            true);
  Rgb8 out = blank_image(info);
  const size_t w = size_t(L.width);
  for (int64_t r = 0; r < L.height; ++r) {
    const uint8_t* s = b.data() + L.offset + r * L.stride;
    uint8_t* d = out.data.data() + size_t(L.top_down ? r : L.height - 1 - r) * w * 3;
    switch (L.bits) {
      case 1:
      case 4:
      case 8: {
        const int per_byte = 8 / L.bits, mask = (1 << L.bits) - 1;
        for (size_t x = 0; x < w; ++x) {
          const int shift = 8 - L.bits * (int(x % size_t(per_byte)) + 1);  // most significant first
          const int index = (s[x / size_t(per_byte)] >> shift) & mask;
          std::memcpy(d + 3 * x, L.palette.data() + 3 * size_t(index), 3);
        }
        break;
      }
      case 16:
        for (size_t x = 0; x < w; ++x) {
          const uint32_t v = le16(s + 2 * x);
          if (L.rgb565) {
            d[3 * x] = uint8_t(((v >> 11) & 31) * 255 / 31);
            d[3 * x + 1] = uint8_t(((v >> 5) & 63) * 255 / 63);
          } else {
            d[3 * x] = uint8_t(((v >> 10) & 31) * 255 / 31);
            d[3 * x + 1] = uint8_t(((v >> 5) & 31) * 255 / 31);
          }
          d[3 * x + 2] = uint8_t((v & 31) * 255 / 31);
        }
        break;
      case 24:
      case 32: {
        const size_t bpp = size_t(L.bits / 8);
        for (size_t x = 0; x < w; ++x)
          for (size_t c = 0; c < 3; ++c) d[3 * x + c] = s[bpp * x + size_t(L.byte_of[c])];
        break;
      }
    }
  }
  return out;
}

}  // namespace fovea::image::detail
