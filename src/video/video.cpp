// Video preprocessing around the decoder (docs/video.md): the config, frame sampling, smart_resize
// over frames, timestamps and patchify; what a clip's plan reserves (§What a clip reserves): the
// layout and pictures its stream's own headers declare (H.264/HEVC parameter sets, VP9, AV1); and a
// clip's decoding (decode_opened, decode_clip): the plan, the decoder's frames (decode_frames_at,
// video/decode.h: FFmpeg's side, decode-ffmpeg.cpp) resized as they come, patchify.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <iterator>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/threads.h"
#include "fovea/video.h"
#include "video/decode.h"

namespace fovea::video {

namespace {

image::PreprocessConfig as_image_config(const VideoConfig& c) {
  image::PreprocessConfig p;
  p.patch = c.patch;
  p.merge = c.merge;
  p.temporal = c.temporal;
  p.min_pixels = c.min_pixels;
  p.max_pixels = c.max_pixels;
  std::copy(c.mean, c.mean + 3, p.mean);
  std::copy(c.std, c.std + 3, p.std);
  return p;
}

}  // namespace

VideoConfig parse_video_config(std::string_view text, const std::string& where) {
  // The fields images share, read (and bounded) as an image config is; the budget's defaults are
  // the video processor's, so they are put back when the file does not give them.
  const nlohmann::json j = parse_json_bounded(text, qwen3vl::config_json_limits(), where);
  if (!j.is_object()) fail("{}: not a JSON object", where);
  const image::PreprocessConfig p = image::parse_preprocess_config(text, where);
  VideoConfig c;
  const bool has_min =
      (j.contains("size") && j["size"].is_object() && j["size"].contains("shortest_edge")) || j.contains("min_pixels");
  const bool has_max =
      (j.contains("size") && j["size"].is_object() && j["size"].contains("longest_edge")) || j.contains("max_pixels");
  c.patch = p.patch;
  c.merge = p.merge;
  c.temporal = p.temporal;
  if (has_min) c.min_pixels = p.min_pixels;
  if (has_max) c.max_pixels = p.max_pixels;
  if (c.max_pixels < c.min_pixels)
    fail("{}: the pixel budget's max {} is below its min {}", where, c.max_pixels, c.min_pixels);
  std::copy(p.mean, p.mean + 3, c.mean);
  std::copy(p.std, p.std + 3, c.std);
  auto integer = [&](const char* key, int64_t& dst, int64_t lo, int64_t hi) {
    if (!j.contains(key) || j.at(key).is_null()) return;
    const nlohmann::json& v = j.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail("{}: {} is {}; it must be an integer in {}..{}", where, key, quote_for_error(v), lo, hi);
    dst = v.get<int64_t>();
  };
  if (j.contains("fps") && !j.at("fps").is_null()) {
    const nlohmann::json& v = j.at("fps");
    const double f = v.is_number() ? v.get<double>() : std::nan("");
    if (!(f >= 0.01 && f <= 240)) fail("{}: fps is {}; it must be a number in [0.01, 240]", where, quote_for_error(v));
    c.fps = f;
  }
  integer("num_frames", c.num_frames, 1, kMaxFrames);
  integer("min_frames", c.min_frames, 1, kMaxFrames);
  integer("max_frames", c.max_frames, 1, kMaxFrames);
  if (c.max_frames < c.min_frames) fail("{}: max_frames {} is below min_frames {}", where, c.max_frames, c.min_frames);
  if (j.contains("do_sample_frames") && !j.at("do_sample_frames").is_null()) {
    if (!j.at("do_sample_frames").is_boolean()) fail("{}: do_sample_frames must be true or false", where);
    c.sample_frames = j.at("do_sample_frames").get<bool>();
  }
  return c;
}

VideoConfig load_video_config(const std::string& model, const VideoOverrides& o) {
  VideoConfig c;
  std::string where = "Qwen3VLVideoProcessor's defaults";
  if (const std::optional<std::string> path = image::model_folder_file(model, "video_preprocessor_config.json")) {
    c = parse_video_config(read_file(*path, "video preprocessor config", qwen3vl::config_json_limits().max_bytes),
                           *path);
    where = *path;
  }
  if (const auto mc = image::readable_model_config(model)) image::check_against_model(as_image_config(c), where, *mc);
  if (o.fps < 0 || (o.fps > 0 && !(o.fps >= 0.01 && o.fps <= 240))) fail("--video-fps {} is not in [0.01, 240]", o.fps);
  if (o.fps > 0) c.fps = o.fps;
  for (const auto& [v, flag] : {std::pair{o.min_pixels, "--video-min-pixels"}, {o.max_pixels, "--video-max-pixels"}})
    if (v < 0 || v > image::kMaxPixelBudget) fail("{} {} is not in 0..{}", flag, v, image::kMaxPixelBudget);
  if (o.min_pixels > 0) c.min_pixels = o.min_pixels;
  if (o.max_pixels > 0) c.max_pixels = o.max_pixels;
  if (c.max_pixels < c.min_pixels) fail("--video-max-pixels {} is below the min {}", c.max_pixels, c.min_pixels);
  if (o.max_frames < 0 || o.max_frames > kMaxFrames)
    fail("--video-max-frames {} is not in 0..{}", o.max_frames, kMaxFrames);
  if (o.max_frames > 0) {
    c.max_frames = o.max_frames;
    c.min_frames = std::min(c.min_frames, c.max_frames);
  }
  return c;
}

VideoLimits limits_from(const VideoOverrides& o) {
  VideoLimits l;
  if (o.max_seconds < 0 || std::isnan(o.max_seconds))
    fail("--max-video-seconds must be 0 (default) or positive, not {}", o.max_seconds);
  if (o.max_seconds > 0) l.max_seconds = o.max_seconds;
  return l;
}

std::vector<int64_t> linspace_indices(int64_t total, int64_t n) {
  if (total < 1 || n < 1) fail("frame sampling: {} frames of a clip of {}", n, total);
  std::vector<int64_t> idx(static_cast<size_t>(n));
  const double stop = double(total - 1);
  if (n == 1) return {0};
  const double step = stop / double(n - 1);
  // numpy: start + i * step, the last one exactly `stop`; .round() is half to even.
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = int64_t(std::nearbyint(i + 1 == n ? stop : double(i) * step));
  return idx;
}

std::vector<int64_t> sample_indices(int64_t total, double clip_fps, const VideoConfig& cfg) {
  if (total < 1) fail("the clip has no frames");
  int64_t n;
  if (!cfg.sample_frames) {
    n = total;
  } else if (cfg.num_frames > 0) {
    n = cfg.num_frames;
  } else {
    const double fps = clip_fps > 0 ? clip_fps : 24.0;
    n = int64_t(double(total) / fps * cfg.fps);  // Python's int(): toward zero
    n = std::min({std::max(n, cfg.min_frames), cfg.max_frames, total});
  }
  if (n > kMaxFrames) fail("{} frames to sample; the limit is {}", n, kMaxFrames);
  if (!cfg.sample_frames) {
    std::vector<int64_t> all(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) all[size_t(i)] = i;
    return all;
  }
  return linspace_indices(total, n);
}

std::pair<int, int> smart_resize_video(int64_t frames, int height, int width, const VideoConfig& cfg) {
  const int factor = cfg.patch * cfg.merge, tf = cfg.temporal;
  if (frames < tf) fail("{} frame(s): a clip needs at least temporal_patch_size = {}", frames, tf);
  if (height <= 0 || width <= 0) fail("frame size {}x{} is empty", width, height);
  const auto aspect_over = [](double h, double w, double limit) { return std::max(h, w) / std::min(h, w) > limit; };
  if (height < factor || width < factor) {  // scaled up to `factor` on its short side first (transformers' int())
    // A ratio past 201 fails below however int() rounds; refused first, the scaled side never overflows.
    if (aspect_over(height, width, 201)) fail("aspect ratio {}x{} is over 200:1", width, height);
    const double s = std::max(double(factor) / height, double(factor) / width);
    height = int(height * s);
    width = int(width * s);
  }
  if (aspect_over(height, width, 200)) fail("aspect ratio {}x{} is over 200:1", width, height);
  int64_t h = int64_t(std::nearbyint(double(height) / factor)) * factor;
  int64_t w = int64_t(std::nearbyint(double(width) / factor)) * factor;
  const int64_t t = int64_t(std::nearbyint(double(frames) / tf)) * tf;
  if (t * h * w > cfg.max_pixels) {
    const double beta = std::sqrt(double(frames) * height * width / double(cfg.max_pixels));
    h = std::max<int64_t>(factor, int64_t(std::floor(height / beta / factor)) * factor);
    w = std::max<int64_t>(factor, int64_t(std::floor(width / beta / factor)) * factor);
  } else if (t * h * w < cfg.min_pixels) {
    const double beta = std::sqrt(double(cfg.min_pixels) / (double(frames) * height * width));
    h = int64_t(std::ceil(height * beta / factor)) * factor;
    w = int64_t(std::ceil(width * beta / factor)) * factor;
  }
  return {int(h), int(w)};
}

std::vector<double> patch_timestamps(const std::vector<int64_t>& indices, double clip_fps, int temporal) {
  const double fps = clip_fps > 0 ? clip_fps : 24.0;
  std::vector<int64_t> idx = indices;
  while (!idx.empty() && idx.size() % size_t(temporal)) idx.push_back(idx.back());
  std::vector<double> ts;
  for (size_t k = 0; k < idx.size(); k += size_t(temporal)) {
    // transformers: (t[first] + t[last]) / 2 of each patch, t = index / fps.
    ts.push_back((double(idx[k]) / fps + double(idx[k + size_t(temporal) - 1]) / fps) / 2);
  }
  return ts;
}

// ---- what a stream's headers say of its decoder's pictures (stream_layout) -------------------------

namespace {

// The bits of a NAL unit's payload (after its header), emulation-prevention bytes (00 00 03) dropped,
// read MSB first. Reading past the end gives zeros and marks the reader bad.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> payload) {
    int zeros = 0;
    for (const uint8_t b : payload) {
      if (zeros >= 2 && b == 3) {
        zeros = 0;
        continue;
      }
      bytes_.push_back(b);
      zeros = b == 0 ? zeros + 1 : 0;
    }
  }
  uint32_t u(int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; ++i) {
      if (pos_ >= bytes_.size() * 8) {
        bad_ = true;
        return 0;
      }
      v = v << 1 | ((bytes_[pos_ / 8] >> (7 - pos_ % 8)) & 1);
      ++pos_;
    }
    return v;
  }
  uint32_t ue() {  // Exp-Golomb
    int zeros = 0;
    while (!bad_ && u(1) == 0)
      if (++zeros > 31) bad_ = true;
    return bad_ ? 0 : uint32_t((uint64_t(1) << zeros) - 1 + u(zeros));
  }
  int32_t se() {
    const uint32_t k = ue();
    return k & 1 ? int32_t((k + 1) / 2) : -int32_t(k / 2);
  }
  bool bad() const { return bad_; }
  void fail() { bad_ = true; }

 private:
  std::vector<uint8_t> bytes_;
  size_t pos_ = 0;
  bool bad_ = false;
};

