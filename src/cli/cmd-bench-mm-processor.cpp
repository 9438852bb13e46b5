// fovea bench mm-processor: the whole image and video path (decode, preprocess, encoder forward)
// over a dataset, vLLM's `bench mm-processor` flags: a folder of images and video clips taken
// --images-per-request at a time, or random-mm (synthetic images of one size, or with
// --random-mm-num-frames > 1 synthetic clips, as vLLM's buckets with num_frames > 1 are videos).
// Per stage: mean, median, std and percentiles; per request: its visual tokens and grids.
// With --mm-encoder-fp8-scale-save-path it calibrates (dynamic scaling; the scale file is written
// after 16 complete forwards, warm-ups included); with --mm-encoder-fp8-scale-path it runs static.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"
#include "fovea/video.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model, dataset = "random-mm", path, json_path, percentiles = "50,90,99", random_size = "720x1280";
  int prompts = 20, warmups = 2, images = 1;
  int64_t random_frames = 1;  // --random-mm-num-frames: > 1 makes every random-mm item a clip
  double random_fps = 30;     // --random-mm-fps: the synthetic clips' frame rate (what frame sampling sees)
  int64_t max_pixels = 0;
  video::VideoOverrides video;
  EngineOptions engine;
};

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t) { return std::chrono::duration<double, std::milli>(clock_type::now() - t).count(); }

struct Summary {
  double mean = 0, median = 0, std = 0;
  std::vector<std::pair<double, double>> pct;  // (percentile, value)
};

Summary summarize(std::vector<double> v, const std::vector<double>& pcts) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  for (double x : v) s.std += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(s.std / double(v.size()));
  auto at = [&](double p) {  // linear interpolation between closest ranks (numpy's default)
    const double r = p / 100.0 * double(v.size() - 1);
    const size_t lo = size_t(std::floor(r)), hi = std::min(v.size() - 1, lo + 1);
    return v[lo] + (v[hi] - v[lo]) * (r - double(lo));
  };
  s.median = at(50);
  for (double p : pcts) s.pct.push_back({p, at(p)});
  return s;
}

// One dataset item: a file of the folder (a clip or an image), or random-mm's "random".
struct Item {
  std::string file;
  bool clip = false;
};

// The folder's inputs, sorted by name: clips by their first bytes (video::looks_like_video, whatever
// the name, as encode tells them), images by their extension (as image::list_images); other files
// are left out.
std::vector<Item> list_folder(const std::string& folder) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec)) fail("--dataset-path '{}' is not a folder", folder);
  std::vector<Item> items;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const std::string path = e.path().string();
    char head[512];  // looks_like_video reads at most 377 bytes (MPEG-TS's third sync byte)
    std::ifstream f(path, std::ios::binary);
    f.read(head, sizeof head);
    std::string ext = e.path().extension().string();
    for (auto& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (video::looks_like_video({reinterpret_cast<const uint8_t*>(head), size_t(f.gcount())}))
      items.push_back({path, true});
    else if (ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp" || ext == ".bmp" || ext == ".gif")
      items.push_back({path, false});
  }
  if (ec) fail("--dataset-path '{}': {}", folder, ec.message());
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.file < y.file; });
  if (items.empty())
    fail("--dataset-path '{}' has no images (.jpg/.jpeg/.png/.webp/.bmp/.gif) or video clips", folder);
  return items;
}

