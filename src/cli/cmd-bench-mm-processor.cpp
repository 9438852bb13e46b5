// fovea bench mm-processor: the whole image and video path (decode, preprocess, encoder forward)
// over a dataset, vLLM's `bench mm-processor` flags: a folder of images and video clips taken
// --images-per-request at a time, or random-mm (synthetic images of one size, or with
// --random-mm-num-frames > 1 synthetic clips, as vLLM's buckets with num_frames > 1 are videos).
// Per stage: mean, median, std and percentiles; per request: its visual tokens and grids.
// With --mm-encoder-fp8-scale-save-path it calibrates (dynamic scaling; the scale file is written
// after 16 complete forwards, warm-ups included); with --mm-encoder-fp8-scale-path it runs static.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/lists.h"
#include "fovea/pipeline.h"

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

std::vector<double> parse_percentiles(const std::string& list) {
  std::vector<double> pcts;
  for (const std::string& item : split_list(list)) {
    char* end = nullptr;
    const double p = std::strtod(item.c_str(), &end);
    if (item.empty() || *end || p < 0 || p > 100) fail("--metric-percentiles: '{}' is not a number in [0, 100]", item);
    pcts.push_back(p);
  }
  return pcts;
}

// The folder's inputs, sorted by name: clips by their first bytes (whatever the name, as encode
// tells them), images by their extension (as image::list_images); other files are left out.
std::vector<std::string> list_folder(const std::string& folder) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec)) fail("--dataset-path '{}' is not a folder", folder);
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
    if (!e.is_regular_file(ec)) continue;
    std::string ext = e.path().extension().string();
    for (auto& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
    const bool image =
        ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp" || ext == ".bmp" || ext == ".gif";
    if (image || file_input_kind(e.path().string()) == InputKind::VIDEO) files.push_back(e.path().string());
  }
  if (ec) fail("--dataset-path '{}': {}", folder, ec.message());
  std::sort(files.begin(), files.end());
  if (files.empty()) fail("--dataset-path '{}' has no images (.jpg/.jpeg/.png/.webp/.bmp/.gif) or video clips", folder);
  return files;
}

// The dataset: the folder's files in order, or random-mm's synthetic inputs of one shape.
struct Dataset {
  std::vector<std::string> files;  // empty for random-mm
  int height = 0, width = 0;       // random-mm
  std::string about, decode_note;
};

Dataset load_dataset(const Args& a) {
  Dataset d;
  if (a.dataset == "folder") {
    if (a.path.empty()) fail("--dataset-name folder needs --dataset-path");
    d.files = list_folder(a.path);
    const auto clips = std::count_if(d.files.begin(), d.files.end(),
                                     [](const std::string& f) { return file_input_kind(f) == InputKind::VIDEO; });
    d.about = fmt::format("{} ({} images, {} clips)", a.path, int64_t(d.files.size()) - clips, clips);
    d.decode_note = "files";
    return d;
  }
  if (a.dataset != "random-mm") fail("--dataset-name: '{}' is not one of random-mm, folder", a.dataset);
  if (std::sscanf(a.random_size.c_str(), "%dx%d", &d.height, &d.width) != 2 || d.height < 1 || d.width < 1)
    fail("--random-mm-size '{}' is not HxW", a.random_size);
  const bool clips = a.random_frames > 1;
  d.about = clips ? fmt::format("random-mm {}, {} frames at {:g} fps", a.random_size, a.random_frames, a.random_fps)
                  : "random-mm " + a.random_size;
  // Noise images are made in the decode step and it reports 0 (there is nothing to decode); a
  // clip's frames are made as a decoder would give them, and that is its decode stage.
  d.decode_note = clips ? "generated in memory" : "none (images made in memory, reported as 0)";
  return d;
}