uint32_t be16(const uint8_t* p) { return uint32_t(p[0]) << 8 | p[1]; }

// Calls take(nal) for each NAL unit of an Annex B stream (start codes) or of a stream of
// `length_size`-byte big-endian lengths, until take returns true.
template <class Take>
bool each_nal(std::span<const uint8_t> b, int length_size, Take&& take) {
  const bool annex_b =
      b.size() >= 3 && b[0] == 0 && b[1] == 0 && (b[2] == 1 || (b.size() >= 4 && b[2] == 0 && b[3] == 1));
  if (annex_b) {
    size_t at = 0, start = 0;
    bool open = false;
    for (; at + 3 <= b.size(); ++at) {
      if (b[at] != 0 || b[at + 1] != 0 || b[at + 2] != 1) continue;
      if (open && take(b.subspan(start, at - start))) return true;
      start = at + 3;
      open = true;
    }
    return open && take(b.subspan(start));
  }
  for (size_t at = 0; at + size_t(length_size) <= b.size();) {
    uint64_t n = 0;
    for (int i = 0; i < length_size; ++i) n = n << 8 | b[at + size_t(i)];
    at += size_t(length_size);
    if (n > b.size() - at) return false;
    if (take(b.subspan(at, size_t(n)))) return true;
    at += size_t(n);
  }
  return false;
}