// random-mm's clip: of `frames` frames at `fps`, only those video::sample_indices keeps are made
// (random pixels), then preprocessed as decoded frames are. Making them is its decode stage.
video::Clip random_clip(int height, int width, int64_t frames, double fps, const video::VideoConfig& vcfg, unsigned seed) {
  const auto t0 = clock_type::now();
  const std::vector<int64_t> indices = video::sample_indices(frames, fps, vcfg);
  std::vector<image::Rgb8> rgb(indices.size());
  parallel_for(int64_t(indices.size()), [&](int64_t i) {
    std::seed_seq s{seed, unsigned(indices[size_t(i)])};
    std::mt19937 r(s);
    rgb[size_t(i)] = {width, height, std::vector<uint8_t>(size_t(width) * height * 3), "random-mm"};
    for (auto& v : rgb[size_t(i)].data) v = uint8_t(r() & 255);
  });
  const double made_ms = ms_since(t0);
  video::Clip c = video::preprocess_frames(rgb, indices, fps, vcfg);
  c.decode_ms = made_ms;
  return c;
}

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
  if (a.prompts < 1) fail("--num-prompts must be >= 1, got {}", a.prompts);
  if (a.warmups < 0) fail("--num-warmups must be >= 0, got {}", a.warmups);
  if (a.images < 1) fail("--images-per-request must be >= 1, got {}", a.images);
  if (a.random_frames < 1 || a.random_frames > video::kMaxFrames)
    fail("--random-mm-num-frames must be in 1..{} (1: images), got {}", video::kMaxFrames, a.random_frames);
  if (!(a.random_fps > 0 && a.random_fps <= 1000)) fail("--random-mm-fps must be in (0, 1000], got {}", a.random_fps);
  std::vector<double> pcts;
  {
    std::stringstream ss(a.percentiles);
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      const double p = std::strtod(item.c_str(), &end);
      if (item.empty() || *end || p < 0 || p > 100) fail("--metric-percentiles: '{}' is not a number in [0, 100]", item);
      pcts.push_back(p);
    }
  }
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  const image::PreprocessConfig pcfg = image::load_preprocess_config(a.model, {0, a.max_pixels});
  const video::VideoConfig vcfg = video::load_video_config(a.model, a.video);
  const video::VideoLimits vlim = video::limits_from(a.video);

  // The dataset: the folder's items in order, or one random-mm item (an image or a clip) repeated.
  const bool random = a.dataset == "random-mm";
  std::vector<Item> items;
  std::string dataset, decode_note;
  int rh = 0, rw = 0;
  if (a.dataset == "folder") {
    if (a.path.empty()) fail("--dataset-name folder needs --dataset-path");
    items = list_folder(a.path);
    const auto clips = std::count_if(items.begin(), items.end(), [](const Item& it) { return it.clip; });
    dataset = fmt::format("{} ({} images, {} clips)", a.path, int64_t(items.size()) - clips, clips);
    decode_note = "files";
  } else if (random) {
    if (std::sscanf(a.random_size.c_str(), "%dx%d", &rh, &rw) != 2 || rh < 1 || rw < 1)
      fail("--random-mm-size '{}' is not HxW", a.random_size);
    items = {{"random", a.random_frames > 1}};
    dataset = a.random_frames > 1
                  ? fmt::format("random-mm {}, {} frames at {:g} fps", a.random_size, a.random_frames, a.random_fps)
                  : "random-mm " + a.random_size;
    // Noise images are made in the decode step and it reports 0 (there is nothing to decode); a
    // clip's frames are made as a decoder would give them, and that is its decode stage.
    decode_note = a.random_frames > 1 ? "generated in memory" : "none (images made in memory, reported as 0)";
  } else {
    fail("--dataset-name: '{}' is not one of random-mm, folder", a.dataset);
  }
  // A batch is all raw uint8 patches or all fp32 ones, and clips are fp32 (their frames differ over
  // each temporal patch): with any clip in the run, the images are prepared fp32 too, as encode does.
  const bool any_clip = std::any_of(items.begin(), items.end(), [](const Item& it) { return it.clip; });

  EncoderRunner runner(model, cfg);
  const ScaleBook* book = runner.book();
  fmt::print("fovea bench mm-processor | {} | dataset {} | {} requests x {} item(s) (+{} warm-up) | decode: {} | {} on {}{}\n",
             a.model, dataset, a.prompts, a.images, a.warmups, decode_note, dtype_name(cfg.dtype), device_name(cfg.device),
             book ? fmt::format(" ({} scales)", scale_mode_name(book->mode())) : "");
  std::vector<double> t_decode, t_pre, t_fwd, t_total, t_plan, t_upload, t_gpu, t_download;
  std::mt19937 rng(1234);
  const int total = a.warmups + a.prompts;
  size_t next_item = 0;
  bool saved_said = false;
  nlohmann::ordered_json per_request = nlohmann::ordered_json::array();
  EncoderOutputsBf16 outputs;
  for (int req = 0; req < total; ++req) {
    const auto t0 = clock_type::now();
    std::vector<Item> request(size_t(a.images));
    for (Item& it : request) it = items[next_item++ % items.size()];
    const unsigned seed = unsigned(rng());
    // Images as encode and serve decode and preprocess them (prepare_images: one task per image, in
    // parallel): their stages are the slowest image's.
    std::vector<size_t> image_at;
    for (size_t k = 0; k < request.size(); ++k)
      if (!request[k].clip) image_at.push_back(k);
    std::vector<PreparedImage> prepared(request.size());
    {
      std::vector<PreparedImage> images = prepare_images(image_at.size(), [&](size_t j) {
        if (!random) return image::decode_file(request[image_at[j]].file, pcfg);
        std::mt19937 r(seed + unsigned(image_at[j]));
        image::Rgb8 img{rw, rh, std::vector<uint8_t>(size_t(rw) * rh * 3), "random-mm"};
        for (auto& v : img.data) v = uint8_t(r() & 255);
        return img;
      }, pcfg, {}, /*raw=*/!any_clip);
      for (size_t j = 0; j < image_at.size(); ++j) prepared[image_at[j]] = std::move(images[j]);
    }
    double decode_ms = 0, pre_ms = 0;
    for (size_t k : image_at) {
      if (prepared[k].error) std::rethrow_exception(prepared[k].error);
      decode_ms = std::max(decode_ms, random ? 0.0 : prepared[k].decode_ms);
      pre_ms = std::max(pre_ms, prepared[k].preprocess_ms);
    }
    // Clips one after another as encode runs them, each on all cores (frames decode and resize in
    // parallel inside): their times add up.
    for (size_t k = 0; k < request.size(); ++k) {
      if (!request[k].clip) continue;
      video::Clip c;
      if (random) {
        try {
          c = random_clip(rh, rw, a.random_frames, a.random_fps, vcfg, seed + unsigned(k));
        } catch (const Error& e) {
          fail("random-mm clip of {} frames of {} at {:g} fps: {}", a.random_frames, a.random_size, a.random_fps, e.what());
        }
      } else {
        const std::string bytes = read_file(request[k].file, "video", vlim.max_encoded_bytes);
        c = video::decode_clip({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, request[k].file, vcfg, vlim, pcfg);
      }
      decode_ms += c.decode_ms;
      pre_ms += c.preprocess_ms;
      prepared[k].patches = std::move(c.patches);
    }
    std::vector<const image::Patches*> batch;
    std::string line;
    int64_t tokens = 0;
    nlohmann::ordered_json detail = nlohmann::ordered_json::array();
    for (size_t k = 0; k < request.size(); ++k) {
      batch.push_back(&prepared[k].patches);
      const qwen3vl::GridThw& g = prepared[k].patches.grid;
      const int64_t n = image_tokens(model.config, g);
      tokens += n;
      const char* kind = request[k].clip ? "video" : "image";
      line += fmt::format(" | {} {} grid ({}, {}, {}) {} tokens", kind,
                          random ? "random" : std::filesystem::path(request[k].file).filename().string(), g[0], g[1], g[2], n);
      detail.push_back({{"kind", kind}, {"file", request[k].file}, {"grid_thw", g}, {"tokens", n}});
    }
    // As serve runs it: raw uint8 patches (fp32 with clips) normalized on the GPU, bf16 outputs
    // (deepstack included) into reused vectors.
    const auto t2 = clock_type::now();
    runner.start(batch, true);
    runner.finish(outputs);
    const double fwd_ms = ms_since(t2);
    if (req >= a.warmups) {
      const auto& rt = runner.last_timings();
      t_plan.push_back(rt.plan);
      t_upload.push_back(rt.upload);
      t_gpu.push_back(rt.forward);
      t_download.push_back(rt.download);
      t_decode.push_back(decode_ms);
      t_pre.push_back(pre_ms);
      t_fwd.push_back(fwd_ms);
      t_total.push_back(ms_since(t0));
    }
    const bool saved_now = book && book->calibration_written() && !saved_said;
    saved_said = saved_said || saved_now;
    fmt::print("request {}/{}{}: {} visual tokens{}{}\n", req + 1, total, req < a.warmups ? " (warm-up)" : "", tokens, line,
               saved_now ? " | scales saved" : "");
    std::fflush(stdout);  // progress, when stdout is a pipe
    per_request.push_back({{"warmup", req < a.warmups}, {"tokens", tokens}, {"items", detail}});
  }

  std::string head = fmt::format("{:<16} | {:>9} | {:>9} | {:>9}", "stage (ms)", "mean", "median", "std");
  for (double p : pcts) head += fmt::format(" | {:>8}", fmt::format("p{:g}", p));
  fmt::print("{}\n", head);
  nlohmann::ordered_json stages = nlohmann::ordered_json::object();
  // The encoder forward's parts (EncoderRunner::Timings): batch-shape planning, pixel upload, the
  // forward itself, outputs back to the host.
  for (const auto& [name, v] : {std::pair<const char*, std::vector<double>*>{"decode", &t_decode},
                                {"preprocess", &t_pre}, {"encoder forward", &t_fwd}, {"  plan", &t_plan},
                                {"  upload", &t_upload}, {"  forward", &t_gpu}, {"  download", &t_download},
                                {"total", &t_total}}) {
    const Summary s = summarize(*v, pcts);
    std::string row = fmt::format("{:<16} | {:>9.2f} | {:>9.2f} | {:>9.2f}", name, s.mean, s.median, s.std);
    nlohmann::ordered_json j = {{"mean_ms", s.mean}, {"median_ms", s.median}, {"std_ms", s.std}};
    for (const auto& [p, val] : s.pct) {
      row += fmt::format(" | {:>8.2f}", val);
      j[fmt::format("p{:g}_ms", p)] = val;
    }
    fmt::print("{}\n", row);
    // The parts as "encoder.plan", ...: "encoder forward" is the whole (its part "forward" once
    // overwrote it here).
    stages[name[0] == ' ' ? "encoder." + std::string(name + 2) : std::string(name)] = j;
  }
  if (book && book->mode() == ScaleMode::CALIBRATE)
    fmt::print("calibration: {} complete forwards; scale file {}\n", book->complete_forwards(),
               book->calibration_written() ? "written to " + book->save_path() : "NOT written (needs 16 forwards)");
  if (!a.json_path.empty()) {
    nlohmann::ordered_json doc = {{"bench", "mm-processor"}, {"model", a.model}, {"dataset", a.dataset},
                                  {"requests", a.prompts}, {"warmups", a.warmups}, {"images_per_request", a.images},
                                  {"decode", decode_note}};
    if (random)
      doc["random_mm"] = {{"size", a.random_size}, {"num_frames", a.random_frames}, {"fps", a.random_fps}};
    doc["dtype"] = dtype_name(cfg.dtype);
    doc["device"] = device_name(cfg.device);
    doc["stages"] = stages;
    doc["per_request"] = per_request;
    write_file_atomic(a.json_path, doc.dump(2) + "\n", "--output-json");
  }
  return 0;
}

}  // namespace

