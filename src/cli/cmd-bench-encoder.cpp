// fovea bench encoder MODEL: the GPU encoder forward at standard resolutions, BF16 and FP8 (dynamic
// and static scales), timed as CUDA-graph replays (kernels only), medians of CUDA-event timings.
#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/clock.h"
#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/lists.h"
#include "fovea/random.h"

#if FOVEA_HAVE_CUDA
#include "fovea/cuda-support.h"
#endif

namespace fovea::cli {

namespace {

struct Args {
  std::string model;
  std::string resolutions = "HD,FullHD,QHD,4K";
  int images = 3;
  std::string modes = "bf16,fp8-dynamic,fp8-static,fp8-static+fp8-linears";
  int reps = 10;
  int warmup = 2;
  std::string json_path;
};

// docs/encoder.md §smart_resize: the grids transformers' processor gives these inputs with the shipped defaults.
const std::vector<std::tuple<std::string, std::string, qwen3vl::GridThw>> kResolutions = {
    {"HD", "720x1280 -> 704x1280", {1, 44, 80}},
    {"FullHD", "1080x1920 -> 1088x1920", {1, 68, 120}},
    {"QHD", "1440x2560", {1, 90, 160}},
    {"4K", "2160x3840 -> 2176x3840", {1, 136, 240}},
};

#if FOVEA_HAVE_CUDA

int run(const Args& a) {
  const SystemInfo sys = query_system();
  if (auto why = backend_unsupported(AttnBackend::FOVEA, AttnDtype::FP8, Device::CUDA, sys))
    fail("bench encoder needs the FOVEA backend: {}", *why);
  if (a.images < 1) fail("--images-per-request must be >= 1, got {}", a.images);
  if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
  const auto modes = split_list(a.modes);
  // A mode is an attention mode, optionally with "+fp8-linears" (the blocks' linears in FP8).
  constexpr std::string_view kLinears = "+fp8-linears";
  auto attention_mode = [&](const std::string& m) {
    return m.ends_with(kLinears) ? m.substr(0, m.size() - kLinears.size()) : m;
  };
  for (const auto& m : modes)
    if (const std::string b = attention_mode(m);
        b != "bf16" && b != "cudnn-bf16" && b != "fp8-dynamic" && b != "fp8-static" && b != "fp8-robust")
      fail("--dtype: '{}' is not one of bf16, cudnn-bf16, fp8-dynamic, fp8-static, fp8-robust, each optionally followed by "
           "+fp8-linears", m);
  std::vector<std::tuple<std::string, std::string, qwen3vl::GridThw>> res;
  for (const auto& r : split_list(a.resolutions)) {
    auto it = std::find_if(kResolutions.begin(), kResolutions.end(), [&](const auto& x) { return std::get<0>(x) == r; });
    if (it == kResolutions.end()) fail("--resolutions: '{}' is not one of HD, FullHD, QHD, 4K", r);
    res.push_back(*it);
  }
  const Clock::time_point t0 = Clock::now();
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  fmt::print("fovea bench encoder | {} | {} ({} blocks, hidden {}, head_dim {}) | {} images per request | loaded in {:.1f} s\n",
             sys.gpus.at(0).name, a.model, model.config.depth, model.config.hidden, model.config.head_dim(), a.images,
             seconds_since(t0));
  fmt::print("{:<7} | {:>7} | {:<23} | {:>10} | {:>8}\n", "res", "tokens", "mode", "median ms", "x bf16");
  cudaStream_t s;
  FOVEA_CUDA_CHECK(cudaStreamCreate(&s));
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& [name, desc, grid] : res) {
    const std::vector<qwen3vl::GridThw> grids(size_t(a.images), grid);
    int64_t n = 0;
    for (auto& g : grids) n += int64_t(g[0]) * g[1] * g[2];
    std::vector<float> px = random_values(n * model.config.patch_dim(), Dist::NORMAL, 7);
    for (auto& x : px) x = std::tanh(x);
    double bf16_ms = 0;
    // Static scales: what calibration writes (dynamic scaling's rings x 1.5), from the dynamic run
    // when there is one, else from one dynamic forward first.
    std::optional<std::vector<QkvScales>> calibrated;
    auto calibrate = [&] {
      ScaleBook b = ScaleBook::dynamic(model.config.depth);
      qwen3vl::cuda::Encoder e(model, {AttnDtype::FP8, &b});
      e.plan(grids);
      e.upload_pixels(px, s);
      e.forward(s);
      e.sync_scales(s);
      return b.calibrated(kDefaultScaleMargin);
    };
    for (const auto& name_ : modes) {
      const std::string mode = attention_mode(name_);
      ScaleBook book = mode == "fp8-static" ? ScaleBook::fixed(calibrated ? *calibrated : calibrate())
                                            : ScaleBook::dynamic(model.config.depth);
      qwen3vl::cuda::EncoderOptions o;
      const bool bf16 = mode == "bf16" || mode == "cudnn-bf16";
      o.dtype = bf16 ? AttnDtype::BF16 : AttnDtype::FP8;
      o.scales = bf16 ? nullptr : &book;
      o.backend = mode == "cudnn-bf16" ? AttnBackend::CUDNN : AttnBackend::FOVEA;  // cudnn-bf16: the CUDNN backend
      o.fp8_linears = mode != name_;
      o.fp8_robust = mode == "fp8-robust";  // the robust scheme, each layer's arrays from its own batch
      qwen3vl::cuda::Encoder enc(model, o);
      enc.plan(grids);
      enc.upload_pixels(px, s);
      enc.forward(s);  // eager once: cuBLASLt picks algorithms outside the capture
      cudaGraph_t g;
      cudaGraphExec_t exec;
      FOVEA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      enc.forward(s);
      FOVEA_CUDA_CHECK(cudaStreamEndCapture(s, &g));
      FOVEA_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      const double med = cuda::median_ms([&] { FOVEA_CUDA_CHECK(cudaGraphLaunch(exec, s)); }, a.warmup, a.reps, s);
      if (name_ == "bf16") bf16_ms = med;
      if (name_ == "fp8-dynamic") {
        enc.sync_scales(s);
        calibrated = book.calibrated(kDefaultScaleMargin);
      }
      const std::string speedup = bf16_ms > 0 ? fmt::format("{:.2f}", bf16_ms / med) : "-";
      fmt::print("{:<7} | {:>7} | {:<23} | {:>10.2f} | {:>8}\n", name, n, name_, med, speedup);
      std::fflush(stdout);
      rows.push_back({{"resolution", name}, {"input", desc}, {"images", a.images}, {"tokens", n}, {"mode", name_}, {"median_ms", med}});
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
    }
  }
  cudaStreamDestroy(s);
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {{"bench", "encoder"}, {"model", a.model}, {"gpu", sys.gpus.at(0).name}, {"rows", rows}};
    write_file_atomic(a.json_path, doc.dump(2) + "\n", "--json");
  }
  return 0;
}

#else

int run(const Args&) { fail("bench encoder runs on a GPU: this fovea was built without CUDA"); }

#endif

}  // namespace

void add_bench_encoder(CLI::App* bench, Runner& runner) {
  auto* cmd = bench->add_subcommand("encoder", "GPU encoder forward time at standard resolutions: BF16 vs FP8");
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--resolutions", a->resolutions, "comma list of HD, FullHD, QHD, 4K")->capture_default_str();
  cmd->add_option("--images-per-request", a->images, "images encoded together (one packed batch)")->capture_default_str();
  cmd->add_option("--dtype", a->modes, "comma list of bf16, cudnn-bf16 (the CUDNN backend), fp8-dynamic, fp8-static, fp8-robust (dynamic, the scheme robust to outlier channels), each optionally with +fp8-linears "
                  "(the blocks' linears as FP8 GEMMs)")->capture_default_str();
  cmd->add_option("--reps", a->reps, "timed graph replays (median reported)")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "untimed replays first")->capture_default_str();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