// The NAL units an avcC or hvcC record lists: each a 16-bit length and the unit.
template <class Take>
bool each_record_nal(std::span<const uint8_t> b, bool hevc, Take&& take) {
  size_t at = hevc ? 23 : 6;
  const size_t arrays = hevc ? (b.size() > 22 ? b[22] : 0) : 2;  // avcC: its SPS, then its PPS
  for (size_t a = 0; a < arrays && at <= b.size(); ++a) {
    size_t count;
    if (hevc) {
      if (at + 3 > b.size()) return false;
      count = be16(b.data() + at + 1);
      at += 3;
    } else {
      if (at + 1 > b.size()) return false;
      count = a == 0 ? b[at - 1] & 0x1F : b[at];
      if (a == 1) ++at;
    }
    for (size_t i = 0; i < count; ++i) {
      if (at + 2 > b.size() || be16(b.data() + at) > b.size() - at - 2) return false;
      if (take(b.subspan(at + 2, be16(b.data() + at)))) return true;
      at += 2 + be16(b.data() + at);
    }
  }
  return false;
}

// The first sequence parameter set's payload (after its NAL header): in the extradata (an avcC or
// hvcC record, or Annex B), else in the packets (Annex B, or the record's length prefixes).
std::optional<std::vector<uint8_t>> find_sps(std::span<const uint8_t> extra, std::span<const uint8_t> packets,
                                             bool hevc) {
  std::optional<std::vector<uint8_t>> sps;
  const size_t header = hevc ? 2 : 1;
  const auto take = [&](std::span<const uint8_t> nal) {
    if (nal.size() <= header || (hevc ? (nal[0] >> 1) & 0x3F : nal[0] & 0x1F) != (hevc ? 33 : 7)) return false;
    // A parameter set takes well under 4 KiB (scaling lists and HRD included): no more is copied,
    // whatever a hostile unit's length.
    sps.emplace(nal.begin() + ptrdiff_t(header), nal.begin() + ptrdiff_t(std::min<size_t>(nal.size(), header + 4096)));
    return true;
  };
  const bool record = !extra.empty() && extra[0] == 1 && extra.size() >= (hevc ? 23u : 7u);
  int length_size = 4;
  if (record) {
    length_size = (extra[hevc ? 21 : 4] & 3) + 1;
    if (each_record_nal(extra, hevc, take)) return sps;
  } else if (each_nal(extra, 4, take)) {
    return sps;
  }
  each_nal(packets, length_size, take);
  return sps;
}

