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

using Resolution = std::tuple<std::string, std::string, qwen3vl::GridThw>;  // name, input size, grid

// docs/encoder.md §smart_resize: the grids transformers' processor gives these inputs with the shipped defaults.
const std::vector<Resolution> kResolutions = {
    {"HD", "720x1280 -> 704x1280", {1, 44, 80}},
    {"FullHD", "1080x1920 -> 1088x1920", {1, 68, 120}},
    {"QHD", "1440x2560", {1, 90, 160}},
    {"4K", "2160x3840 -> 2176x3840", {1, 136, 240}},
};

#if FOVEA_HAVE_CUDA

// A mode is an attention mode, optionally with "+fp8-linears" (the blocks' linears in FP8).
constexpr std::string_view kLinears = "+fp8-linears";

std::string attention_mode(const std::string& m) {
  return m.ends_with(kLinears) ? m.substr(0, m.size() - kLinears.size()) : m;
}

std::vector<std::string> parse_modes(const std::string& list) {
  std::vector<std::string> modes = split_list(list);
  for (const auto& m : modes)
    if (const std::string b = attention_mode(m);
        b != "bf16" && b != "cudnn-bf16" && b != "fp8-dynamic" && b != "fp8-static" && b != "fp8-robust")
      fail(
          "--dtype: '{}' is not one of bf16, cudnn-bf16, fp8-dynamic, fp8-static, fp8-robust, each optionally followed "
          "by "
          "+fp8-linears",
          m);
  return modes;
}

std::vector<Resolution> parse_resolutions(const std::string& list) {
  std::vector<Resolution> res;
  for (const auto& r : split_list(list)) {
    auto it =
        std::find_if(kResolutions.begin(), kResolutions.end(), [&](const auto& x) { return std::get<0>(x) == r; });
    if (it == kResolutions.end()) fail("--resolutions: '{}' is not one of HD, FullHD, QHD, 4K", r);
    res.push_back(*it);
  }
  return res;
}

// What every timed forward shares.
struct Bench {
  const Args& a;
  const qwen3vl::Model& model;
  const std::vector<std::string>& modes;
  cudaStream_t s;
};

// One request: `images` copies of a resolution's grid packed into one batch, fixed random pixels.
struct Batch {
  std::vector<qwen3vl::GridThw> grids;
  int64_t tokens = 0;  // patches of all images (the encoder's tokens, before the merger)
  std::vector<float> px;
};

Batch make_batch(const qwen3vl::Model& model, const qwen3vl::GridThw& grid, int images) {
  Batch in;
  in.grids.assign(size_t(images), grid);
  for (auto& g : in.grids) in.tokens += int64_t(g[0]) * g[1] * g[2];
  in.px = random_values(in.tokens * model.config.patch_dim(), Dist::NORMAL, 7);
  for (auto& x : in.px) x = std::tanh(x);
  return in;
}

// Static scales as calibration writes them (dynamic scaling's rings x 1.5), from one dynamic forward.
std::vector<QkvScales> calibrate(const Bench& b, const Batch& in) {
  ScaleBook book = ScaleBook::dynamic(b.model.config.depth);
  qwen3vl::cuda::Encoder e(b.model, {AttnDtype::FP8, &book});
  e.plan(in.grids);
  e.upload_pixels(in.px, b.s);
  e.forward(b.s);
  e.sync_scales(b.s);
  return book.calibrated(kDefaultScaleMargin);
}

// The encoder a mode names; FP8 modes take their scales from `book`, fp8-robust its plan from `plan`.
qwen3vl::cuda::EncoderOptions encoder_options(const std::string& name, ScaleBook& book, Fp8Plan& plan) {
  const std::string mode = attention_mode(name);
  qwen3vl::cuda::EncoderOptions o;
  const bool bf16 = mode == "bf16" || mode == "cudnn-bf16";
  o.dtype = bf16 ? AttnDtype::BF16 : AttnDtype::FP8;
  o.scales = bf16 ? nullptr : &book;
  o.backend = mode == "cudnn-bf16" ? AttnBackend::CUDNN : AttnBackend::FOVEA;  // cudnn-bf16: the CUDNN backend
  o.fp8_linears = mode != name;
  if (mode == "fp8-robust") {  // the robust scheme, each layer's arrays from its own batch
    plan = Fp8Plan::robust_dynamic(book.mode(), book.num_layers());
    o.fp8_plan = &plan;
  }
  return o;
}

