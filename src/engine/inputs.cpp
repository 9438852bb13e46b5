// The input steps of fovea/pipeline.h: what an input is (image or clip), its plan from its header,
// and decode + preprocess of a list of inputs.
#include <algorithm>
#include <array>
#include <fstream>
#include <random>

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"

namespace fovea {

const char* input_kind_name(InputKind k) { return k == InputKind::VIDEO ? "video" : "image"; }

InputKind input_kind(std::span<const uint8_t> head) {
  return video::looks_like_video(head) ? InputKind::VIDEO : InputKind::IMAGE;
}

InputKind file_input_kind(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::array<char, 512> head{};
  f.read(head.data(), head.size());
  return input_kind({reinterpret_cast<const uint8_t*>(head.data()), size_t(f.gcount())});
}

InputConfig load_input_config(const std::string& model, const image::PreprocessOverrides& image,
                              const video::VideoOverrides& video) {
  return {image::load_preprocess_config(model, image), video::load_video_config(model, video), video::limits_from(video)};
}

size_t max_input_bytes(const InputConfig& cfg) { return std::max(image::kMaxEncodedImageBytes, cfg.limits.max_encoded_bytes); }

std::vector<uint8_t> read_input(const std::string& path, const InputConfig& cfg) {
  const std::string s = read_file(path, "input", max_input_bytes(cfg));
  return {s.begin(), s.end()};
}

namespace {
int64_t tokens_of(const qwen3vl::GridThw& g, int merge) { return int64_t(g[0]) * g[1] * g[2] / (int64_t(merge) * merge); }
}  // namespace

int64_t visual_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g) { return tokens_of(g, c.merge); }

namespace {

InputPlan plan_image(std::span<const uint8_t> bytes, const std::string& name, const InputConfig& cfg) {
  const image::ImageInfo info = image::probe(bytes, name, cfg.image);
  InputPlan p;
  p.grid = image::resized_grid(info.height, info.width, cfg.image);
  p.tokens = tokens_of(p.grid, cfg.image.merge);
  p.peak_bytes = image::decode_peak_bytes(info, cfg.image);
  return p;
}

InputPlan plan_clip(const video::ClipInfo& info, const InputConfig& cfg) {
  const video::ClipPlan plan = video::plan_clip(info, cfg.video);
  InputPlan p;
  p.kind = InputKind::VIDEO;
  p.grid = plan.grid;
  p.tokens = tokens_of(p.grid, cfg.video.merge);
  // Frames beyond the in-flight bound wait for room: decoding never holds more than that.
  p.peak_bytes = std::min(plan.peak_bytes(hardware_threads()), cfg.limits.max_bytes_in_flight);
  p.clip = ClipSampling{plan.indices, plan.timestamps, info.fps};
  return p;
}

// The limits of one clip's decode: its deadline no later than the caller's.
video::VideoLimits clip_limits(const InputConfig& cfg, const PrepareHooks& hooks) {
  video::VideoLimits lim = cfg.limits;
  if (hooks.deadline) {
    const double left = seconds_between(Clock::now(), *hooks.deadline);
    lim.deadline_seconds = std::min(lim.deadline_seconds, std::max(1e-3, left));
  }
  return lim;
}

// Runs step on p, keeping what it throws as p's error.
template <class F>
void guarded(PreparedInput& p, F&& step) {
  try {
    step();
  } catch (...) {
    p.patches = {};
    p.error = std::current_exception();
  }
}

}  // namespace

InputPlan probe_input(std::span<const uint8_t> bytes, const std::string& name, const InputConfig& cfg) {
  if (input_kind(bytes) == InputKind::IMAGE) return plan_image(bytes, name, cfg);
  return plan_clip(video::probe_clip(bytes, name, cfg.limits, cfg.image), cfg);
}