// FFmpeg's reorder depth for an H.264 stream whose SPS has no bitstream_restriction: the DPB of its
// level (MaxDpbMbs, H.264 Table A-1) over the picture's macroblocks, at most 15; 15 for levels past 5.2.
int h264_level_reorder(uint32_t level, uint64_t mbs) {
  static constexpr std::pair<uint32_t, uint64_t> kMaxDpbMbs[] = {
      {10, 396},   {11, 900},   {12, 2376},  {13, 2376},  {20, 2376},  {21, 4752},   {22, 8100},   {30, 8100},
      {31, 18000}, {32, 20480}, {40, 32768}, {41, 32768}, {42, 34816}, {50, 110400}, {51, 184320}, {52, 184320}};
  for (const auto& [l, dpb] : kMaxDpbMbs)
    if (l == level) return int(std::min<uint64_t>(15, dpb / std::max<uint64_t>(1, mbs)));
  return 15;
}

void skip_hrd(BitReader& r) {
  const uint32_t count = r.ue() + 1;
  if (count > 32) return r.fail();
  r.u(8);
  for (uint32_t i = 0; i < count; ++i) {
    r.ue();
    r.ue();
    r.u(1);
  }
  r.u(20);
}

// H.264 VUI: the bitstream restriction's reorder depth and DPB size, where it has one (else -1).
std::pair<int, int> h264_vui(BitReader& r) {
  if (r.u(1) && r.u(8) == 255) r.u(32);     // aspect ratio, extended SAR
  if (r.u(1)) r.u(1);                       // overscan
  if (r.u(1) && (r.u(4), r.u(1))) r.u(24);  // video signal type, colour description
  if (r.u(1)) {                             // chroma sample location
    r.ue();
    r.ue();
  }
  if (r.u(1)) r.u(65);  // timing info
  const bool nal = r.u(1);
  if (nal) skip_hrd(r);
  const bool vcl = r.u(1);
  if (vcl) skip_hrd(r);
  if (nal || vcl) r.u(1);  // low delay
  r.u(1);                  // pic struct
  if (!r.u(1)) return {-1, -1};
  r.u(1);
  for (int i = 0; i < 4; ++i) r.ue();
  const int reorder = int(std::min<uint32_t>(r.ue(), 16));
  return {reorder, int(std::min<uint32_t>(r.ue(), 16))};
}