// Median ms of one forward replayed as a CUDA graph: the kernels alone, no launch overhead.
double graph_median_ms(const Bench& b, qwen3vl::cuda::Encoder& enc) {
  cuda::Graph g(b.s, [&] { enc.forward(b.s); });
  return cuda::median_ms([&] { g.launch(b.s); }, b.a.warmup, b.a.reps, b.s);
}

// Every mode on one resolution: a table row and a JSON row each.
void bench_resolution(const Bench& b, const Resolution& r, nlohmann::ordered_json& rows) {
  const auto& [res, desc, grid] = r;
  const Batch in = make_batch(b.model, grid, b.a.images);
  double bf16_ms = 0;
  // Static scales: from the dynamic run when there is one, else from one dynamic forward first.
  std::optional<std::vector<QkvScales>> calibrated;
  for (const std::string& mode : b.modes) {
    ScaleBook book = attention_mode(mode) == "fp8-static"
                         ? ScaleBook::fixed(calibrated ? *calibrated : calibrate(b, in))
                         : ScaleBook::dynamic(b.model.config.depth);
    Fp8Plan plan;
    qwen3vl::cuda::Encoder enc(b.model, encoder_options(mode, book, plan));
    enc.plan(in.grids);
    enc.upload_pixels(in.px, b.s);
    enc.forward(b.s);  // eager once: cuBLASLt picks algorithms outside the capture
    const double med = graph_median_ms(b, enc);
    if (mode == "bf16") bf16_ms = med;
    if (mode == "fp8-dynamic") {
      enc.sync_scales(b.s);
      calibrated = book.calibrated(kDefaultScaleMargin);
    }
    const std::string speedup = bf16_ms > 0 ? fmt::format("{:.2f}", bf16_ms / med) : "-";
    fmt::print("{:<7} | {:>7} | {:<23} | {:>10.2f} | {:>8}\n", res, in.tokens, mode, med, speedup);
    std::fflush(stdout);
    rows.push_back({{"resolution", res},
                    {"input", desc},
                    {"images", b.a.images},
                    {"tokens", in.tokens},
                    {"mode", mode},
                    {"median_ms", med}});
  }
}

int run(const Args& a) {
  const SystemInfo sys = query_system();
  if (auto why = backend_unsupported(AttnBackend::FOVEA, AttnDtype::FP8, Device::CUDA, sys))
    fail("bench encoder needs the FOVEA backend: {}", *why);
  if (a.images < 1) fail("--images-per-request must be >= 1, got {}", a.images);
  if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
  const std::vector<std::string> modes = parse_modes(a.modes);
  const std::vector<Resolution> res = parse_resolutions(a.resolutions);
  const Clock::time_point t0 = Clock::now();
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  fmt::print(
      "fovea bench encoder | {} | {} ({} blocks, hidden {}, head_dim {}) | {} images per request | loaded in {:.1f} "
      "s\n",
      sys.gpus.at(0).name, a.model, model.config.depth, model.config.hidden, model.config.head_dim(), a.images,
      seconds_since(t0));
  fmt::print("{:<7} | {:>7} | {:<23} | {:>10} | {:>8}\n", "res", "tokens", "mode", "median ms", "x bf16");
  const cuda::Stream s;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const Resolution& r : res) bench_resolution({a, model, modes, s}, r, rows);
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {
        {"bench", "encoder"}, {"model", a.model}, {"gpu", sys.gpus.at(0).name}, {"rows", rows}};
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
  cmd->add_option("--images-per-request", a->images, "images encoded together (one packed batch)")
      ->capture_default_str();
  cmd->add_option("--dtype", a->modes,
                  "comma list of bf16, cudnn-bf16 (the CUDNN backend), fp8-dynamic, fp8-static, fp8-robust (dynamic, "
                  "the scheme robust to outlier channels), each optionally with +fp8-linears "
                  "(the blocks' linears as FP8 GEMMs)")
      ->capture_default_str();
  cmd->add_option("--reps", a->reps, "timed graph replays (median reported)")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "untimed replays first")->capture_default_str();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
