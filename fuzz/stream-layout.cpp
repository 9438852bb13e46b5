// Fuzzes what a stream's own headers say of its decoder's pictures (video::stream_layout in
// src/video/video.cpp: H.264 and HEVC sequence parameter sets in avcC/hvcC records, Annex B or
// length-prefixed packets; VP9's first byte; AV1's av1C), which sizes the decoder's pool before FFmpeg
// sees the stream: any bytes give a layout within the codec's most (what the codec gives without a
// header), never a crash or an out-of-bounds read. Needs no FFmpeg.
// Input: byte 0 picks the codec (bit 2 clear: h264, hevc, vp9, av1 by its low two bits; set: one of
// the codecs of fixed layout, or an unknown name, by its high bits), bytes 1-2 (big-endian) the
// extradata's length (cut to what follows), then the extradata, then the packets (back to back).
// Seeds: fuzz/corpus/stream-layout/ (x264, x265, libvpx-vp9 and libaom streams of testsrc2: 4:2:0,
// 4:2:2, 4:4:4 and monochrome, 8 to 12 bits, 0 to 16 references, interlaced, intra-only, cropped,
// temporal sub-layers; records, records without parameter sets, Annex B).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>
#include <vector>

#include "fovea/video.h"

namespace {

constexpr std::string_view kParsed[] = {"h264", "hevc", "vp9", "av1"};
constexpr std::string_view kFixed[] = {"vp8",    "mpeg4", "h263",       "mpeg1video",
                                       "theora", "mjpeg", "mpeg2video", "rawvideo"};

bool same(const fovea::video::StreamLayout& a, const fovea::video::StreamLayout& b) {
  return a.chroma == b.chroma && a.sample_bytes == b.sample_bytes && a.refs == b.refs && a.reorder == b.reorder &&
         a.from_header == b.from_header && a.side_per_pixel == b.side_per_pixel &&
         a.thread_per_pixel == b.thread_per_pixel;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fovea::video;
  if (size < 3) return 0;
  const bool parsed = !(data[0] & 4);
  const std::string_view codec = parsed ? kParsed[data[0] & 3] : kFixed[(data[0] >> 3) % std::size(kFixed)];
  const size_t extra_size = std::min<size_t>(size_t(data[1]) << 8 | data[2], size - 3);
  // Each part in an allocation of its own size, so that reading past the extradata is caught too.
  const std::vector<uint8_t> extra(data + 3, data + 3 + extra_size), packets(data + 3 + extra_size, data + size);

  const StreamLayout l = stream_layout(codec, extra, packets);
  const StreamLayout most = stream_layout(codec, {}, {});  // the codec's most: no header at all
  if (l.chroma < 1 || l.chroma > 3) std::abort();
  if (l.sample_bytes != 1 && l.sample_bytes != 2) std::abort();
  if (l.refs < 0 || l.refs > 16 || l.reorder < 0 || l.reorder > 16) std::abort();
  if (!std::isfinite(l.side_per_pixel) || l.side_per_pixel < 0) std::abort();
  if (!std::isfinite(l.thread_per_pixel) || l.thread_per_pixel < 0) std::abort();
  // The codec's own memory per pixel is the codec's, whatever its headers say.
  if (l.side_per_pixel != most.side_per_pixel || l.thread_per_pixel != most.thread_per_pixel) std::abort();
  // A header only ever lowers what is reserved: each field within what the codec takes without one.
  if (l.chroma > most.chroma || l.sample_bytes > most.sample_bytes || l.refs > most.refs || l.reorder > most.reorder)
    std::abort();
  // Without a header the layout is the codec's most, and the codecs of fixed layout read no bytes.
  if ((!l.from_header || !parsed) && !same(l, most)) std::abort();
  if (parsed && most.from_header) std::abort();
  // VP9 and AV1 keep their 8 reference slots and reorder nothing (frames are shown as decoded).
  if ((codec == "vp9" || codec == "av1") && (l.refs != 8 || l.reorder != 0)) std::abort();
  // An HEVC parameter set's DPB holds at least the picture being decoded.
  if (codec == "hevc" && l.from_header && l.refs < 1) std::abort();
  // The same bytes give the same layout (nothing is kept between calls).
  if (!same(l, stream_layout(codec, extra, packets))) std::abort();
  return 0;
}
