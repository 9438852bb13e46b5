// fovea encode MODEL INPUT... [-o out.safetensors]: image files and video clips to visual tokens.
// Decodes and preprocesses the images on several threads (docs/encoder.md) and the clips (docs/video.md),
// encodes every readable input in one packed
// forward (CPU or GPU, engine flags), writes each image's tokens, deepstack features and grid (bf16
// as the encoder computes them, or fp32 with --output-dtype f32), and prints tokens and per-stage
// times. Unreadable images are reported and skipped; the exit code says whether any failed.
#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"
#include "fovea/safetensors.h"
#include "fovea/sha256.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model;
  std::vector<std::string> images;
  std::string out;
  std::string output_dtype = "bf16";
  std::string ec_path;              // --ec-storage-path: fill vLLM's encoder cache instead of -o
  int64_t ec_max_bytes = 0;         // --ec-storage-max-bytes (0: no bound)
  std::string uuid_from = "sha256";  // --uuid-from: sha256 (of the file's bytes) or filename
  int64_t max_batch_tokens = 16384;  // visual tokens per forward when filling the cache
  image::PreprocessOverrides preprocess;  // 0: the checkpoint's preprocessor_config.json
  video::VideoOverrides video;           // 0: the checkpoint's video_preprocessor_config.json
  EngineOptions engine;
};

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t) { return std::chrono::duration<double, std::milli>(clock_type::now() - t).count(); }

// Whether the file at `path` is a video clip: its first bytes say so (video::looks_like_video),
// whatever its name; false when it cannot be read (its decode then says why).
bool file_is_clip(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::array<char, 512> head{};
  f.read(head.data(), head.size());
  return video::looks_like_video({reinterpret_cast<const uint8_t*>(head.data()), size_t(f.gcount())});
}

