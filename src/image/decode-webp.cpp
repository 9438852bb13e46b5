// WebP through libwebp (Debian's libwebp-dev), decoded straight to RGB with the default options
// (fancy upsampling, no dithering), as Pillow's WebPImagePlugin gets it from WebPAnimDecoder (which
// Pillow 11 uses for every WebP file: default options, RGBA not premultiplied, alpha then dropped by
// convert("RGB")).
//
// Animated WebP: the first frame, decoded via libwebpdemux and placed on the canvas as WebPAnimDecoder
// (and so Pillow) places frame 1: the canvas is transparent black, (0, 0, 0) once alpha is dropped,
// the frame is written at its offset with no blending (frame 1 is always a key frame). fovea decodes
// it into the canvas in place rather than through WebPAnimDecoder, which would hold two RGBA canvases.
// Every libwebp status but OK is an error; NOT_ENOUGH_DATA is reported as truncated.
#include <vector>

#include <webp/decode.h>
#include <webp/demux.h>

#include "image/decoders.h"

namespace fovea::image::detail {

namespace {

const char* status_text(VP8StatusCode s) {
  switch (s) {
    case VP8_STATUS_OK: return "ok";
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "not enough data";
  }
  return "unknown status";
}

[[noreturn]] void webp_error(const std::string& name, VP8StatusCode s) {
  corrupt(name, "WebP", status_text(s), s == VP8_STATUS_NOT_ENOUGH_DATA);
}

struct Demux {
  WebPDemuxer* d = nullptr;
  WebPIterator it{};
  bool have_frame = false;
  ~Demux() {
    if (have_frame) WebPDemuxReleaseIterator(&it);
    WebPDemuxDelete(d);
  }
};

// Decodes one bitstream (a still file, or an animation frame's fragment) as RGB into `dst`, rows
// `stride` bytes apart, `size` bytes available from dst on; its size must be (w, h).
void decode_into(std::span<const uint8_t> bitstream, uint8_t* dst, size_t stride, size_t size, int w, int h,
                 const std::string& name) {
  WebPDecoderConfig config;
  if (!WebPInitDecoderConfig(&config)) fail("image '{}': libwebp version mismatch", name);
  VP8StatusCode s = WebPGetFeatures(bitstream.data(), bitstream.size(), &config.input);
  if (s != VP8_STATUS_OK) webp_error(name, s);
  if (config.input.width != w || config.input.height != h)
    corrupt(name, "WebP",
            fmt::format("the bitstream is {}x{}, its frame {}x{}", config.input.width, config.input.height, w, h));
  config.output.colorspace = MODE_RGB;
  config.output.is_external_memory = 1;
  config.output.u.RGBA.rgba = dst;
  config.output.u.RGBA.stride = int(stride);
  config.output.u.RGBA.size = size;
  s = WebPDecode(bitstream.data(), bitstream.size(), &config);
  WebPFreeDecBuffer(&config.output);  // external memory: frees nothing of ours
  if (s != VP8_STATUS_OK) webp_error(name, s);
}

}  // namespace

ImageInfo probe_webp(std::span<const uint8_t> b, const std::string& name) {
  WebPBitstreamFeatures f;
  const VP8StatusCode s = WebPGetFeatures(b.data(), b.size(), &f);
  if (s != VP8_STATUS_OK) webp_error(name, s);
  // libwebp's buffers at peak (from libwebp 1.2's source; checked by peak RSS, decode.cpp): a
  // lossy frame decodes a few macroblock rows at a time (~128 bytes per column); its alpha plane and
  // a lossless image are held whole, 4 bytes per pixel (ARGB) + 1 (alpha plane). An animation's
  // first frame is at most the canvas.
  const int64_t px = int64_t(f.width) * f.height, cols = int64_t(f.width) * 128 + (int64_t(1) << 20);
  const bool lossy_opaque = f.format == 1 && !f.has_alpha && !f.has_animation;
  return ImageInfo{name, ImageFormat::WEBP, f.width, f.height, cols + (lossy_opaque ? 0 : 5 * px)};
}

Rgb8 decode_webp(std::span<const uint8_t> b, const ImageInfo& info) {
  WebPBitstreamFeatures f;
  const VP8StatusCode s = WebPGetFeatures(b.data(), b.size(), &f);
  if (s != VP8_STATUS_OK) webp_error(info.name, s);
  if (f.width != info.width || f.height != info.height)
    fail("image '{}': WebP header changed between reads", info.name);
  Rgb8 out = blank_image(info);  // (0, 0, 0): an animation's transparent-black canvas
  const size_t stride = size_t(info.width) * 3;
  if (!f.has_animation) {
    decode_into(b, out.data.data(), stride, out.data.size(), info.width, info.height, info.name);
    return out;
  }
  Demux dm;
  const WebPData data{b.data(), b.size()};
  dm.d = WebPDemux(&data);
  if (!dm.d) corrupt(info.name, "WebP", "cannot parse the animation's chunks (corrupt or truncated)");
  if (int(WebPDemuxGetI(dm.d, WEBP_FF_CANVAS_WIDTH)) != info.width ||
      int(WebPDemuxGetI(dm.d, WEBP_FF_CANVAS_HEIGHT)) != info.height)
    corrupt(info.name, "WebP", "the animation's canvas differs from its header");
  dm.have_frame = WebPDemuxGetFrame(dm.d, 1, &dm.it);
  if (!dm.have_frame) corrupt(info.name, "WebP", "the animation has no frame");
  const WebPIterator& it = dm.it;
  if (it.x_offset < 0 || it.y_offset < 0 || it.width <= 0 || it.height <= 0 || it.x_offset > info.width - it.width ||
      it.y_offset > info.height - it.height)
    corrupt(info.name, "WebP",
            fmt::format("frame 1 ({}x{} at {},{}) is outside the {}x{} canvas", it.width, it.height, it.x_offset,
                        it.y_offset, info.width, info.height));
  const size_t offset = size_t(it.y_offset) * stride + size_t(it.x_offset) * 3;
  decode_into({it.fragment.bytes, it.fragment.size}, out.data.data() + offset, stride, out.data.size() - offset,
              it.width, it.height, info.name);
  return out;
}

}  // namespace fovea::image::detail