void add_bench_mm_processor(CLI::App* bench, Runner& runner) {
  auto* cmd = bench->add_subcommand("mm-processor", "decode + preprocess + encoder forward over a dataset, per-stage statistics");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--dataset-name", a->dataset, "random-mm or folder")->capture_default_str();
  cmd->add_option("--dataset-path", a->path, "folder of images and video clips (dataset folder)");
  cmd->add_option("--num-prompts", a->prompts, "timed requests")->capture_default_str();
  cmd->add_option("--num-warmups", a->warmups, "untimed requests first (they count toward calibration)")->capture_default_str();
  cmd->add_option("--images-per-request", a->images, "items (images or clips) encoded together per request")
      ->capture_default_str();
  cmd->add_option("--random-mm-size", a->random_size, "random-mm: image or frame size HxW")->capture_default_str();
  cmd->add_option("--random-mm-num-frames", a->random_frames,
                  "random-mm: frames per item; > 1 makes each item a clip, of which the frames the video config "
                  "samples are made")
      ->capture_default_str();
  cmd->add_option("--random-mm-fps", a->random_fps, "random-mm: the clips' frame rate")->capture_default_str();
  cmd->add_option("--max-pixels", a->max_pixels, "resize budget override (default: the checkpoint's)");
  cmd->add_option("--metric-percentiles", a->percentiles, "comma list of percentiles")->capture_default_str();
  cmd->add_option("--output-json", a->json_path, "write the statistics as JSON to this file");
  add_video_flags(cmd, a->video);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