// One request's inputs, prepared as encode and serve prepare them.
std::vector<PreparedInput> prepare_request(const Args& a, const Dataset& d, const InputConfig& in, size_t& next,
                                           unsigned seed, std::vector<std::string>& names) {
  names.assign(size_t(a.images), "random");
  if (d.files.empty()) {
    try {
      return prepare_synthetic(size_t(a.images), d.height, d.width, a.random_frames, a.random_fps, seed, in);
    } catch (const Error& e) {
      fail("random-mm clip of {} frames of {} at {:g} fps: {}", a.random_frames, a.random_size, a.random_fps, e.what());
    }
  }
  for (std::string& n : names) n = d.files[next++ % d.files.size()];
  std::vector<PreparedInput> p = prepare_inputs(
      names, [&](size_t k) { return read_input(names[k], in); }, in);
  for (const PreparedInput& x : p)
    if (x.error) std::rethrow_exception(x.error);
  return p;
}

struct Stages {
  std::vector<double> decode, preprocess, forward, total, plan, upload, gpu, download;
};

// Prints the per-stage table; returns the stages as JSON.
nlohmann::ordered_json report_stages(const Stages& t, const std::vector<double>& pcts) {
  std::string head = fmt::format("{:<16} | {:>9} | {:>9} | {:>9}", "stage (ms)", "mean", "median", "std");
  for (double p : pcts) head += fmt::format(" | {:>8}", fmt::format("p{:g}", p));
  fmt::print("{}\n", head);
  nlohmann::ordered_json stages = nlohmann::ordered_json::object();
  // The encoder forward's parts (EncoderRunner::Timings): batch-shape planning, pixel upload, the
  // forward itself, outputs back to the host.
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<double>*>{"decode", &t.decode},
                                {"preprocess", &t.preprocess},
                                {"encoder forward", &t.forward},
                                {"  plan", &t.plan},
                                {"  upload", &t.upload},
                                {"  forward", &t.gpu},
                                {"  download", &t.download},
                                {"total", &t.total}}) {
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
  return stages;
}

void check_args(const Args& a) {
  if (a.prompts < 1) fail("--num-prompts must be >= 1, got {}", a.prompts);
  if (a.warmups < 0) fail("--num-warmups must be >= 0, got {}", a.warmups);
  if (a.images < 1) fail("--images-per-request must be >= 1, got {}", a.images);
  if (a.random_frames < 1 || a.random_frames > video::kMaxFrames)
    fail("--random-mm-num-frames must be in 1..{} (1: images), got {}", video::kMaxFrames, a.random_frames);
  if (!(a.random_fps > 0 && a.random_fps <= 1000)) fail("--random-mm-fps must be in (0, 1000], got {}", a.random_fps);
}

// --output-json: the run's settings, each stage's percentiles and every request's items.
void write_json(const Args& a, const Dataset& d, const EngineConfig& cfg, const nlohmann::ordered_json& stages,
                const nlohmann::ordered_json& per_request) {
  nlohmann::ordered_json doc = {{"bench", "mm-processor"}, {"model", a.model},     {"dataset", a.dataset},
                                {"requests", a.prompts},   {"warmups", a.warmups}, {"images_per_request", a.images},
                                {"decode", d.decode_note}};
  if (d.files.empty())
    doc["random_mm"] = {{"size", a.random_size}, {"num_frames", a.random_frames}, {"fps", a.random_fps}};
  doc["dtype"] = dtype_name(cfg.dtype);
  doc["device"] = device_name(cfg.device);
  doc["stages"] = stages;
  doc["per_request"] = per_request;
  write_file_atomic(a.json_path, doc.dump(2) + "\n", "--output-json");
}

