// fovea bench mm-processor: the whole image path (decode, preprocess, encoder forward) over a
// dataset, vLLM's `bench mm-processor` flags: a folder of images taken --images-per-request at a
// time, or random-mm (synthetic images of one size). Per stage: mean, median, std and percentiles.
// With --mm-encoder-fp8-scale-save-path it calibrates (dynamic scaling; the scale file is written
// after 16 complete forwards, warm-ups included); with --mm-encoder-fp8-scale-path it runs static.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model, dataset = "random-mm", path, json_path, percentiles = "50,90,99", random_size = "720x1280";
  int prompts = 20, warmups = 2, images = 1;
  int64_t max_pixels = 0;
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

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
  if (a.prompts < 1) fail("--num-prompts must be >= 1, got {}", a.prompts);
  if (a.warmups < 0) fail("--num-warmups must be >= 0, got {}", a.warmups);
  if (a.images < 1) fail("--images-per-request must be >= 1, got {}", a.images);
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

  // The dataset: file names (folder) or one random image size (random-mm).
  std::vector<std::string> files;
  int rh = 0, rw = 0;
  if (a.dataset == "folder") {
    if (a.path.empty()) fail("--dataset-name folder needs --dataset-path");
    files = image::list_images(a.path, "--dataset-path");
  } else if (a.dataset == "random-mm") {
    if (std::sscanf(a.random_size.c_str(), "%dx%d", &rh, &rw) != 2 || rh < 1 || rw < 1)
      fail("--random-mm-size '{}' is not HxW", a.random_size);
  } else {
    fail("--dataset-name: '{}' is not one of random-mm, folder", a.dataset);
  }

  EncoderRunner runner(model, cfg);
  const ScaleBook* book = runner.book();
  std::vector<double> t_decode, t_pre, t_fwd, t_total, t_plan, t_upload, t_gpu, t_download;
  std::mt19937 rng(1234);
  const int total = a.warmups + a.prompts;
  size_t next_file = 0;
  EncoderOutputsBf16 outputs;
  for (int req = 0; req < total; ++req) {
    const auto t0 = clock_type::now();
    std::vector<std::string> names(size_t(a.images));
    for (auto& n : names) n = files.empty() ? "random" : files[next_file++ % files.size()];
    const unsigned seed = unsigned(rng());
    // decode + preprocess as encode and serve do it (prepare_images: one task per image, in
    // parallel); the stages are each the slowest image's. random-mm has no decoding: its noise
    // images are made in the decode step and that stage reports 0.
    std::vector<PreparedImage> prepared = prepare_images(size_t(a.images), [&](size_t i) {
      if (!files.empty()) return image::decode_file(names[i], pcfg);
      std::mt19937 r(seed + unsigned(i));
      image::Rgb8 img{rw, rh, std::vector<uint8_t>(size_t(rw) * rh * 3), "random-mm"};
      for (auto& v : img.data) v = uint8_t(r() & 255);
      return img;
    }, pcfg, {}, /*raw=*/true);
    double decode_ms = 0, pre_ms = 0;
    std::vector<const image::Patches*> batch;
    for (auto& p : prepared) {
      if (p.error) std::rethrow_exception(p.error);
      decode_ms = std::max(decode_ms, p.decode_ms);
      pre_ms = std::max(pre_ms, p.preprocess_ms);
      batch.push_back(&p.patches);
    }
    // As serve runs it: raw uint8 patches normalized on the GPU, bf16 outputs (deepstack included)
    // into reused vectors.
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
      t_decode.push_back(files.empty() ? 0.0 : decode_ms);
      t_pre.push_back(pre_ms);
      t_fwd.push_back(fwd_ms);
      t_total.push_back(ms_since(t0));
    }
    const int width = 30, done = (req + 1) * width / total;
    fmt::print(stderr, "\r[{}{}] {}/{} requests{}", std::string(size_t(done), '#'), std::string(size_t(width - done), ' '),
               req + 1, total, book && book->calibration_written() ? " (scales saved)" : "");
  }
  fmt::print(stderr, "\n");

  fmt::print("fovea bench mm-processor | {} | dataset {} | {} requests x {} image(s) (+{} warm-up) | {} on {}{}\n",
             a.model, a.dataset == "folder" ? a.path : "random-mm " + a.random_size, a.prompts, a.images, a.warmups,
             dtype_name(cfg.dtype), device_name(cfg.device),
             book ? fmt::format(" ({} scales)", scale_mode_name(book->mode())) : "");
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
    std::string line = fmt::format("{:<16} | {:>9.2f} | {:>9.2f} | {:>9.2f}", name, s.mean, s.median, s.std);
    nlohmann::ordered_json j = {{"mean_ms", s.mean}, {"median_ms", s.median}, {"std_ms", s.std}};
    for (const auto& [p, val] : s.pct) {
      line += fmt::format(" | {:>8.2f}", val);
      j[fmt::format("p{:g}_ms", p)] = val;
    }
    fmt::print("{}\n", line);
    stages[name[0] == ' ' ? "encoder " + std::string(name + 2) : std::string(name)] = j;
  }
  if (book && book->mode() == ScaleMode::CALIBRATE)
    fmt::print("calibration: {} complete forwards; scale file {}\n", book->complete_forwards(),
               book->calibration_written() ? "written to " + book->save_path() : "NOT written (needs 16 forwards)");
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {{"bench", "mm-processor"}, {"model", a.model}, {"dataset", a.dataset},
                                        {"requests", a.prompts}, {"warmups", a.warmups}, {"images_per_request", a.images},
                                        {"dtype", dtype_name(cfg.dtype)}, {"device", device_name(cfg.device)},
                                        {"stages", stages}};
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
  cmd->add_option("--dataset-path", a->path, "folder of images (dataset folder)");
  cmd->add_option("--num-prompts", a->prompts, "timed requests")->capture_default_str();
  cmd->add_option("--num-warmups", a->warmups, "untimed requests first (they count toward calibration)")->capture_default_str();
  cmd->add_option("--images-per-request", a->images, "images encoded together per request")->capture_default_str();
  cmd->add_option("--random-mm-size", a->random_size, "random-mm: image size HxW")->capture_default_str();
  cmd->add_option("--max-pixels", a->max_pixels, "resize budget override (default: the checkpoint's)");
  cmd->add_option("--metric-percentiles", a->percentiles, "comma list of percentiles")->capture_default_str();
  cmd->add_option("--output-json", a->json_path, "write the statistics as JSON to this file");
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
