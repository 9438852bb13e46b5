// fovea encode MODEL IMAGE... [-o out.safetensors]: image files to visual tokens. Decodes and
// preprocesses the images on several threads (docs/encoder.md), encodes every readable image in one packed
// forward (CPU or GPU, engine flags), writes each image's tokens, deepstack features and grid (bf16
// as the encoder computes them, or fp32 with --output-dtype f32), and prints tokens and per-stage
// times. Unreadable images are reported and skipped; the exit code says whether any failed.
#include <chrono>
#include <map>

#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/pipeline.h"
#include "fovea/safetensors.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model;
  std::vector<std::string> images;
  std::string out;
  std::string output_dtype = "bf16";
  image::PreprocessOverrides preprocess;  // 0: the checkpoint's preprocessor_config.json
  EngineOptions engine;
};

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t) { return std::chrono::duration<double, std::milli>(clock_type::now() - t).count(); }

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
  if (a.output_dtype != "bf16" && a.output_dtype != "f32")
    fail("encode: --output-dtype: '{}' is not one of bf16, f32", a.output_dtype);
  const bool bf16 = a.output_dtype == "bf16";
  if (a.images.empty()) fail("encode: no images given");
  auto t0 = clock_type::now();
  const qwen3vl::Model model = qwen3vl::load_model(a.model);
  const double load_ms = ms_since(t0);
  const image::PreprocessConfig pcfg =
      image::load_preprocess_config(a.model, a.preprocess);

  // Decode + preprocess every image in parallel; failures are kept per image.
  const size_t n = a.images.size();
  std::vector<PreparedImage> prepared =
      prepare_images(n, [&](size_t i) { return image::decode_file(a.images[i], pcfg); }, pcfg);
  std::vector<size_t> ok;
  Batch batch;
  for (size_t i = 0; i < n; ++i) {
    if (prepared[i].error) {
      fmt::print(stderr, "fovea: error: {}\n", prepared[i].error_message());
      continue;
    }
    ok.push_back(i);
    batch.add(std::move(prepared[i].patches));
  }
  if (ok.empty()) fail("encode: none of the {} image(s) could be read", n);

  const auto tf = clock_type::now();
  EncoderRunner runner(model, cfg);
  EncoderOutputsBf16 bf16_out;  // bf16: the encoder's bits as they are (the CPU's fp32 rounded to nearest)
  std::vector<ImageTensorsBf16> bf16_rows;  // views into bf16_out
  std::vector<ImageTensors> f32_rows;
  if (bf16) {
    bf16_out = runner.run_bf16(batch);
    bf16_rows = split_images(bf16_out, batch.grids, model.config);
  } else {
    f32_rows = split_images(runner.run(batch), batch.grids, model.config);
  }
  const double forward_ms = ms_since(tf);

  // Per image: its rows of the merged tokens and of each deepstack output.
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta = {{"model", a.model}, {"dtype", dtype_name(cfg.dtype)},
                                             {"device", device_name(cfg.device)}};
  fmt::print("{:<5} {:<40} {:>14} {:>8} {:>10} {:>12}\n", "image", "file", "grid_thw", "tokens", "decode ms",
             "preprocess ms");
  for (size_t j = 0; j < ok.size(); ++j) {
    const size_t i = ok[j];
    const auto& g = batch.grids[j];
    if (bf16)
      append_image_tensors(tensors, j, g, model.config, bf16_rows[j]);
    else
      append_image_tensors(tensors, j, g, model.config, f32_rows[j]);
    meta["image." + std::to_string(j) + ".file"] = a.images[i];
    fmt::print("{:<5} {:<40} {:>14} {:>8} {:>10.1f} {:>12.1f}\n", j, a.images[i], fmt::format("({}, {}, {})", g[0], g[1], g[2]),
               image_tokens(model.config, g), prepared[i].decode_ms, prepared[i].preprocess_ms);
  }
  fmt::print("model load {:.1f} ms | encoder forward ({} images, {} patches, {} on {}) {:.1f} ms\n", load_ms, ok.size(),
             batch.pixels.size() / size_t(model.config.patch_dim()), dtype_name(cfg.dtype), device_name(cfg.device), forward_ms);
  if (!a.out.empty()) {
    write_safetensors(a.out, tensors, meta);
    fmt::print("wrote {}\n", a.out);
  }
  if (ok.size() < n) {
    fmt::print(stderr, "fovea: {} of {} image(s) failed\n", n - ok.size(), n);
    return 1;
  }
  return 0;
}

}  // namespace

void add_encode(CLI::App& app, Runner& runner) {
  auto* cmd = app.add_subcommand("encode", "image files to visual tokens (and deepstack features)");
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("IMAGE", a->images, "JPEG, PNG, WebP, BMP or GIF files")->required();
  cmd->add_option("-o,--output", a->out, "write tokens, deepstack features and grid_thw to this safetensors file");
  cmd->add_option("--output-dtype", a->output_dtype,
                  "dtype of the written tokens and deepstack features: bf16 (what the encoder computes and an LLM "
                  "consumes) or f32")
      ->capture_default_str();
  add_preprocess_flags(cmd, a->preprocess);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
