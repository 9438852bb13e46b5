// The input steps of fovea/pipeline.h: what an input is (image or clip), its plan from its header,
// and decode + preprocess of a list of inputs.
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include <sys/stat.h>
#include <unistd.h>

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
  // A FIFO or a device is refused here, at once: a blocking open would wait for a writer forever.
  struct stat st {};
  const Fd fd = open_regular_file(path, "input", &st);
  std::array<uint8_t, 512> head{};
  const ssize_t n = pread_full(fd.get(), head.data(), head.size(), 0);
  if (n < 0) fail("input '{}': cannot read it: {}", path, std::strerror(errno));
  return input_kind({head.data(), size_t(n)});
}

InputConfig load_input_config(const std::string& model, const image::PreprocessOverrides& image,
                              const video::VideoOverrides& video) {
  return {image::load_preprocess_config(model, image), video::load_video_config(model, video),
          video::limits_from(video)};
}

size_t max_input_bytes(const InputConfig& cfg) {
  return std::max(image::kMaxEncodedImageBytes, cfg.limits.max_encoded_bytes);
}

std::vector<uint8_t> read_input(const std::string& path, const InputConfig& cfg) {
  const std::string s = read_file(path, "input", max_input_bytes(cfg));
  return {s.begin(), s.end()};
}

int64_t patch_bytes(const image::Patches& p) { return int64_t(p.pixels.size() * sizeof(float) + p.raw.size()); }

namespace {
int64_t tokens_of(const qwen3vl::GridThw& g, int merge) {
  return int64_t(g[0]) * g[1] * g[2] / (int64_t(merge) * merge);
}
}  // namespace

int64_t visual_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g) { return tokens_of(g, c.merge); }