std::optional<StreamLayout> h264_layout(BitReader r) {
  static constexpr uint32_t kHigh[] = {100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135};
  const uint32_t profile = r.u(8);
  r.u(8);
  const uint32_t level = r.u(8);
  r.ue();
  uint32_t chroma = 1, depth = 0;
  if (std::find(std::begin(kHigh), std::end(kHigh), profile) != std::end(kHigh)) {
    chroma = r.ue();
    if (chroma == 3) r.u(1);
    depth = r.ue();
    depth = std::max(depth, r.ue());
    r.u(1);
    if (r.u(1))  // scaling matrices: each list present is skipped through its deltas
      for (int i = 0; i < (chroma == 3 ? 12 : 8); ++i)
        if (r.u(1))
          for (int64_t j = 0, next = 8, last = 8; j < (i < 6 ? 16 : 64) && !r.bad(); ++j) {
            if (next != 0) next = ((last + r.se()) % 256 + 256) % 256;
            last = next == 0 ? last : next;
          }
  }
  r.ue();  // log2_max_frame_num
  const uint32_t poc = r.ue();
  if (poc == 0) r.ue();
  if (poc == 1) {
    r.u(1);
    r.se();
    r.se();
    const uint32_t cycle = r.ue();
    for (uint32_t i = 0; i < std::min<uint32_t>(cycle, 256); ++i) r.se();
  }
  const uint32_t refs = r.ue();
  r.u(1);
  const uint64_t mb_width = uint64_t(r.ue()) + 1, map_height = uint64_t(r.ue()) + 1;
  const bool frames_only = r.u(1);
  if (!frames_only) r.u(1);
  r.u(1);
  if (r.u(1))
    for (int i = 0; i < 4; ++i) r.ue();
  const auto [reorder, dpb] = r.u(1) ? h264_vui(r) : std::pair{-1, -1};
  if (r.bad() || chroma > 3 || depth > 6 || refs > 16) return std::nullopt;
  StreamLayout l;
  l.chroma = std::max<int>(1, int(chroma));
  l.sample_bytes = depth > 0 ? 2 : 1;
  l.refs = std::max<int>(int(refs), dpb);
  // Without a bitstream restriction FFmpeg takes the level's depth, except for intra-only streams
  // (no reference frames), which it does not reorder.
  l.reorder = reorder >= 0 ? reorder
              : refs == 0  ? 0
                           : h264_level_reorder(level, mb_width * map_height * (frames_only ? 1 : 2));
  l.from_header = true;
  return l;
}

std::optional<StreamLayout> hevc_layout(BitReader r) {
  r.u(4);
  const uint32_t sub_layers = r.u(3);
  r.u(1);
  r.u(96);  // general profile, tier and level
  uint32_t profile_present = 0, level_present = 0;
  for (uint32_t i = 0; i < sub_layers; ++i) {
    profile_present |= r.u(1) << i;
    level_present |= r.u(1) << i;
  }
  if (sub_layers > 0) r.u(2 * (8 - int(sub_layers)));
  for (uint32_t i = 0; i < sub_layers; ++i)
    r.u(((profile_present >> i) & 1 ? 88 : 0) + ((level_present >> i) & 1 ? 8 : 0));
  r.ue();
  const uint32_t chroma = r.ue();
  if (chroma == 3) r.u(1);
  r.ue();
  r.ue();
  if (r.u(1))
    for (int i = 0; i < 4; ++i) r.ue();
  uint32_t depth = r.ue();
  depth = std::max(depth, r.ue());
  r.ue();
  uint32_t dpb = 0, reorder = 0;
  for (uint32_t i = r.u(1) ? 0 : sub_layers; i <= sub_layers; ++i) {
    dpb = std::max(dpb, r.ue() + 1);
    reorder = std::max(reorder, r.ue());
    r.ue();
  }
  if (r.bad() || chroma > 3 || depth > 8 || dpb > 16 || reorder > 16) return std::nullopt;
  StreamLayout l;
  l.chroma = std::max<int>(1, int(chroma));
  l.sample_bytes = depth > 0 ? 2 : 1;
  l.refs = int(dpb);
  l.reorder = int(reorder);
  l.from_header = true;
  return l;
}

// VP9: the profile in the first frame's first byte (frame marker 0b10, then the profile's low and
// high bits): 0 is 8-bit 4:2:0, 1 8-bit 4:2:2 to 4:4:4, 2 10/12-bit 4:2:0, 3 10/12-bit 4:4:4.
std::optional<StreamLayout> vp9_layout(std::span<const uint8_t> packets) {
  if (packets.empty() || packets[0] >> 6 != 2) return std::nullopt;
  const int profile = ((packets[0] >> 5) & 1) | ((packets[0] >> 3) & 2);
  StreamLayout l;
  l.chroma = profile & 1 ? 3 : 1;
  l.sample_bytes = profile >= 2 ? 2 : 1;
  l.refs = 8;
  l.from_header = true;
  return l;
}

// AV1: av1C's third byte: high_bitdepth, twelve_bit, monochrome, chroma_subsampling_x and _y.
std::optional<StreamLayout> av1_layout(std::span<const uint8_t> extra) {
  if (extra.size() < 4 || extra[0] != 0x81) return std::nullopt;
  const uint8_t b = extra[2];
  StreamLayout l;
  l.sample_bytes = b & 0x40 ? 2 : 1;
  l.chroma = !(b & 0x08) ? 3 : !(b & 0x04) ? 2 : 1;
  l.refs = 8;
  l.from_header = true;
  return l;
}

}  // namespace