// --ec-storage-path: every image's and clip's encoder outputs as vLLM's consumer reads them (fovea/ec-cache.h),
// keyed by the sha256 of the file's bytes or by its file name. Images already there are skipped;
// the rest are decoded a group at a time (the next group while the current one runs), packed into
// forwards of at most --max-batch-tokens and written as each forward ends, with a progress line per
// forward on stderr.
int fill_ec_cache(const Args& a, const EngineConfig& cfg, const image::PreprocessConfig& pcfg) {
  const video::VideoConfig vcfg = video::load_video_config(a.model, a.video);
  const video::VideoLimits vlim = video::limits_from(a.video);
  if (a.uuid_from != "sha256" && a.uuid_from != "filename")
    fail("encode: --uuid-from: '{}' is not one of sha256, filename", a.uuid_from);
  if (!a.out.empty()) fail("encode: -o and --ec-storage-path are two different outputs; give one of them");
  if (a.max_batch_tokens < 1) fail("encode: --max-batch-tokens must be at least 1, not {}", a.max_batch_tokens);
  const auto t0 = clock_type::now();
  EcCache cache(a.ec_path, a.ec_max_bytes);
  const size_t n = a.images.size();
  std::vector<std::string> keys(n);
  std::vector<size_t> todo;
  std::map<std::string, size_t> first;  // key -> the first image with it
  size_t cached = 0, repeated = 0, failed = 0, written = 0;
  const auto report_failure = [&](const std::string& why) {
    fmt::print(stderr, "fovea: error: {}\n", why);
    ++failed;
  };
  for (size_t i = 0; i < n; ++i) {
    try {
      keys[i] = a.uuid_from == "filename"
                    ? std::filesystem::path(a.images[i]).filename().string()
                    : [&] {
                        const std::string bytes =
                            read_file(a.images[i], "input", std::max(image::kMaxEncodedImageBytes, vlim.max_encoded_bytes));
                        return sha256_hex({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
                      }();
    } catch (const Error& e) {
      report_failure(e.what());
      continue;
    }
    if (const std::string why = ec_key_problem(keys[i]); !why.empty()) {
      report_failure(fmt::format("image '{}': its file name cannot be a cache key: {}", a.images[i], why));
      continue;
    }
    if (const auto [at, fresh] = first.emplace(keys[i], i); !fresh) {
      if (a.uuid_from == "filename")
        fmt::print(stderr, "fovea: warning: image '{}' has the same file name as '{}': only the first is cached under '{}'\n",
                   a.images[i], a.images[at->second], keys[i]);
      ++repeated;
      continue;
    }
    if (cache.lookup(keys[i])) {
      ++cached;
      continue;
    }
    todo.push_back(i);
  }
  fmt::print(stderr, "encoder cache {}: {} images, {} already there, {} repeated, {} to encode\n", a.ec_path, n, cached,
             repeated, todo.size());
  std::optional<qwen3vl::Model> model;
  std::optional<EncoderRunner> runner;
  if (!todo.empty()) {
    model.emplace(qwen3vl::load_model(a.model));
    runner.emplace(*model, cfg);
    runner->reserve(a.max_batch_tokens, /*with_deepstack=*/true);
  }
  constexpr size_t kGroup = 32;  // images decoded at once
  // A group's images decode in parallel (raw uint8 patches), then its clips one after another (fp32
  // patches; a forward holding both normalizes the images on the host).
  const auto prepare = [&](size_t from) {
    const size_t count = std::min(kGroup, todo.size() - from);
    std::vector<size_t> stills, clips;
    for (size_t j = 0; j < count; ++j) (file_is_clip(a.images[todo[from + j]]) ? clips : stills).push_back(j);
    std::vector<PreparedImage> images = prepare_images(
        stills.size(), [&](size_t k) { return image::decode_file(a.images[todo[from + stills[k]]], pcfg); }, pcfg, {}, true);
    std::vector<PreparedImage> out(count);
    for (size_t k = 0; k < stills.size(); ++k) out[stills[k]] = std::move(images[k]);
    for (const size_t j : clips) {
      try {
        video::Clip c = video::decode_clip_file(a.images[todo[from + j]], vcfg, vlim, pcfg);
        out[j].patches = std::move(c.patches);
        out[j].decode_ms = c.decode_ms;
        out[j].preprocess_ms = c.preprocess_ms;
      } catch (...) {
        out[j].error = std::current_exception();
      }
    }
    return out;
  };
  const auto started = clock_type::now();
  size_t encoded = 0;
  std::future<std::vector<PreparedImage>> next;
  if (!todo.empty()) next = std::async(std::launch::async, prepare, 0);
  for (size_t from = 0; from < todo.size(); from += kGroup) {
    std::vector<PreparedImage> group = next.get();
    if (from + kGroup < todo.size()) next = std::async(std::launch::async, prepare, from + kGroup);
    std::vector<size_t> ok;  // indices into group
    for (size_t j = 0; j < group.size(); ++j) {
      if (group[j].error) report_failure(group[j].error_message());
      else ok.push_back(j);
    }
    for (size_t b = 0; b < ok.size();) {  // forwards of at most max_batch_tokens (an image larger runs alone)
      std::vector<const image::Patches*> images;
      std::vector<qwen3vl::GridThw> grids;
      int64_t tokens = 0;
      size_t e = b;
      for (; e < ok.size(); ++e) {
        const image::Patches& p = group[ok[e]].patches;
        const int64_t t = image_tokens(model->config, p.grid);
        if (!images.empty() && tokens + t > a.max_batch_tokens) break;
        images.push_back(&p);
        grids.push_back(p.grid);
        tokens += t;
      }
      runner->start(images, true);
      const std::vector<ImageTensorsBf16> rows = split_images(runner->finish_views(), grids, model->config);
      for (size_t j = b; j < e; ++j) {
        cache.store(keys[todo[from + ok[j]]], rows[j - b], grids[j - b], model->config);
        ++written;
      }
      encoded += e - b;
      b = e;
      const double s = std::chrono::duration<double>(clock_type::now() - started).count();
      fmt::print(stderr, "encoder cache: {}/{} encoded, {} written, {} failed, {:.1f} images/s\n", encoded,
                 todo.size(), written, failed, s > 0 ? double(encoded) / s : 0.0);
    }
    for (PreparedImage& p : group) p = {};
  }
  const EcCache::Stats st = cache.stats();
  fmt::print("encoder cache {}: {} images: {} written, {} already there, {} repeated, {} failed; fovea's files {} "
             "({:.1f} MB), {} evicted, {} of other writers; {:.1f} s\n",
             a.ec_path, n, written, cached, repeated, failed, st.files, double(st.bytes) / 1e6, st.evictions, st.foreign_files,
             std::chrono::duration<double>(clock_type::now() - t0).count());
  return failed ? 1 : 0;
}

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
  if (!a.ec_path.empty()) {
    if (a.images.empty()) fail("encode: no images given");
    return fill_ec_cache(a, cfg, image::load_preprocess_config(a.model, a.preprocess));
  }
  if (a.output_dtype != "bf16" && a.output_dtype != "f32")
    fail("encode: --output-dtype: '{}' is not one of bf16, f32", a.output_dtype);
  const bool bf16 = a.output_dtype == "bf16";
  if (a.images.empty()) fail("encode: no images given");
  // Decoding and preprocessing run while the model loads and the encoder starts (weights to the
  // GPU). The GPU takes raw uint8 patches and normalizes them itself; the CPU's fp32 output
  // (--output-dtype f32 on the CPU) comes from fp32 patches, unrounded.
  const bool exact_f32 = !bf16 && cfg.device == Device::CPU;
  const image::PreprocessConfig pcfg = image::load_preprocess_config(a.model, a.preprocess);
  const video::VideoConfig vcfg = video::load_video_config(a.model, a.video);
  const video::VideoLimits vlim = video::limits_from(a.video);
  const size_t n = a.images.size();
  // Each file is read and its header probed first (milliseconds; a clip's packets are counted), so
  // the encoder's device and pinned buffers are sized for these inputs while they decode; a file
  // that cannot be read or probed is reported by its decode below. A file is a clip when its first
  // bytes say so (video::looks_like_video), whatever its name.
  std::vector<std::string> files(n);
  std::vector<bool> is_video(n, false);
  int64_t expected_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    try {
      files[i] = read_file(a.images[i], "input", std::max(image::kMaxEncodedImageBytes, vlim.max_encoded_bytes));
      const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(files[i].data()), files[i].size());
      is_video[i] = video::looks_like_video(bytes);
      if (is_video[i]) {
        const video::ClipPlan plan = video::plan_clip(video::probe_clip(bytes, a.images[i], vlim, pcfg), vcfg);
        expected_tokens += int64_t(plan.grid[0]) * plan.grid[1] * plan.grid[2] / (vcfg.merge * vcfg.merge);
        continue;
      }
      if (files[i].size() > image::kMaxEncodedImageBytes)
        fail("image '{}': {} bytes, over the limit of {}", a.images[i], files[i].size(), image::kMaxEncodedImageBytes);
      const image::ImageInfo info = image::probe(bytes, a.images[i], pcfg);
      const qwen3vl::GridThw g = image::resized_grid(info.height, info.width, pcfg);
      expected_tokens += int64_t(g[1]) * g[2] / (pcfg.merge * pcfg.merge);
    } catch (const Error&) {
      if (!is_video[i]) std::string().swap(files[i]);
    }
  }
  const bool any_video = std::find(is_video.begin(), is_video.end(), true) != is_video.end();
  std::vector<video::Clip> clips(n);  // the clips' sampling and timestamps (their patches move to `prepared`)
  auto preparing = std::async(std::launch::async, [&] {
    std::vector<size_t> still;
    for (size_t i = 0; i < n; ++i)
      if (!is_video[i]) still.push_back(i);
    const auto decode = [&](size_t k) {
      const size_t i = still[k];
      if (files[i].empty()) return image::decode_file(a.images[i], pcfg);  // its error, as decoding words it
      image::Rgb8 img = image::decode_memory({reinterpret_cast<const uint8_t*>(files[i].data()), files[i].size()},
                                             a.images[i], pcfg);
      std::string().swap(files[i]);
      return img;
    };
    // A batch is all raw uint8 patches or all fp32 ones; clips are fp32 (their frames differ over
    // each temporal patch), so with a clip the images are too.
    std::vector<PreparedImage> images = prepare_images(still.size(), decode, pcfg, {}, !exact_f32 && !any_video);
    std::vector<PreparedImage> out(n);
    for (size_t k = 0; k < still.size(); ++k) out[still[k]] = std::move(images[k]);
    for (size_t i = 0; i < n; ++i) {
      if (!is_video[i]) continue;
      try {
        video::Clip c = video::decode_clip({reinterpret_cast<const uint8_t*>(files[i].data()), files[i].size()}, a.images[i],
                                           vcfg, vlim, pcfg);
        std::string().swap(files[i]);
        out[i].patches = std::move(c.patches);
        out[i].decode_ms = c.decode_ms;
        out[i].preprocess_ms = c.preprocess_ms;
        clips[i] = std::move(c);
        fmt::print(stderr, "video {}: {} frames at {:.3g} fps ({:.1f} s, {} {}), {} sampled, {} decoded\n", a.images[i],
                   clips[i].info.frames, clips[i].info.fps, clips[i].info.seconds, clips[i].info.container, clips[i].info.codec,
                   clips[i].indices.size(), clips[i].frames_decoded);
      } catch (...) {
        out[i].error = std::current_exception();
      }
    }
    return out;
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
  if (ok.empty()) fail("encode: none of the {} input(s) could be read", n);

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
  // Outputs by kind: image.<j> over the images, video.<k> over the clips (with their timestamps),
  // each counted in input order.
  fmt::print("{:<9} {:<40} {:>14} {:>8} {:>10} {:>12}\n", "input", "file", "grid_thw", "tokens", "decode ms",
             "preprocess ms");
  std::vector<std::vector<float>> stamps;  // kept alive until the write
  stamps.reserve(ok.size());
  size_t images_out = 0, videos_out = 0;
  for (size_t j = 0; j < ok.size(); ++j) {
    const size_t i = ok[j];
    const auto& g = grids[j];
    const char* kind = is_video[i] ? "video" : "image";
    const size_t k = is_video[i] ? videos_out++ : images_out++;
    if (bf16)
      append_image_tensors(tensors, k, g, model.config, bf16_rows[j], kind);
    else
      append_image_tensors(tensors, k, g, model.config, f32_rows[j], kind);
    const std::string p = fmt::format("{}.{}", kind, k);
    meta[p + ".file"] = a.images[i];
    if (is_video[i]) {
      const video::Clip& c = clips[i];
      stamps.emplace_back(c.timestamps.begin(), c.timestamps.end());
      TensorToWrite ts{p + ".timestamps", DType::F32, {int64_t(stamps.back().size())}, {}, {}};
      ts.view = {reinterpret_cast<const uint8_t*>(stamps.back().data()), stamps.back().size() * sizeof(float)};
      tensors.push_back(std::move(ts));
      meta[p + ".fps"] = fmt::format("{}", c.info.fps);
      meta[p + ".frame_indices"] = fmt::format("[{}]", fmt::join(c.indices, ", "));
    }
    fmt::print("{:<9} {:<40} {:>14} {:>8} {:>10.1f} {:>12.1f}\n", p, a.images[i], fmt::format("({}, {}, {})", g[0], g[1], g[2]),
               image_tokens(model.config, g), prepared[i].decode_ms, prepared[i].preprocess_ms);
  }
  fmt::print("model load {:.1f} ms | encoder setup {:.1f} ms | encoder forward ({} inputs, {} patches, {}{} on {}) {:.1f} ms: "
             "plan {:.1f}, upload {:.1f}, forward {:.1f}, download {:.1f}\n",
             load_ms, setup_ms, ok.size(), patches, dtype_name(cfg.dtype), cfg.fp8_linears ? ", fp8 linears" : "",
             device_name(cfg.device), forward_ms, rt.plan,
             rt.upload, rt.forward, rt.download);
  if (!a.out.empty()) {
    const auto tw = clock_type::now();
    write_safetensors(a.out, tensors, meta);
    size_t bytes = 0;
    for (const TensorToWrite& t : tensors) bytes += t.data().size();
    fmt::print("wrote {} ({:.1f} MB of tensors in {:.1f} ms)\n", a.out, double(bytes) / 1e6, ms_since(tw));
  }
  if (ok.size() < n) {
    fmt::print(stderr, "fovea: {} of {} input(s) failed\n", n - ok.size(), n);
    return 1;
  }
  return 0;
}

}  // namespace

