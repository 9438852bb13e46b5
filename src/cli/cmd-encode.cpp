// fovea encode MODEL IMAGE... [-o out.safetensors]: image files to visual tokens. Decodes and
// preprocesses the images on several threads (docs/encoder.md), encodes every readable image in one packed
// forward (CPU or GPU, engine flags), writes each image's tokens, deepstack features and grid, and
// prints tokens and per-stage times. Unreadable images are reported and skipped; the exit code says
// whether any failed.
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
  image::PreprocessOverrides preprocess;  // 0: the checkpoint's preprocessor_config.json
  EngineOptions engine;
};

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t) { return std::chrono::duration<double, std::milli>(clock_type::now() - t).count(); }

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
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
  const std::vector<ImageTensors> out = split_images(EncoderRunner(model, cfg).run(batch), batch.grids, model.config);
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
    append_image_tensors(tensors, j, g, model.config, out[j]);
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
  add_preprocess_flags(cmd, a->preprocess);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