// The layout a header gives, else the codec's most; then the codec's own memory per pixel (per
// picture, per thread), measured on FFmpeg 5.1 (docs/video.md §What a clip reserves) and rounded up.
StreamLayout stream_layout(std::string_view codec, std::span<const uint8_t> extra, std::span<const uint8_t> packets) {
  const auto with = [](StreamLayout l, double side, double thread) {
    l.side_per_pixel = side;
    l.thread_per_pixel = thread;
    return l;
  };
  if (codec == "h264" || codec == "hevc") {
    const bool hevc = codec == "hevc";
    std::optional<StreamLayout> l;
    if (const auto sps = find_sps(extra, packets, hevc))
      l = hevc ? hevc_layout(BitReader(*sps)) : h264_layout(BitReader(*sps));
    return hevc ? with(l.value_or(StreamLayout{3, 2, 16, 16, false}), 0.8, 0.5)
                : with(l.value_or(StreamLayout{3, 2, 16, 16, false}), 0.6, 0.3);
  }
  if (codec == "vp9") return with(vp9_layout(packets).value_or(StreamLayout{3, 2, 8, 0, false}), 0.25, 0.25);
  if (codec == "av1")
    return with(av1_layout(extra).value_or(StreamLayout{3, 2, 8, 0, false}), 1, 1);  // libdav1d's own pool
  if (codec == "vp8") return with({1, 1, 4, 0, true}, 0.1, 0.1);  // last, golden, altref and the previous frame
  if (codec == "mpeg4" || codec == "h263" || codec == "mpeg1video") return with({1, 1, 2, 0, true}, 0.6, 0.25);
  if (codec == "theora") return with({3, 1, 2, 0, false}, 0.1, 3.5);  // up to 4:4:4; coefficient tables per thread
  if (codec == "mjpeg") return with({3, 1, 0, 0, false}, 0, 0.25);
  return with({3, 1, 2, 0, false}, 0.6, 0.25);  // MPEG-2: up to 4:4:4, two references
}

namespace {

// The most threads, from `threads` down to 1, whose decoder holds at most half of `limit`.
int threads_within(const DecoderCost& d, int threads, int64_t limit) {
  int t = std::clamp(threads, 1, 16);
  while (t > 1 && d.bytes(t) > limit / 2) --t;
  return t;
}

}  // namespace

int64_t ClipPlan::frame_bytes() const {
  const int64_t n = int64_t(indices.size()), natives = batch == 1 ? 1 : std::min(n, 2 * batch);  // see Resizer
  return resized_bytes + patch_bytes + convert_bytes + natives * native_frame_bytes +
         std::min(n, batch) * resize_pass_bytes;
}

ClipPlan plan_clip(const ClipInfo& info, const VideoConfig& cfg, const VideoLimits& limits, int threads) {
  ClipPlan p;
  p.indices = sample_indices(info.frames, info.fps, cfg);
  std::tie(p.height, p.width) = smart_resize_video(int64_t(p.indices.size()), info.height, info.width, cfg);
  const int64_t frames = int64_t(p.indices.size()), padded = (frames + cfg.temporal - 1) / cfg.temporal;
  p.grid = {int(padded), p.height / cfg.patch, p.width / cfg.patch};
  p.timestamps = patch_timestamps(p.indices, info.fps, cfg.temporal);
  p.resized_bytes = frames * p.height * p.width * 3;
  p.patch_bytes = padded * cfg.temporal * p.height * p.width * 3 * int64_t(sizeof(float));
  p.native_frame_bytes = int64_t(info.width) * info.height * 3;
  // resize_bicubic's horizontal pass (source rows at the resized width), held while a frame resizes.
  const bool resized = p.height != info.height || p.width != info.width;
  p.resize_pass_bytes = resized ? int64_t(info.height) * p.width * 3 : 0;
  // Rows of a width libswscale cannot pack: converted into padded rows first (decode-ffmpeg.cpp).
  p.convert_bytes = info.width % 16 ? ((int64_t(info.width) * 3 + 63) / 64 * 64 + 64) * info.height : 0;
  p.packet_bytes = info.packet_bytes;
  // decode_opened's copy of the pts (8 bytes a packet), its flags of the frames sampled (1), and the
  // allocator's share of the packets sent to the decoder (up to 15 measured, 200,000 packets).
  p.sampling_bytes = 24 * info.frames;
  p.decoder = info.decoder;
  p.threads = threads_within(p.decoder, threads, limits.max_bytes_in_flight);
  const int64_t room = limits.max_bytes_in_flight - p.resized_bytes - p.patch_bytes - p.convert_bytes;
  p.batch = std::max<int64_t>(0, std::min<int64_t>(p.threads, room / (2 * p.native_frame_bytes + p.resize_pass_bytes)));
  return p;
}