void add_encode(CLI::App& app, Runner& runner) {
  auto* cmd = app.add_subcommand("encode", "image files and video clips to visual tokens (and deepstack features)");
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("INPUT", a->images, "images (JPEG, PNG, WebP, BMP, GIF) and video clips (MP4/MOV, WebM/MKV, AVI, ...)")
      ->required();
  cmd->add_option("-o,--output", a->out, "write tokens, deepstack features and grid_thw to this safetensors file");
  cmd->add_option("--output-dtype", a->output_dtype,
                  "dtype of the written tokens and deepstack features: bf16 (what the encoder computes and an LLM "
                  "consumes) or f32")
      ->capture_default_str();
  cmd->add_option("--ec-storage-path", a->ec_path,
                  "fill vLLM's encoder cache in this folder (its ECExampleConnector's shared_storage_path): "
                  "DIR/<key>/encoder_cache.safetensors per image, skipping images already there");
  cmd->add_option("--ec-storage-max-bytes", a->ec_max_bytes,
                  "bound the bytes of the cache files fovea wrote there, least recently used first (0: none)")
      ->capture_default_str();
  cmd->add_option("--uuid-from", a->uuid_from,
                  "each image's key (the uuid a client sends to vLLM): sha256 (hex, of the file's bytes) or filename")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", a->max_batch_tokens, "visual tokens per forward when filling the cache")
      ->capture_default_str();
  add_preprocess_flags(cmd, a->preprocess);
  add_video_flags(cmd, a->video);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