std::string PreparedInput::error_message() const {
  if (!error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

PreparedInput prepare_image(const image::Rgb8& img, const InputConfig& cfg) {
  PreparedInput p;
  const auto t = Clock::now();
  p.patches = image::preprocess(img, cfg.image, /*raw=*/true);
  p.preprocess_ms = ms_since(t);
  return p;
}

PreparedInput prepare_clip(video::Clip&& clip) {
  PreparedInput p;
  p.kind = InputKind::VIDEO;
  p.patches = std::move(clip.patches);
  p.clip = ClipSampling{std::move(clip.indices), std::move(clip.timestamps), clip.info.fps};
  p.decode_ms = clip.decode_ms;
  p.preprocess_ms = clip.preprocess_ms;
  p.frames_decoded = clip.frames_decoded;
  return p;
}

std::vector<PreparedInput> prepare_inputs(const std::vector<std::string>& names,
                                          const std::function<std::vector<uint8_t>(size_t)>& bytes,
                                          const InputConfig& cfg, const PrepareHooks& hooks) {
  const size_t n = names.size();
  std::vector<PreparedInput> out(n);
  std::vector<std::vector<uint8_t>> clips(n);  // a clip's bytes, held for the second pass
  // Images: read, plan, decode and preprocess, one task each. Clips: read and kept.
  parallel_for(int64_t(n), [&](int64_t k) {
    const size_t i = size_t(k);
    PreparedInput& p = out[i];
    bool clip = false;
    guarded(p, [&] {
      const auto t = Clock::now();
      std::vector<uint8_t> b = bytes(i);
      p.kind = input_kind(b);
      if ((clip = p.kind == InputKind::VIDEO)) {
        clips[i] = std::move(b);
        return;
      }
      if (hooks.planned) hooks.planned(i, plan_image(b, names[i], cfg));
      const image::Rgb8 img = image::decode_memory(b, names[i], cfg.image);
      std::vector<uint8_t>().swap(b);
      p.decode_ms = ms_since(t);
      const auto t2 = Clock::now();
      p.patches = image::preprocess(img, cfg.image, /*raw=*/true);
      p.preprocess_ms = ms_since(t2);
    });
    if (!clip && hooks.done) hooks.done(i);  // a clip is done after its decode below
  });
  // Clips: one after another, each decoding on every core; a clip whose read failed is done already.
  for (size_t i = 0; i < n; ++i) {
    if (out[i].kind != InputKind::VIDEO || out[i].error) continue;
    guarded(out[i], [&] {
      std::vector<uint8_t> b = std::move(clips[i]);
      const video::VideoLimits lim = clip_limits(cfg, hooks);
      if (hooks.planned) hooks.planned(i, plan_clip(video::probe_clip(b, names[i], lim, cfg.image), cfg));
      out[i] = prepare_clip(video::decode_clip(b, names[i], cfg.video, lim, cfg.image));
    });
    if (hooks.done) hooks.done(i);
  }
  return out;
}

namespace {
image::Rgb8 noise(int height, int width, std::seed_seq&& seed) {
  std::mt19937 r(seed);
  image::Rgb8 img{width, height, std::vector<uint8_t>(size_t(width) * size_t(height) * 3), "random-mm"};
  for (auto& v : img.data) v = uint8_t(r() & 255);
  return img;
}
}  // namespace

std::vector<PreparedInput> prepare_synthetic(size_t n, int height, int width, int64_t frames, double fps,
                                             unsigned seed, const InputConfig& cfg) {
  std::vector<PreparedInput> out(n);
  if (frames == 1) {
    parallel_for(int64_t(n), [&](int64_t k) { out[size_t(k)] = prepare_image(noise(height, width, {seed + unsigned(k)}), cfg); });
    return out;
  }
  for (size_t k = 0; k < n; ++k) {
    const auto t = Clock::now();
    const std::vector<int64_t> indices = video::sample_indices(frames, fps, cfg.video);
    std::vector<image::Rgb8> rgb(indices.size());
    parallel_for(int64_t(indices.size()), [&](int64_t i) {
      rgb[size_t(i)] = noise(height, width, {seed + unsigned(k), unsigned(indices[size_t(i)])});
    });
    const double made_ms = ms_since(t);
    out[k] = prepare_clip(video::preprocess_frames(rgb, indices, fps, cfg.video));
    out[k].decode_ms = made_ms;
  }
  return out;
}

PrepareTimes prepare_times(const std::vector<PreparedInput>& inputs) {
  PrepareTimes t;
  for (const PreparedInput& p : inputs) {
    if (p.kind == InputKind::VIDEO) {
      t.decode_ms += p.decode_ms;
      t.preprocess_ms += p.preprocess_ms;
    }
  }
  PrepareTimes images;
  for (const PreparedInput& p : inputs) {
    if (p.kind == InputKind::IMAGE) {
      images.decode_ms = std::max(images.decode_ms, p.decode_ms);
      images.preprocess_ms = std::max(images.preprocess_ms, p.preprocess_ms);
    }
  }
  return {t.decode_ms + images.decode_ms, t.preprocess_ms + images.preprocess_ms};
}

}  // namespace fovea
