// fovea bench calibration: "calibrated on one set, holds on another". Calibrates FP8 scales with
// dynamic scaling on the first images of a folder (16 forwards), then encodes the other images with
// BF16, FP8-dynamic and FP8-static (the calibrated file) and reports, per image and overall, each
// FP8 mode's final embeddings against BF16: mean per-token cosine and relative L2 error. With
// --fp8-linears the FP8 modes also run the blocks' linears in FP8.

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
  std::string model, path, json_path, scale_path = "calibrated-scales.json";
  int calibration_images = 4, images = 1;
  int64_t max_pixels = 0;
  EngineOptions engine;  // device / backend; dtype and scale options are set per mode
};

int run(const Args& a) {
  const std::vector<std::string> files = image::list_images(a.path, "--dataset-path");
  if (a.calibration_images < 1) fail("--calibration-images must be >= 1");
  if (int(files.size()) <= a.calibration_images)
    fail("--dataset-path '{}' has {} images; need more than --calibration-images {} to hold some out", a.path,
         files.size(), a.calibration_images);
  const SystemInfo sys = query_system();
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  const image::PreprocessConfig pcfg = image::load_preprocess_config(a.model, {0, a.max_pixels});
  auto load = [&](const std::string& f) {
    Batch b;
    b.add(image::preprocess(image::decode_file(f, pcfg), pcfg));
    return b;
  };
  auto config = [&](const std::string& dtype, const std::string& scale, const std::string& save) {
    EngineOptions o = a.engine;
    o.dtype = dtype;
    o.scale_path = scale;
    o.scale_save_path = save;
    o.fp8_linears = a.engine.fp8_linears && dtype == "fp8";  // the BF16 reference keeps BF16 linears
    if (dtype != "fp8") o.fp8_scheme = "auto";                // and has no FP8 scheme
    return resolve_engine(o, sys);
  };

  // 1. Calibrate on the first images, cycling through them until 16 forwards have run.
  {
    const EngineConfig cfg = config("fp8", "", a.scale_path);
    EncoderRunner runner(model, cfg);
    for (int i = 0; !runner.book()->calibration_written(); ++i) {
      runner.run(load(files[size_t(i % a.calibration_images)]));
      if (i > 10 * kAmaxHistoryLen) fail("calibration did not complete");  // cannot happen: 16 forwards write
    }
  }
  fmt::print("calibrated on {} image(s) of {} -> {}\n", a.calibration_images, a.path, a.scale_path);

  // 2. The held-out images: BF16 reference, FP8 dynamic, FP8 static.
  const EngineConfig bf = config("bf16", "", ""), dyn = config("fp8", "", ""), st = config("fp8", a.scale_path, "");
  EncoderRunner r_bf(model, bf), r_dyn(model, dyn), r_st(model, st);
  const int O = model.config.out_hidden;
  fmt::print("{:<40} | {:>7} | {:>12} | {:>12} | {:>12} | {:>12}\n", "held-out image", "tokens", "dyn cosine", "dyn rel_l2",
             "static cos", "static rel_l2");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  double sums[4] = {0, 0, 0, 0};
  int count = 0;
  for (size_t i = size_t(a.calibration_images); i < files.size(); ++i) {
    const Batch b = load(files[i]);
    const auto ref = r_bf.run(b).merged;
    const auto dyn_err = qwen3vl::embedding_error(r_dyn.run(b).merged, ref, O);
    const auto st_err = qwen3vl::embedding_error(r_st.run(b).merged, ref, O);
    const double cd = dyn_err.mean_cosine, ed = dyn_err.rel_l2, cs = st_err.mean_cosine, es = st_err.rel_l2;
    fmt::print("{:<40} | {:>7} | {:>12.6f} | {:>12.3e} | {:>12.6f} | {:>12.3e}\n", files[i], ref.size() / size_t(O), cd, ed, cs, es);
    rows.push_back({{"image", files[i]}, {"dynamic_cosine", cd}, {"dynamic_rel_l2", ed}, {"static_cosine", cs}, {"static_rel_l2", es}});
    sums[0] += cd, sums[1] += ed, sums[2] += cs, sums[3] += es;
    ++count;
  }
  fmt::print("{:<40} | {:>7} | {:>12.6f} | {:>12.3e} | {:>12.6f} | {:>12.3e}\n", "mean over held-out images", "", sums[0] / count,
             sums[1] / count, sums[2] / count, sums[3] / count);
  if (!a.json_path.empty())
    write_file_atomic(a.json_path,
                      nlohmann::ordered_json({{"model", a.model}, {"calibration_images", a.calibration_images},
                                              {"device", device_name(bf.device)}, {"rows", rows}})
                              .dump(2) + "\n",
                      "--output-json");
  return 0;
}

}  // namespace

void add_bench_calibration(CLI::App* bench, Runner& runner) {
  auto* cmd = bench->add_subcommand("calibration", "calibrate FP8 scales on some images, check static and dynamic FP8 against BF16 on the others");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--dataset-path", a->path, "folder of images: the first --calibration-images calibrate, the rest are held out")->required();
  cmd->add_option("--calibration-images", a->calibration_images, "images used for calibration")->capture_default_str();
  cmd->add_option("--scale-file", a->scale_path, "where the calibrated scales are written")->capture_default_str();
  cmd->add_option("--max-pixels", a->max_pixels, "resize budget override (default: the checkpoint's)");
  cmd->add_option("--output-json", a->json_path, "write the per-image results as JSON");
  cmd->add_option("--device", a->engine.device, "cuda or cpu (default: cuda when a GPU is visible)");
  cmd->add_option("--mm-encoder-attn-backend", a->engine.backend, "attention backend")->capture_default_str();
  cmd->add_flag("--fp8-linears", a->engine.fp8_linears,
                "the FP8 modes (calibration included) also run the blocks' linears in FP8; the BF16 reference does not");
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