image::Patches patchify_frames(const std::vector<image::Rgb8>& frames, const VideoConfig& cfg) {
  if (frames.empty()) fail("patchify: no frames");
  const int P = cfg.patch, M = cfg.merge, T = cfg.temporal;
  const int H = frames[0].height, W = frames[0].width;
  for (const image::Rgb8& f : frames)
    if (f.height != H || f.width != W) fail("patchify: frames of {}x{} and {}x{}", W, H, f.width, f.height);
  if (H % (P * M) || W % (P * M)) fail("patchify: frame {}x{} is not a multiple of {} on each side", W, H, P * M);
  const int64_t gt = (int64_t(frames.size()) + T - 1) / T, gh = H / P, gw = W / P;
  const size_t row = size_t(3) * T * P * P, plane = size_t(gh) * gw;
  image::Patches out;
  out.grid = {int(gt), int(gh), int(gw)};
  out.pixels.resize(size_t(gt) * plane * row);
  parallel_for(gt, [&](int64_t t0) {
    size_t r = size_t(t0) * plane;
    for (int bh = 0; bh < gh / M; ++bh)
      for (int bw = 0; bw < gw / M; ++bw)
        for (int mh = 0; mh < M; ++mh)
          for (int mw = 0; mw < M; ++mw, ++r) {
            const int y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
            float* dst = out.pixels.data() + r * row;
            for (int c = 0; c < 3; ++c)
              for (int t = 0; t < T; ++t) {
                const image::Rgb8& f =
                    frames[std::min(frames.size() - 1, size_t(t0 * T + t))];  // the last one repeated
                for (int py = 0; py < P; ++py)
                  for (int px = 0; px < P; ++px)
                    dst[((c * T + t) * P + py) * P + px] =
                        (float(f.data[(size_t(y0 + py) * W + x0 + px) * 3 + c]) - cfg.mean[c] * 255.0f) /
                        (cfg.std[c] * 255.0f);
              }
          }
  });
  return out;
}

Clip preprocess_frames(const std::vector<image::Rgb8>& frames, const std::vector<int64_t>& indices, double clip_fps,
                       const VideoConfig& cfg) {
  if (frames.empty() || frames.size() != indices.size())
    fail("preprocess: {} frames for {} indices", frames.size(), indices.size());
  const Clock::time_point t0 = Clock::now();
  const std::pair<int, int> size = smart_resize_video(int64_t(frames.size()), frames[0].height, frames[0].width, cfg);
  const int h = size.first, w = size.second;  // (clang 14 cannot capture structured bindings)
  std::vector<image::Rgb8> sized(frames.size());
  parallel_for(int64_t(frames.size()), [&](int64_t i) {
    const image::Rgb8& f = frames[size_t(i)];
    sized[size_t(i)] = f.height == h && f.width == w ? f : image::resize_bicubic(f, h, w);
  });
  Clip c;
  c.indices = indices;
  c.timestamps = patch_timestamps(indices, clip_fps, cfg.temporal);
  c.patches = patchify_frames(sized, cfg);
  c.info.width = frames[0].width;
  c.info.height = frames[0].height;
  c.info.fps = clip_fps;
  c.preprocess_ms = ms_since(t0);
  return c;
}

bool looks_like_video(std::span<const uint8_t> b) {
  auto at = [&](size_t off, const char* magic) {
    const size_t n = std::strlen(magic);
    return b.size() >= off + n && std::memcmp(b.data() + off, magic, n) == 0;
  };
  return at(4, "ftyp") || at(4, "moov") || at(4, "mdat") || at(4, "free") || at(4, "wide") ||  // ISO BMFF / QuickTime
         at(0, "\x1A\x45\xDF\xA3") ||                                                          // Matroska / WebM (EBML)
         (at(0, "RIFF") && at(8, "AVI ")) || at(0, "FLV") || at(0, "OggS") ||
         (b.size() >= 377 && b[0] == 0x47 && b[188] == 0x47 && b[376] == 0x47);  // MPEG-TS
}

int decoding_threads() { return std::clamp(ThreadCap::current(), 1, 16); }

Clock::time_point deadline_of(const VideoLimits& l) {
  return Clock::now() + from_seconds(std::max(0.0, l.deadline_seconds));
}

// ---- a clip's decoding: the plan, the decoder's frames resized as they come, patchify --------------

