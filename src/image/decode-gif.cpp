// GIF through giflib 5 (Debian's libgif-dev): the first frame only, read with the low-level API
// (DGifSlurp would read every frame of an animation into memory), on its canvas as Pillow 11's
// GifImagePlugin composes frame 0:
//   - the canvas is the logical screen, grown to hold the frame if the frame reaches past it;
//   - it is filled with the frame's transparent index if its graphic control extension sets one,
//     else with index 0 (not the background colour), then the frame's pixels are written, the
//     transparent ones included, and convert("RGB") maps indices through the palette: a transparent
//     pixel takes its palette colour (measured on tests/data/processor/images/transparent-70x50.gif);
//   - the palette is the frame's local one, else the global one; with neither, or one that is the
//     identity grey ramp (Pillow then reads the frame as "L"), an index is its own grey level;
//     an index past a palette's end is black.
// Every giflib error and a file that ends before the frame's last row is an error.
#include <algorithm>
#include <cstring>
#include <vector>

#include <gif_lib.h>
#include "image/decoders.h"

namespace fovea::image::detail {

namespace {

struct Source {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
  bool ended = false;  // a read asked for more than was left
};

int read_bytes(GifFileType* g, GifByteType* out, int n) {
  auto* s = static_cast<Source*>(g->UserData);
  const size_t want = n > 0 ? size_t(n) : 0, k = std::min(want, s->bytes.size() - s->pos);
  if (k < want) s->ended = true;
  std::memcpy(out, s->bytes.data() + s->pos, k);
  s->pos += k;
  return int(k);
}

struct Gif {
  Source src;
  GifFileType* file = nullptr;
  ~Gif() {
    int err = 0;
    if (file) DGifCloseFile(file, &err);
  }
};

// The first frame's descriptor and what Pillow paints under it.
struct Frame {
  int canvas_w = 0, canvas_h = 0;
  int left = 0, top = 0, width = 0, height = 0;
  bool interlaced = false;
  int transparent = -1;  // from the last graphic control extension before the frame that sets one
};

[[noreturn]] void gif_error(const Gif& g, const std::string& name, int code) {
  const char* what = GifErrorString(code);
  corrupt(name, "GIF", what ? what : "giflib error", g.src.ended || code == D_GIF_ERR_EOF_TOO_SOON);
}

// Opens the GIF and reads up to (and including) the first image descriptor.
Frame open_first_frame(Gif& g, std::span<const uint8_t> b, const std::string& name) {
  g.src.bytes = b;
  int err = 0;
  g.file = DGifOpen(&g.src, read_bytes, &err);
  if (!g.file) gif_error(g, name, err);
  Frame f;
  for (;;) {
    GifRecordType type = UNDEFINED_RECORD_TYPE;
    if (DGifGetRecordType(g.file, &type) == GIF_ERROR) gif_error(g, name, g.file->Error);
    if (type == IMAGE_DESC_RECORD_TYPE) break;
    if (type == TERMINATE_RECORD_TYPE) corrupt(name, "GIF", "no image before the trailer");
    if (type != EXTENSION_RECORD_TYPE) corrupt(name, "GIF", "unexpected record");
    int code = 0;
    GifByteType* ext = nullptr;
    if (DGifGetExtension(g.file, &code, &ext) == GIF_ERROR) gif_error(g, name, g.file->Error);
    // Pillow reads flags and the index from the first sub-block: ext[0] is its length.
    if (code == GRAPHICS_EXT_FUNC_CODE && ext && ext[0] >= 4 && (ext[1] & 1)) f.transparent = ext[4];
    while (ext)
      if (DGifGetExtensionNext(g.file, &ext) == GIF_ERROR) gif_error(g, name, g.file->Error);
  }
  if (DGifGetImageDesc(g.file) == GIF_ERROR) gif_error(g, name, g.file->Error);
  const GifImageDesc& d = g.file->Image;
  f.left = d.Left, f.top = d.Top, f.width = d.Width, f.height = d.Height, f.interlaced = d.Interlace;
  if (f.left < 0 || f.top < 0 || f.width < 0 || f.height < 0) corrupt(name, "GIF", "negative frame geometry");
  f.canvas_w = std::max(g.file->SWidth, f.left + f.width);  // all four are 16-bit: no overflow
  f.canvas_h = std::max(g.file->SHeight, f.top + f.height);
  return f;
}

}  // namespace

ImageInfo probe_gif(std::span<const uint8_t> b, const std::string& name) {
  Gif g;
  const Frame f = open_first_frame(g, b, name);
  // giflib's own state is a few KB (LZW tables); fovea adds one frame line.
  return ImageInfo{name, ImageFormat::GIF, f.canvas_w, f.canvas_h, int64_t(f.width) + (int64_t(1) << 20)};
}

Rgb8 decode_gif(std::span<const uint8_t> b, const ImageInfo& info) {
  Gif g;
  const Frame f = open_first_frame(g, b, info.name);
  if (f.canvas_w != info.width || f.canvas_h != info.height)
    fail("image '{}': GIF header changed between reads", info.name);
  // The palette as 256 RGB entries.
  uint8_t table[256 * 3] = {};
  const ColorMapObject* map = g.file->Image.ColorMap ? g.file->Image.ColorMap : g.file->SColorMap;
  const int colours = map ? std::clamp(map->ColorCount, 0, 256) : 0;
  bool ramp = true;
  for (int i = 0; i < colours; ++i) {
    const GifColorType& c = map->Colors[i];
    ramp = ramp && c.Red == i && c.Green == i && c.Blue == i;
  }
  if (!map || ramp) {
    for (int i = 0; i < 256; ++i) table[3 * i] = table[3 * i + 1] = table[3 * i + 2] = uint8_t(i);
  } else {
    for (int i = 0; i < colours; ++i) {
      table[3 * i] = map->Colors[i].Red;
      table[3 * i + 1] = map->Colors[i].Green;
      table[3 * i + 2] = map->Colors[i].Blue;
    }
  }
  Rgb8 out = blank_image(info);
  const size_t cw = size_t(f.canvas_w);
  const uint8_t* fill = table + 3 * size_t(f.transparent >= 0 ? f.transparent : 0);
  for (size_t i = 0; i < out.data.size(); i += 3) std::memcpy(out.data.data() + i, fill, 3);
  if (f.width == 0 || f.height == 0) return out;
  std::vector<GifPixelType> line(size_t(f.width));
  // Rows in file order: Adam-style passes for an interlaced frame.
  static constexpr int kStart[4] = {0, 4, 2, 1}, kStep[4] = {8, 8, 4, 2};
  const int passes = f.interlaced ? 4 : 1;
  for (int pass = 0; pass < passes; ++pass)
    for (int y = f.interlaced ? kStart[pass] : 0; y < f.height; y += f.interlaced ? kStep[pass] : 1) {
      if (DGifGetLine(g.file, line.data(), f.width) == GIF_ERROR) gif_error(g, info.name, g.file->Error);
      uint8_t* dst = out.data.data() + (size_t(f.top + y) * cw + size_t(f.left)) * 3;
      for (int x = 0; x < f.width; ++x) std::memcpy(dst + 3 * size_t(x), table + 3 * size_t(line[size_t(x)]), 3);
    }
  return out;
}

}  // namespace fovea::image::detail