int run(const Args& a) {
  const EngineConfig cfg = resolve_engine(a.engine, query_system());
  check_args(a);
  const std::vector<double> pcts = parse_percentiles(a.percentiles);
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  const InputConfig in = load_input_config(a.model, {0, a.max_pixels}, a.video);
  const Dataset d = load_dataset(a);
  EncoderRunner runner(model, cfg);
  const ScaleBook* book = runner.book();
  fmt::print(
      "fovea bench mm-processor | {} | dataset {} | {} requests x {} item(s) (+{} warm-up) | decode: {} | {} on {}{}\n",
      a.model, d.about, a.prompts, a.images, a.warmups, d.decode_note, dtype_name(cfg.dtype), device_name(cfg.device),
      book ? fmt::format(" ({} scales)", scale_mode_name(book->mode())) : "");
  Stages t;
  std::mt19937 rng(1234);
  const int total = a.warmups + a.prompts;
  size_t next = 0;
  bool saved_said = false;
  nlohmann::ordered_json per_request = nlohmann::ordered_json::array();
  EncoderOutputsBf16 outputs;
  for (int req = 0; req < total; ++req) {
    const auto t0 = Clock::now();
    std::vector<std::string> names;
    const std::vector<PreparedInput> prepared = prepare_request(a, d, in, next, unsigned(rng()), names);
    std::vector<const image::Patches*> batch;
    std::string line;
    int64_t tokens = 0;
    nlohmann::ordered_json detail = nlohmann::ordered_json::array();
    for (size_t k = 0; k < prepared.size(); ++k) {
      batch.push_back(&prepared[k].patches);
      const qwen3vl::GridThw& g = prepared[k].patches.grid;
      const int64_t n = visual_tokens(model.config, g);
      tokens += n;
      const char* kind = input_kind_name(prepared[k].kind);
      line += fmt::format(" | {} {} grid ({}, {}, {}) {} tokens", kind,
                          d.files.empty() ? "random" : std::filesystem::path(names[k]).filename().string(), g[0], g[1],
                          g[2], n);
      detail.push_back({{"kind", kind}, {"file", names[k]}, {"grid_thw", g}, {"tokens", n}});
    }
    // As serve runs it: the inputs' patches uploaded as they are, bf16 outputs (deepstack included)
    // into reused vectors.
    const auto t2 = Clock::now();
    runner.start(batch, true);
    runner.finish(outputs);
    const double fwd_ms = ms_since(t2);
    if (req >= a.warmups) {
      const auto& rt = runner.last_timings();
      const PrepareTimes pt = prepare_times(prepared);
      for (const auto& [v, x] : {std::pair{&t.plan, rt.plan},
                                 {&t.upload, rt.upload},
                                 {&t.gpu, rt.forward},
                                 {&t.download, rt.download},
                                 {&t.decode, pt.decode_ms},
                                 {&t.preprocess, pt.preprocess_ms},
                                 {&t.forward, fwd_ms},
                                 {&t.total, ms_since(t0)}})
        v->push_back(x);
    }
    const bool saved_now = book && book->calibration_written() && !saved_said;
    saved_said = saved_said || saved_now;
    fmt::print("request {}/{}{}: {} visual tokens{}{}\n", req + 1, total, req < a.warmups ? " (warm-up)" : "", tokens,
               line, saved_now ? " | scales saved" : "");
    std::fflush(stdout);  // progress, when stdout is a pipe
    per_request.push_back({{"warmup", req < a.warmups}, {"tokens", tokens}, {"items", detail}});
  }
  const nlohmann::ordered_json stages = report_stages(t, pcts);
  if (book && book->mode() == ScaleMode::CALIBRATE)
    fmt::print("calibration: {} complete forwards; scale file {}\n", book->complete_forwards(),
               book->calibration_written() ? "written to " + book->save_path() : "NOT written (needs 16 forwards)");
  if (!a.json_path.empty()) write_json(a, d, cfg, stages, per_request);
  return 0;
}

}  // namespace

void add_bench_mm_processor(CLI::App* bench, Runner& runner) {
  auto* cmd = bench->add_subcommand("mm-processor",
                                    "decode + preprocess + encoder forward over a dataset, per-stage statistics");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--dataset-name", a->dataset, "random-mm or folder")->capture_default_str();
  cmd->add_option("--dataset-path", a->path, "folder of images and video clips (dataset folder)");
  cmd->add_option("--num-prompts", a->prompts, "timed requests")->capture_default_str();
  cmd->add_option("--num-warmups", a->warmups, "untimed requests first (they count toward calibration)")
      ->capture_default_str();
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
