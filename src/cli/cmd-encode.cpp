// fovea encode MODEL IMAGE... [-o out.safetensors]: image files to visual tokens. Decodes and
// preprocesses the images on several threads (docs/encoder.md), encodes every readable image in one packed
// forward (CPU or GPU, engine flags), writes each image's tokens, deepstack features and grid (bf16
// as the encoder computes them, or fp32 with --output-dtype f32), and prints tokens and per-stage
// times. Unreadable images are reported and skipped; the exit code says whether any failed.
#include <chrono>
#include <future>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
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
  // Decoding and preprocessing run while the model loads and the encoder starts (weights to the
  // GPU). The GPU takes raw uint8 patches and normalizes them itself; the CPU's fp32 output
  // (--output-dtype f32 on the CPU) comes from fp32 patches, unrounded.
  const bool exact_f32 = !bf16 && cfg.device == Device::CPU;
  const image::PreprocessConfig pcfg = image::load_preprocess_config(a.model, a.preprocess);
  const size_t n = a.images.size();
  // Each file is read and its header probed first (milliseconds), so the encoder's device and
  // pinned buffers are sized for these images while they decode; a file that cannot be read or
  // probed is reported by its decode below.
  std::vector<std::string> files(n);
  int64_t expected_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    try {
      files[i] = read_file(a.images[i], "image", image::kMaxEncodedImageBytes);
      const image::ImageInfo info =
          image::probe({reinterpret_cast<const uint8_t*>(files[i].data()), files[i].size()}, a.images[i], pcfg);
      const auto [h, w] = image::smart_resize(info.height, info.width, pcfg.patch * pcfg.merge, pcfg.min_pixels,
                                              pcfg.max_pixels);
      expected_tokens += int64_t(h / (pcfg.patch * pcfg.merge)) * (w / (pcfg.patch * pcfg.merge));
    } catch (const Error&) {
      std::string().swap(files[i]);
    }
  }
  auto preparing = std::async(std::launch::async, [&] {
    const auto decode = [&](size_t i) {
      if (files[i].empty()) return image::decode_file(a.images[i], pcfg);  // its error, as decoding words it
      image::Rgb8 img = image::decode_memory({reinterpret_cast<const uint8_t*>(files[i].data()), files[i].size()},
                                             a.images[i], pcfg);
      std::string().swap(files[i]);
      return img;
    };
    return prepare_images(n, decode, pcfg, {}, !exact_f32);
  });
  std::optional<qwen3vl::Model> model_storage;
  std::optional<EncoderRunner> runner_storage;
  double load_ms = 0, setup_ms = 0;
  try {
    auto t0 = clock_type::now();
    model_storage.emplace(qwen3vl::load_model(a.model));
    load_ms = ms_since(t0);
    t0 = clock_type::now();
    runner_storage.emplace(*model_storage, cfg);
    runner_storage->reserve(expected_tokens, /*with_deepstack=*/true, /*batches=*/1);
    setup_ms = ms_since(t0);
  } catch (...) {
    preparing.wait();  // its threads use a.images and pcfg
    throw;
  }
  const qwen3vl::Model& model = *model_storage;
  EncoderRunner& runner = *runner_storage;
  std::vector<PreparedImage> prepared = preparing.get();

  std::vector<size_t> ok;
  std::vector<const image::Patches*> images;
  std::vector<qwen3vl::GridThw> grids;
  for (size_t i = 0; i < n; ++i) {
    if (prepared[i].error) {
      fmt::print(stderr, "fovea: error: {}\n", prepared[i].error_message());
      continue;
    }
    ok.push_back(i);
    images.push_back(&prepared[i].patches);
    grids.push_back(prepared[i].patches.grid);
  }
  if (ok.empty()) fail("encode: none of the {} image(s) could be read", n);

  const auto tf = clock_type::now();
  // The encoder's bits as they are (the CPU's fp32 rounded to nearest), as views of where they
  // landed (pinned memory on the GPU: no copy); written from there.
  std::vector<ImageTensorsBf16> bf16_rows;
  std::vector<ImageTensors> f32_rows;
  if (exact_f32) {
    Batch batch;
    for (size_t i : ok) batch.add(std::move(prepared[i].patches));
    f32_rows = split_images(runner.run(batch), grids, model.config);
  } else {
    runner.start(images, true);
    const EncoderOutputsView out = runner.finish_views();
    if (bf16) {
      bf16_rows = split_images(out, grids, model.config);
    } else {  // fp32 asked for: the bf16 values widened, exactly
      EncoderOutputs wide;
      wide.merged = widen_bf16(out.merged);
      for (const auto& d : out.deepstack) wide.deepstack.push_back(widen_bf16(d));
      f32_rows = split_images(std::move(wide), grids, model.config);
    }
  }
  const double forward_ms = ms_since(tf);
  const EncoderRunner::Timings& rt = runner.last_timings();
  int64_t patches = 0;
  for (const auto& g : grids) patches += int64_t(g[0]) * g[1] * g[2];

  // Per image: its rows of the merged tokens and of each deepstack output.
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta = {{"model", a.model}, {"dtype", dtype_name(cfg.dtype)},
                                             {"device", device_name(cfg.device)}};
  fmt::print("{:<5} {:<40} {:>14} {:>8} {:>10} {:>12}\n", "image", "file", "grid_thw", "tokens", "decode ms",
             "preprocess ms");
  for (size_t j = 0; j < ok.size(); ++j) {
    const size_t i = ok[j];
    const auto& g = grids[j];
    if (bf16)
      append_image_tensors(tensors, j, g, model.config, bf16_rows[j]);
    else
      append_image_tensors(tensors, j, g, model.config, f32_rows[j]);
    meta["image." + std::to_string(j) + ".file"] = a.images[i];
    fmt::print("{:<5} {:<40} {:>14} {:>8} {:>10.1f} {:>12.1f}\n", j, a.images[i], fmt::format("({}, {}, {})", g[0], g[1], g[2]),
               image_tokens(model.config, g), prepared[i].decode_ms, prepared[i].preprocess_ms);
  }
  fmt::print("model load {:.1f} ms | encoder setup {:.1f} ms | encoder forward ({} images, {} patches, {} on {}) {:.1f} ms: "
             "plan {:.1f}, upload {:.1f}, forward {:.1f}, download {:.1f}\n",
             load_ms, setup_ms, ok.size(), patches, dtype_name(cfg.dtype), device_name(cfg.device), forward_ms, rt.plan,
             rt.upload, rt.forward, rt.download);
  if (!a.out.empty()) {
    const auto tw = clock_type::now();
    write_safetensors(a.out, tensors, meta);
    size_t bytes = 0;
    for (const TensorToWrite& t : tensors) bytes += t.data().size();
    fmt::print("wrote {} ({:.1f} MB of tensors in {:.1f} ms)\n", a.out, double(bytes) / 1e6, ms_since(tw));
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
