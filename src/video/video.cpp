// Video preprocessing without the decoder (docs/video.md): the config, frame sampling, smart_resize
// over frames, timestamps and patchify.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/threads.h"
#include "fovea/video.h"

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
  const bool has_min = (j.contains("size") && j["size"].is_object() && j["size"].contains("shortest_edge")) || j.contains("min_pixels");
  const bool has_max = (j.contains("size") && j["size"].is_object() && j["size"].contains("longest_edge")) || j.contains("max_pixels");
  c.patch = p.patch;
  c.merge = p.merge;
  c.temporal = p.temporal;
  if (has_min) c.min_pixels = p.min_pixels;
  if (has_max) c.max_pixels = p.max_pixels;
  if (c.max_pixels < c.min_pixels) fail("{}: the pixel budget's max {} is below its min {}", where, c.max_pixels, c.min_pixels);
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
    c = parse_video_config(read_file(*path, "video preprocessor config", qwen3vl::config_json_limits().max_bytes), *path);
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
  if (o.max_frames < 0 || o.max_frames > kMaxFrames) fail("--video-max-frames {} is not in 0..{}", o.max_frames, kMaxFrames);
  if (o.max_frames > 0) {
    c.max_frames = o.max_frames;
    c.min_frames = std::min(c.min_frames, c.max_frames);
  }
  return c;
}

VideoLimits limits_from(const VideoOverrides& o) {
  VideoLimits l;
  if (o.max_seconds < 0 || std::isnan(o.max_seconds)) fail("--max-video-seconds must be 0 (default) or positive, not {}", o.max_seconds);
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

ClipPlan plan_clip(const ClipInfo& info, const VideoConfig& cfg) {
  ClipPlan p;
  p.indices = sample_indices(info.frames, info.fps, cfg);
  std::tie(p.height, p.width) = smart_resize_video(int64_t(p.indices.size()), info.height, info.width, cfg);
  const int64_t frames = int64_t(p.indices.size()), padded = (frames + cfg.temporal - 1) / cfg.temporal;
  p.grid = {int(padded), p.height / cfg.patch, p.width / cfg.patch};
  p.timestamps = patch_timestamps(p.indices, info.fps, cfg.temporal);
  p.resized_bytes = frames * p.height * p.width * 3;
  p.patch_bytes = padded * cfg.temporal * p.height * p.width * 3 * int64_t(sizeof(float));
  p.native_frame_bytes = int64_t(info.width) * info.height * 3;
  p.packet_bytes = info.packet_bytes;
  p.decoder_frame_bytes = info.decoder_frame_bytes;
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
                const image::Rgb8& f = frames[std::min(frames.size() - 1, size_t(t0 * T + t))];  // the last one repeated
                for (int py = 0; py < P; ++py)
                  for (int px = 0; px < P; ++px)
                    dst[((c * T + t) * P + py) * P + px] =
                        (float(f.data[(size_t(y0 + py) * W + x0 + px) * 3 + c]) - cfg.mean[c] * 255.0f) / (cfg.std[c] * 255.0f);
              }
          }
  });
  return out;
}

Clip preprocess_frames(const std::vector<image::Rgb8>& frames, const std::vector<int64_t>& indices, double clip_fps,
                       const VideoConfig& cfg) {
  if (frames.empty() || frames.size() != indices.size()) fail("preprocess: {} frames for {} indices", frames.size(), indices.size());
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
         at(0, "\x1A\x45\xDF\xA3") ||                                                       // Matroska / WebM (EBML)
         (at(0, "RIFF") && at(8, "AVI ")) || at(0, "FLV") || at(0, "OggS") ||
         (b.size() >= 377 && b[0] == 0x47 && b[188] == 0x47 && b[376] == 0x47);              // MPEG-TS
}

int decoding_threads() { return std::clamp(ThreadCap::current(), 1, 16); }

Clock::time_point deadline_of(const VideoLimits& l) { return Clock::now() + from_seconds(std::max(0.0, l.deadline_seconds)); }

Clip decode_clip_file(const std::string& path, const VideoConfig& cfg, const VideoLimits& limits,
                      const image::PreprocessConfig& image_budget) {
  const std::string bytes = read_file(path, "video", limits.max_encoded_bytes);
  return decode_clip({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, path, cfg, limits, image_budget);
}

}  // namespace fovea::video