namespace {

// Resizes batches of decoded frames on other threads while the next batch decodes (see decode_opened).
// Batches of one frame are resized at once on this thread instead: one native frame held, not two
// (the decoder then has one thread, for the memory its frames take or the share of the cores it has).
class Resizer {
 public:
  Resizer(size_t frames, int h, int w, int64_t batch) : sized_(frames), h_(h), w_(w), batch_(batch) {}
  ~Resizer() {
    if (resizing_.valid()) resizing_.wait();  // it writes into sized_
  }
  void add(size_t j, image::Rgb8&& f) {
    if (batch_ == 1) {
      sized_[j] = f.height != h_ || f.width != w_ ? image::resize_bicubic(f, h_, w_) : std::move(f);
      return;
    }
    pending_.frames.push_back(std::move(f));
    pending_.at.push_back(j);
    if (int64_t(pending_.frames.size()) >= batch_) flush();
  }
  std::vector<image::Rgb8> finish() {
    flush();
    flush();  // the last batch's resize
    return std::move(sized_);
  }

 private:
  void flush() {
    if (resizing_.valid()) resizing_.get();
    if (pending_.frames.empty()) return;
    // The resize thread keeps the caller's share of the cores (ThreadCap is per thread).
    resizing_ = std::async(std::launch::async, [this, cap = ThreadCap::current(), b = std::move(pending_)]() mutable {
      ThreadCap capped(cap);
      // Resized in place, then placed one by one: a batch may name a frame twice (a pass that gave
      // up on pts placement hands its frames over again), and two threads must never write one slot.
      parallel_for(int64_t(b.frames.size()), [&](int64_t i) {
        image::Rgb8& f = b.frames[size_t(i)];
        if (f.height != h_ || f.width != w_) f = image::resize_bicubic(f, h_, w_);
      });
      for (size_t i = 0; i < b.frames.size(); ++i) sized_[b.at[i]] = std::move(b.frames[i]);
    });
    pending_ = {};
  }
  struct Batch {
    std::vector<image::Rgb8> frames;
    std::vector<size_t> at;
  };
  std::vector<image::Rgb8> sized_;
  const int h_, w_;
  const int64_t batch_;
  Batch pending_;
  std::future<void> resizing_;  // the previous batch's resize
};

}  // namespace

Clip decode_opened(const OpenedClip& clip, const VideoConfig& cfg, const VideoLimits& limits,
                   Clock::time_point deadline) {
  const auto t0 = Clock::now();
  const std::string& name = clip.info.name;
  Clip c;
  c.info = clip.info;
  try {
    const ClipPlan plan = plan_clip(c.info, cfg, limits);
    c.indices = plan.indices;
    // Decoding (this thread, and FFmpeg's frame threads) and resizing (the cores) overlap: each batch
    // of decoded frames is resized on the other threads while the next batch decodes. Memory: the
    // resized frames, the patches, and two batches of native frames (one resizing, one filling).
    if (plan.batch < 1)
      fail("{} frames resized to {}x{} with frames of {}x{} decoding need more than the limit of {} bytes",
           c.indices.size(), plan.width, plan.height, c.info.width, c.info.height, limits.max_bytes_in_flight);
    Resizer resizer(c.indices.size(), plan.height, plan.width, plan.batch);
    c.frames_decoded = decode_frames_at(clip, c.indices, plan.threads, deadline,
                                        [&](size_t j, image::Rgb8&& f) { resizer.add(j, std::move(f)); });
    const Clock::time_point decoded_at = Clock::now();
    const std::vector<image::Rgb8> sized = resizer.finish();
    c.timestamps = plan.timestamps;
    c.patches = patchify_frames(sized, cfg);
    // Resizing overlaps decoding, so the stages are wall time: decode_ms until the last frame is
    // decoded (the resizes that ran meanwhile included), preprocess_ms after it (the last resizes and
    // patchify).
    c.decode_ms = ms_between(t0, decoded_at);
    c.preprocess_ms = ms_since(decoded_at);
  } catch (const Error& e) {
    if (std::string_view(e.what()).starts_with("video '")) throw;
    fail("video '{}': {}", name, e.what());
  }
  return c;
}

Clip decode_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoConfig& cfg,
                 const VideoLimits& limits, const image::PreprocessConfig& budget) {
  const auto t0 = Clock::now();
  const Clock::time_point deadline = deadline_of(limits);
  const OpenedClip clip = open_clip(bytes, name, limits, budget, deadline);
  const double open_ms = ms_since(t0);
  Clip c = decode_opened(clip, cfg, limits, deadline);
  c.decode_ms += open_ms;
  return c;
}

}  // namespace fovea::video
