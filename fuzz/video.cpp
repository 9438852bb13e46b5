// Fuzzes the container/codec entry point (src/video/decode-ffmpeg.cpp: FFmpeg's demuxers and
// decoders behind fovea's whitelist, memory reader and limits): any bytes give a clip or a
// fovea::Error naming it, never a crash, a hang or an unbounded allocation. Seeds: fuzz/corpus/video/
// (tiny H.264/MP4, VP9/WebM, MPEG-4/AVI clips, and a 34x18 H.264 one: widths libswscale converts
// only into padded rows; the hostile and honest clips of tests/hostile/clips.py: sample-table bombs,
// frame-size lies, one clip per container).
#include <cstdlib>
#include <string>

#include "fovea/error.h"
#include "fovea/threads.h"
#include "fovea/video.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fovea;
  video::VideoConfig cfg;
  cfg.min_pixels = 4096;
  cfg.max_pixels = 65536;
  cfg.max_frames = 8;
  // Sample tables up to the real limits (the default --max-video-seconds; the index is bounded by
  // kMaxIndexEntries whatever the length) and frames up to 4 MP, decoded on one thread: the decoder's
  // pool (DecoderCost::pictures: the pictures the stream holds and the one decoding, at most 33 for
  // H.264 and HEVC's 16 references and 16 reordered; about 1 GB in 16-bit 4:4:4) stays within the
  // fuzzer's memory limit (scripts/fuzz.sh: -rss_limit_mb=2048).
  video::VideoLimits lim;
  lim.max_frame_pixels = int64_t(1) << 22;
  lim.max_bytes_in_flight = int64_t(256) << 20;
  lim.deadline_seconds = 5;
  ThreadCap one(1);
  try {
    const video::Clip c = video::decode_clip({data, size}, "fuzz", cfg, lim);
    const auto& g = c.patches.grid;
    if (c.patches.pixels.size() != size_t(g[0]) * g[1] * g[2] * 1536) std::abort();
    if (int64_t(g[0]) * g[1] * g[2] * 256 > int64_t(cfg.max_pixels) * 2) std::abort();  // the budget holds
    if (c.timestamps.size() != size_t(g[0])) std::abort();
  } catch (const Error& e) {
    if (std::string(e.what()).find("video 'fuzz'") == std::string::npos) std::abort();
  }
  return 0;
}