namespace {

InputPlan plan_image(std::span<const uint8_t> bytes, const std::string& name, const InputConfig& cfg) {
  const image::ImageInfo info = image::probe(bytes, name, cfg.image);
  InputPlan p;
  try {
    p.grid = image::resized_grid(info.height, info.width, cfg.image);
  } catch (const Error& e) {  // the resize's errors (an aspect ratio over 200) do not name the image
    fail("image '{}': {}", name, e.what());
  }
  p.tokens = tokens_of(p.grid, cfg.image.merge);
  p.peak_bytes = image::decode_peak_bytes(info, cfg.image);
  p.held_bytes = int64_t(p.grid[0]) * p.grid[1] * p.grid[2] * 3 * cfg.image.patch * cfg.image.patch;  // raw patches
  return p;
}

// threads: the decoding threads of the caller of prepare_inputs, which decode_opened will use (the
// planning thread's own share is smaller where several inputs are planned at once).
InputPlan plan_clip(const video::ClipInfo& info, const InputConfig& cfg, int threads) {
  try {
    const video::ClipPlan plan = video::plan_clip(info, cfg.video, cfg.limits, threads);
    InputPlan p;
    p.kind = InputKind::VIDEO;
    p.grid = plan.grid;
    p.tokens = tokens_of(p.grid, cfg.video.merge);
    // The packets, the decoder (its pool of pictures is enforced) and the frames (decode_opened's
    // batches keep them within max_bytes_in_flight): video::ClipPlan::peak_bytes.
    p.peak_bytes = plan.peak_bytes();
    p.held_bytes = std::max(plan.packet_bytes, plan.patch_bytes);  // packets until decoded, then the patches
    p.clip = ClipSampling{plan.indices, plan.timestamps, info.fps};
    return p;
  } catch (const Error& e) {  // sampling and smart_resize errors do not name the clip
    fail("video '{}': {}", info.name, e.what());
  }
}

// The deadline of one clip: its limits' from now, no later than the caller's.
Clock::time_point clip_deadline(const InputConfig& cfg, const PrepareHooks& hooks) {
  const Clock::time_point own = video::deadline_of(cfg.limits);
  return hooks.deadline ? std::min(own, *hooks.deadline) : own;
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

int64_t prepare_peak_bytes(const std::vector<InputPlan>& plans) {
  int64_t held = 0, images = 0, clip = 0;
  for (const InputPlan& p : plans) {
    held += p.held_bytes;
    if (p.kind == InputKind::IMAGE)
      images += p.peak_bytes - p.held_bytes;  // decoded at once
    else
      clip = std::max(clip, p.peak_bytes - p.held_bytes);  // one at a time
  }
  return held + std::max(images, clip);
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

namespace {

// One input between the steps of prepare_inputs: an image's bytes, or a clip opened.
struct Pending {
  InputPlan plan;
  std::vector<uint8_t> bytes;
  std::optional<video::OpenedClip> clip;
  Clock::time_point deadline;
  double read_ms = 0;
};

// Reads input i, takes its kind and plans it from its header (a clip is opened: its packets kept,
// its bytes dropped). The hooks hear of it before anything is decoded.
void plan_input(size_t i, const std::string& name, const std::function<std::vector<uint8_t>(size_t)>& bytes,
                const InputConfig& cfg, const PrepareHooks& hooks, PreparedInput& p, Pending& w, int threads) {
  const auto t = Clock::now();
  w.bytes = bytes(i);
  p.kind = input_kind(w.bytes);
  if (p.kind == InputKind::IMAGE) {
    w.plan = plan_image(w.bytes, name, cfg);
    if (hooks.planned) hooks.planned(i, w.plan);
  } else {
    w.deadline = clip_deadline(cfg, hooks);
    if (hooks.opening) hooks.opening(i, video::container_cost(w.bytes, name).open_bytes);
    struct Opened {  // the opening hook hears 0 once the clip is open or failed
      const PrepareHooks& h;
      size_t i;
      ~Opened() {
        if (h.opening) h.opening(i, 0);
      }
    } opened{hooks, i};
    w.clip = video::open_clip(w.bytes, name, cfg.limits, cfg.image, w.deadline);
    std::vector<uint8_t>().swap(w.bytes);
    w.plan = plan_clip(w.clip->info, cfg, threads);
    if (hooks.planned) hooks.planned(i, w.plan);
  }
  w.read_ms = ms_since(t);
}

void decode_image(const std::string& name, const InputConfig& cfg, PreparedInput& p, Pending& w) {
  const auto t = Clock::now();
  const image::Rgb8 img = image::decode_memory(w.bytes, name, cfg.image);
  std::vector<uint8_t>().swap(w.bytes);
  p.decode_ms = w.read_ms + ms_since(t);
  const auto t2 = Clock::now();
  p.patches = image::preprocess(img, cfg.image, /*raw=*/true);
  p.preprocess_ms = ms_since(t2);
}

}  // namespace

std::vector<PlannedInput> plan_inputs(const std::vector<std::string>& names,
                                      const std::function<std::vector<uint8_t>(size_t)>& bytes, const InputConfig& cfg,
                                      const PrepareHooks& hooks) {
  std::vector<PlannedInput> out(names.size());
  const int threads = video::decoding_threads();
  parallel_for(int64_t(names.size()), [&](int64_t k) {
    const size_t i = size_t(k);
    PreparedInput p;
    Pending w;
    guarded(p, [&] { plan_input(i, names[i], bytes, cfg, hooks, p, w, threads); });
    out[i] = {p.kind, std::move(w.plan), p.error};
  });
  return out;
}

InputPlan probe_input(std::span<const uint8_t> bytes, const std::string& name, const InputConfig& cfg) {
  const std::vector<PlannedInput> one =
      plan_inputs({name}, [&](size_t) { return std::vector<uint8_t>(bytes.begin(), bytes.end()); }, cfg, {});
  if (one[0].error) std::rethrow_exception(one[0].error);
  return one[0].plan;
}

std::vector<PreparedInput> prepare_inputs(const std::vector<std::string>& names,
                                          const std::function<std::vector<uint8_t>(size_t)>& bytes,
                                          const InputConfig& cfg, const PrepareHooks& hooks) {
  const size_t n = names.size();
  std::vector<PreparedInput> out(n);
  std::vector<Pending> work(n);
  std::atomic<bool> failed{false};
  const auto finish = [&](size_t i) {  // the input's last step: done, and with all_or_nothing, the rest skip
    if (out[i].error) failed = true;
    if (hooks.done) hooks.done(i, out[i]);
    work[i] = {};
  };
  // Every input read and planned (clips opened) first, in parallel: the hooks admit or refuse them
  // all before a pixel is decoded.
  const int threads = video::decoding_threads();
  parallel_for(int64_t(n), [&](int64_t k) {
    const size_t i = size_t(k);
    guarded(out[i], [&] { plan_input(i, names[i], bytes, cfg, hooks, out[i], work[i], threads); });
    if (out[i].error) finish(i);
  });
  if (hooks.all_planned) {  // the plans of the inputs still standing, and what preparing them holds
    std::vector<InputPlan> plans;
    for (size_t i = 0; i < n; ++i)
      if (!out[i].error) plans.push_back(work[i].plan);
    try {
      if (!plans.empty()) hooks.all_planned(prepare_peak_bytes(plans));
    } catch (...) {
      for (size_t i = 0; i < n; ++i)
        if (!out[i].error) {
          out[i].error = std::current_exception();
          finish(i);
        }
    }
  }
  const auto skipped = [&](size_t i) {
    if (out[i].error) return true;  // done already
    if (!(hooks.all_or_nothing && failed)) return false;
    finish(i);  // no error of its own: another input's stopped it
    return true;
  };
  // Images: decoded and preprocessed in parallel.
  parallel_for(int64_t(n), [&](int64_t k) {
    const size_t i = size_t(k);
    if (out[i].kind != InputKind::IMAGE || skipped(i)) return;
    guarded(out[i], [&] { decode_image(names[i], cfg, out[i], work[i]); });
    finish(i);
  });
  // Clips: one after another, each decoding on the caller's share of the cores.
  for (size_t i = 0; i < n; ++i) {
    if (out[i].kind != InputKind::VIDEO || skipped(i)) continue;
    guarded(out[i], [&] {
      const double open_ms = work[i].read_ms;
      out[i] = prepare_clip(video::decode_opened(*work[i].clip, cfg.video, cfg.limits, work[i].deadline));
      out[i].decode_ms += open_ms;
    });
    finish(i);
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

std::vector<PreparedInput> prepare_synthetic(size_t n, int height, int width, int64_t frames, double fps, unsigned seed,
                                             const InputConfig& cfg) {
  std::vector<PreparedInput> out(n);
  if (frames == 1) {
    parallel_for(int64_t(n),
                 [&](int64_t k) { out[size_t(k)] = prepare_image(noise(height, width, {seed + unsigned(k)}), cfg); });
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
