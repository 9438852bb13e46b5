// fovea encode MODEL INPUT... [-o out.safetensors | --ec-storage-path DIR]: image files and video
// clips to visual tokens. The engine (fovea/pipeline.h) reads, decodes and preprocesses the inputs
// while the model loads, encodes every readable one in one packed forward (CPU or GPU, engine flags)
// and gives each one's tokens, deepstack features and grid (bf16 as the encoder computes them, or
// fp32 with --output-dtype f32); this command prints tokens and per-stage times and writes the file.
// Unreadable inputs are reported and skipped; the exit code says whether any failed.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <span>

#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/clock.h"
#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/safetensors.h"
#include "fovea/serve.h"
#include "fovea/sha256.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model;
  std::vector<std::string> inputs;
  std::string out;
  std::string output_dtype = "bf16";
  std::string dump_dir;              // --dump-dir: the CPU forward's intermediates (write_intermediates)
  std::string ec_path;               // --ec-storage-path: fill vLLM's encoder cache instead of -o
  int64_t ec_max_bytes = 0;          // --ec-storage-max-bytes (0: no bound)
  double ec_min_age_s = 300;         // --ec-storage-min-age (0: no protection)
  std::string uuid_from = "sha256";  // --uuid-from: sha256, filename, data-url or file-url (cache_key)
  std::string mm_processor_kwargs, media_io_kwargs;  // vLLM's flags: JSON, applied and hashed as serve does
  std::string model_id;              // --served-model-name: the model id vLLM hashes with the kwargs (default MODEL)
  int64_t max_batch_tokens = 16384;  // visual tokens per forward when filling the cache
  image::PreprocessOverrides preprocess;  // 0: the checkpoint's preprocessor_config.json
  video::VideoOverrides video;            // 0: the checkpoint's video_preprocessor_config.json
  EngineOptions engine;
};

// Each input's bytes and the visual tokens the readable ones will give, from their headers: the
// encoder's buffers are sized for these inputs while they decode. A file that cannot be read or
// probed is left for prepare_inputs, whose error names it.
struct Files {
  std::vector<std::vector<uint8_t>> bytes;
  int64_t tokens = 0;
};
Files read_inputs(const std::vector<std::string>& paths, const InputConfig& in) {
  Files f;
  f.bytes.resize(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) {
    try {
      f.bytes[i] = read_input(paths[i], in);
      f.tokens += probe_input(f.bytes[i], paths[i], in).tokens;
    } catch (const Error&) {}
  }
  return f;
}

// The files as prepare_inputs reads them: the bytes read already (then freed), or the file again
// (whose read then fails, naming it).
std::vector<PreparedInput> prepare_files(const std::vector<std::string>& paths,
                                         std::vector<std::vector<uint8_t>>& bytes, const InputConfig& in) {
  std::vector<PreparedInput> out = prepare_inputs(
      paths, [&](size_t i) { return bytes[i].empty() ? read_input(paths[i], in) : std::move(bytes[i]); }, in);
  for (size_t i = 0; i < out.size(); ++i)
    if (const auto& clip = out[i].clip)
      fmt::print(stderr, "video {}: {} frames sampled at {:.3g} fps, {} decoded\n", paths[i],
                 clip->frame_indices.size(), clip->fps, out[i].frames_decoded);
  return out;
}

// The media type a client names a file by in its data URL: Python's mimetypes.guess_type for the
// extension ("" if it is not one of these).
std::string media_type_of(const std::filesystem::path& p) {
  static const std::map<std::string, std::string> types = {
      {".jpg", "image/jpeg"},      {".jpeg", "image/jpeg"},     {".png", "image/png"},   {".gif", "image/gif"},
      {".webp", "image/webp"},     {".bmp", "image/bmp"},       {".tif", "image/tiff"},  {".tiff", "image/tiff"},
      {".mp4", "video/mp4"},       {".mov", "video/quicktime"}, {".webm", "video/webm"}, {".avi", "video/x-msvideo"},
      {".mkv", "video/x-matroska"}};
  std::string ext = p.extension().string();
  for (char& ch : ext) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  const auto it = types.find(ext);
  return it == types.end() ? "" : it->second;
}

// "file://" and the absolute path, percent-encoded as Python's pathlib.Path.as_uri() writes it
// (letters, digits, "_.-~/" kept).
std::string file_url(const std::filesystem::path& p) {
  std::string out = "file://";
  for (const char ch : std::filesystem::absolute(p).string()) {
    const auto u = static_cast<unsigned char>(ch);
    if (std::isalnum(u) || std::strchr("_.-~/", ch))
      out += ch;
    else
      out += fmt::format("%{:02X}", u);
  }
  return out;
}

// --ec-storage-path: each input's key (--uuid-from): the sha256 of the file's bytes; its file name;
// or the sha256 of the URL a client sends for it, which vLLM's EPD proxy takes as the key: a data URL
// of the file (data-url) or its file:// URL (file-url, for a server with --allowed-local-media-path).
std::string uuid_of(const Args& a, size_t i, const InputConfig& in) {
  const std::filesystem::path path(a.inputs[i]);
  if (a.uuid_from == "filename") return path.filename().string();
  const auto hash = [](const std::string& s) { return sha256_hex(s); };
  if (a.uuid_from == "file-url") return hash(file_url(path));
  const std::vector<uint8_t> bytes = read_input(a.inputs[i], in);
  if (a.uuid_from == "sha256") return sha256_hex(bytes);
  return data_url_key(media_type_of(path), bytes);  // a known type: fill_ec_cache checked
}

// The key vLLM's consumer looks for: the uuid, hashed with the kwargs and the model id when they say
// something for the input's kind (vllm_mm_hash), as fovea serve keys it.
std::string cache_key(const Args& a, size_t i, const InputConfig& in) {
  const MmKwargs k = parse_mm_kwargs(a.mm_processor_kwargs, a.media_io_kwargs);
  const std::string uuid = uuid_of(a, i, in);
  if (k.empty()) return uuid;
  return vllm_mm_hash(a.model_id.empty() ? a.model : a.model_id, file_input_kind(a.inputs[i]), uuid, k);
}

struct CacheWork {
  std::vector<std::string> keys;
  std::vector<size_t> todo;  // inputs to encode
  size_t cached = 0, repeated = 0, failed = 0, written = 0;
  void failure(const std::string& why) {
    fmt::print(stderr, "fovea: error: {}\n", why);
    ++failed;
  }
};

// Keys every input; those already cached or repeated are skipped.
CacheWork plan_cache_fill(const Args& a, EcCache& cache, const InputConfig& in) {
  CacheWork w;
  w.keys.resize(a.inputs.size());
  std::map<std::string, size_t> first;  // key -> the first input with it
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    try {
      w.keys[i] = cache_key(a, i, in);
    } catch (const Error& e) {
      w.failure(e.what());
      continue;
    }
    if (const std::string why = ec_key_problem(w.keys[i]); !why.empty()) {
      w.failure(fmt::format("input '{}': its file name cannot be a cache key: {}", a.inputs[i], why));
      continue;
    }
    if (const auto [at, fresh] = first.emplace(w.keys[i], i); !fresh) {
      if (a.uuid_from == "filename")
        fmt::print(stderr,
                   "fovea: warning: input '{}' has the same file name as '{}': only the first is cached under '{}'\n",
                   a.inputs[i], a.inputs[at->second], w.keys[i]);
      ++w.repeated;
      continue;
    }
    if (cache.lookup(w.keys[i])) {
      ++w.cached;
      continue;
    }
    w.todo.push_back(i);
  }
  return w;
}

constexpr size_t kGroup = 32;  // inputs prepared at once when filling the cache

// One group's inputs prepared (todo[from, from + kGroup)).
std::vector<PreparedInput> prepare_group(const Args& a, const CacheWork& w, size_t from, const InputConfig& in) {
  std::vector<std::string> paths;
  for (size_t j = from; j < std::min(from + kGroup, w.todo.size()); ++j) paths.push_back(a.inputs[w.todo[j]]);
  std::vector<std::vector<uint8_t>> none(paths.size());
  return prepare_files(paths, none, in);
}

// One group's forwards, each written to the cache as it ends, with a progress line per forward.
void encode_group(const Args& a, EncoderRunner& runner, const qwen3vl::VisionConfig& vc, EcCache& cache, CacheWork& w,
                  size_t from, std::vector<PreparedInput>& group, size_t& encoded, Clock::time_point started) {
  std::vector<size_t> ok;  // indices into group
  std::vector<int64_t> tokens;
  for (size_t j = 0; j < group.size(); ++j) {
    if (group[j].error) {
      w.failure(group[j].error_message());
      continue;
    }
    ok.push_back(j);
    tokens.push_back(visual_tokens(vc, group[j].patches.grid));
  }
  for (const auto& [b, e] : pack_forwards(tokens, a.max_batch_tokens)) {
    std::vector<const image::Patches*> inputs;
    std::vector<qwen3vl::GridThw> grids;
    for (size_t k = b; k < e; ++k) {
      inputs.push_back(&group[ok[k]].patches);
      grids.push_back(group[ok[k]].patches.grid);
    }
    runner.start(inputs, true);
    const std::vector<Bf16Rows> rows = split_inputs(runner.finish_views(), grids, vc);
    for (size_t k = b; k < e; ++k, ++w.written)
      cache.store(w.keys[w.todo[from + ok[k]]], rows[k - b], grids[k - b], vc);
    encoded += e - b;
    const double s = seconds_since(started);
    fmt::print(stderr, "encoder cache: {}/{} encoded, {} written, {} failed, {:.1f} inputs/s\n", encoded, w.todo.size(),
               w.written, w.failed, s > 0 ? double(encoded) / s : 0.0);
  }
}

// --ec-storage-path: every input's encoder outputs as vLLM's consumer reads them (fovea/ec-cache.h).
// Inputs already there are skipped; the rest are prepared a group at a time (the next group while
// the current one runs), packed into forwards of at most --max-batch-tokens and written as each
// forward ends.
int fill_ec_cache(const Args& a, const EngineConfig& cfg) {
  if (a.uuid_from != "sha256" && a.uuid_from != "filename" && a.uuid_from != "data-url" && a.uuid_from != "file-url")
    fail("encode: --uuid-from: '{}' is not one of sha256, filename, data-url, file-url", a.uuid_from);
  for (const std::string& p : a.inputs)
    if (a.uuid_from == "data-url" && media_type_of(p).empty())
      fail(
          "encode: --uuid-from data-url: input '{}': its data URL's media type comes from its extension, and '{}' is "
          "not one it knows (.jpg .jpeg .png .gif .webp .bmp .tif .tiff .mp4 .mov .webm .avi .mkv)",
          p, std::filesystem::path(p).extension().string());
  if (!a.out.empty()) fail("encode: -o and --ec-storage-path are two different outputs; give one of them");
  if (a.max_batch_tokens < 1) fail("encode: --max-batch-tokens must be at least 1, not {}", a.max_batch_tokens);
  const auto t0 = Clock::now();
  const InputConfig in = apply_mm_kwargs(load_input_config(a.model, a.preprocess, a.video),
                                         parse_mm_kwargs(a.mm_processor_kwargs, a.media_io_kwargs));
  EcCache cache(a.ec_path, a.ec_max_bytes, a.ec_min_age_s);
  CacheWork w = plan_cache_fill(a, cache, in);
  fmt::print(stderr, "encoder cache {}: {} inputs, {} already there, {} repeated, {} to encode\n", a.ec_path,
             a.inputs.size(), w.cached, w.repeated, w.todo.size());
  if (!w.todo.empty()) {
    const qwen3vl::Model model = qwen3vl::load_model(a.model);
    EncoderRunner runner(model, cfg);
    runner.reserve(a.max_batch_tokens, /*with_deepstack=*/true);
    const auto started = Clock::now();
    size_t encoded = 0;
    std::future<std::vector<PreparedInput>> next =
        std::async(std::launch::async, prepare_group, std::cref(a), std::cref(w), 0, std::cref(in));
    for (size_t from = 0; from < w.todo.size(); from += kGroup) {
      std::vector<PreparedInput> group = next.get();
      if (from + kGroup < w.todo.size())
        next = std::async(std::launch::async, prepare_group, std::cref(a), std::cref(w), from + kGroup, std::cref(in));
      encode_group(a, runner, model.config, cache, w, from, group, encoded, started);
    }
  }
  const EcCache::Stats st = cache.stats();
  fmt::print(
      "encoder cache {}: {} inputs: {} written, {} already there, {} repeated, {} failed; fovea's files {} "
      "({:.1f} MB), {} evicted, {} of other writers; {:.1f} s\n",
      a.ec_path, a.inputs.size(), w.written, w.cached, w.repeated, w.failed, st.files, double(st.bytes) / 1e6,
      st.evictions, st.foreign_files, seconds_since(t0));
  return w.failed ? 1 : 0;
}

// The model and its encoder, sized for `tokens` visual tokens in one forward; the times it took.
struct Loaded {
  std::optional<qwen3vl::Model> model;
  std::optional<EncoderRunner> runner;
  double load_ms = 0, setup_ms = 0;
};
void load_encoder(Loaded& l, const Args& a, const EngineConfig& cfg, int64_t tokens) {
  auto t = Clock::now();
  l.model.emplace(qwen3vl::load_model(a.model));
  l.load_ms = ms_since(t);
  t = Clock::now();
  l.runner.emplace(*l.model, cfg);
  l.runner->reserve(tokens, /*with_deepstack=*/true, /*batches=*/1);
  l.setup_ms = ms_since(t);
}

// --dump-dir: the CPU forward's intermediates in DIR/intermediates.safetensors, F32 [rows, width],
// with grid_thw (F32 [inputs, 3], as golden files hold it), for tools/compare-intermediates.py.
void write_intermediates(const std::string& dir, const qwen3vl::VisionConfig& c,
                         const std::vector<qwen3vl::GridThw>& grids,
                         const std::map<std::string, std::vector<float>>& values) {
  std::filesystem::create_directories(dir);
  auto bytes = [](const std::vector<float>& v) {
    return std::span(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4);
  };
  std::vector<TensorToWrite> t;
  for (const auto& [name, v] : values) {
    const bool out = name == "merger" || name.rfind("deepstack_merger_list.", 0) == 0;
    const int64_t width = name == "pixel_values" ? c.patch_dim() : out ? c.out_hidden : c.hidden;
    t.push_back({name, DType::F32, {int64_t(v.size()) / width, width}, {}, bytes(v)});
  }
  std::vector<float> g;
  for (const auto& thw : grids) g.insert(g.end(), thw.begin(), thw.end());
  t.push_back({"grid_thw", DType::F32, {int64_t(grids.size()), 3}, {}, bytes(g)});
  const std::string path = (std::filesystem::path(dir) / "intermediates.safetensors").string();
  write_safetensors(path, t, {{"format", "pt"}, {"model", c.name}});
  fmt::print("wrote {} intermediates of the CPU forward to {}\n", values.size(), path);
}

// The readable inputs' tensors from one forward: the encoder's bf16 bits as they are (views of
// where they landed: pinned memory on the GPU, no copy), widened for --output-dtype f32, or the CPU
// forward's fp32 as computed. Prints a line per input and the forward's times.
void encode_all(const Args& a, const EngineConfig& cfg, Loaded& l, std::vector<PreparedInput>& prepared,
                const std::vector<size_t>& ok, OutputTensors& out) {
  const qwen3vl::VisionConfig& vc = l.model->config;
  std::vector<const image::Patches*> inputs;
  std::vector<qwen3vl::GridThw> grids;
  for (const size_t i : ok) {
    inputs.push_back(&prepared[i].patches);
    grids.push_back(prepared[i].patches.grid);
  }
  const bool f32 = a.output_dtype == "f32";
  const auto tf = Clock::now();
  std::vector<Bf16Rows> bf16;
  std::vector<F32Rows> fp32;
  std::map<std::string, std::vector<float>> intermediates;
  if (!a.dump_dir.empty()) l.runner->keep_intermediates(&intermediates);
  if (f32 && cfg.device == Device::CPU) {
    fp32 = split_inputs(l.runner->run(inputs), grids, vc);
  } else {
    l.runner->start(inputs, true);
    bf16 = split_inputs(l.runner->finish_views(), grids, vc);
  }
  const double forward_ms = ms_since(tf);
  if (!a.dump_dir.empty()) write_intermediates(a.dump_dir, vc, grids, intermediates);
  fmt::print("{:<9} {:<40} {:>14} {:>8} {:>10} {:>12}\n", "input", "file", "grid_thw", "tokens", "decode ms",
             "preprocess ms");
  int64_t patches = 0;
  for (size_t j = 0; j < ok.size(); ++j) {
    const PreparedInput& p = prepared[ok[j]];
    const auto& g = grids[j];
    const std::string name =
        fp32.empty() ? out.add(p.kind, g, bf16[j], f32, p.clip) : out.add(p.kind, g, std::move(fp32[j]), p.clip);
    out.meta[name + ".file"] = a.inputs[ok[j]];
    fmt::print("{:<9} {:<40} {:>14} {:>8} {:>10.1f} {:>12.1f}\n", name, a.inputs[ok[j]],
               fmt::format("({}, {}, {})", g[0], g[1], g[2]), visual_tokens(vc, g), p.decode_ms, p.preprocess_ms);
    patches += int64_t(g[0]) * g[1] * g[2];
  }
  const EncoderRunner::Timings& rt = l.runner->last_timings();
  fmt::print(
      "model load {:.1f} ms | encoder setup {:.1f} ms | encoder forward ({} inputs, {} patches, {}{} on {}) {:.1f} ms: "
      "plan {:.1f}, upload {:.1f}, forward {:.1f}, download {:.1f}\n",
      l.load_ms, l.setup_ms, ok.size(), patches, dtype_name(cfg.dtype), cfg.fp8_linears ? ", fp8 linears" : "",
      device_name(cfg.device), forward_ms, rt.plan, rt.upload, rt.forward, rt.download);
  if (cfg.dtype == AttnDtype::FP8) fmt::print("FP8 attention: {}\n", l.runner->fp8_plan().describe());
  const GuardCounts g = l.runner->static_guarded();
  if (g.total() > 0)
    fmt::print(stderr,
               "fovea: the static FP8 scales' range was passed {} times (q {}, k {}, v {}; layers x forwards): those "
               "tensors ran at the batch's own scale instead of clipping. The inputs differ from the calibration's: "
               "recalibrate (--mm-encoder-fp8-scale-save-path) on inputs like them (docs/fp8.md §Static guard)\n",
               g.total(), g.q, g.k, g.v);
}

int run(const Args& a) {
  const EngineConfig cfg = resolve_engine(a.engine, query_system());
  if (a.inputs.empty()) fail("encode: no inputs given (image files or video clips)");
  if (!a.dump_dir.empty() && (cfg.device != Device::CPU || !a.ec_path.empty()))
    fail("encode: --dump-dir keeps the CPU forward's intermediates: run it with --device cpu{}",
         a.ec_path.empty() ? "" : ", without --ec-storage-path");
  if (!a.ec_path.empty()) return fill_ec_cache(a, cfg);
  if (a.output_dtype != "bf16" && a.output_dtype != "f32")
    fail("encode: --output-dtype: '{}' is not one of bf16, f32", a.output_dtype);
  const InputConfig in = load_input_config(a.model, a.preprocess, a.video);
  Files files = read_inputs(a.inputs, in);
  // Decoding and preprocessing run while the model loads and the encoder starts (weights to the GPU).
  auto preparing = std::async(std::launch::async, [&] { return prepare_files(a.inputs, files.bytes, in); });
  Loaded l;
  try {
    load_encoder(l, a, cfg, files.tokens);
  } catch (...) {
    preparing.wait();  // its threads use the files
    throw;
  }
  std::vector<PreparedInput> prepared = preparing.get();
  std::vector<size_t> ok;
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (prepared[i].error)
      fmt::print(stderr, "fovea: error: {}\n", prepared[i].error_message());
    else
      ok.push_back(i);
  }
  if (ok.empty()) fail("encode: none of the {} input(s) could be read", a.inputs.size());
  OutputTensors out(l.model->config);
  out.meta = {{"model", a.model}, {"dtype", dtype_name(cfg.dtype)}, {"device", device_name(cfg.device)}};
  encode_all(a, cfg, l, prepared, ok, out);
  if (!a.out.empty()) {
    const auto tw = Clock::now();
    write_safetensors(a.out, out.tensors(), out.meta);
    fmt::print("wrote {} ({:.1f} MB of tensors in {:.1f} ms)\n", a.out, double(out.bytes()) / 1e6, ms_since(tw));
  }
  if (ok.size() < a.inputs.size()) {
    fmt::print(stderr, "fovea: {} of {} input(s) failed\n", a.inputs.size() - ok.size(), a.inputs.size());
    return 1;
  }
  return 0;
}

}  // namespace

void add_encode(CLI::App& app, Runner& runner) {
  auto* cmd = app.add_subcommand("encode", "image files and video clips to visual tokens (and deepstack features)");
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("INPUT", a->inputs,
                  "images (JPEG, PNG, WebP, BMP, GIF) and video clips (MP4/MOV, WebM/MKV, AVI, ...)")
      ->required();
  cmd->add_option("-o,--output", a->out, "write tokens, deepstack features and grid_thw to this safetensors file");
  cmd->add_option("--dump-dir", a->dump_dir,
                  "write the CPU forward's intermediates (patch embedding, each block's attention and MLP outputs and "
                  "its output, the mergers; named as transformers' modules) to DIR/intermediates.safetensors, for "
                  "tools/compare-intermediates.py (with --device cpu; a few GB for a 4K image)");
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
  cmd->add_option(
         "--ec-storage-min-age", a->ec_min_age_s,
         "seconds a cache file fovea wrote or found (a hit) is kept from eviction after that use: vLLM checks the "
         "file when it schedules the request and reads it later, and the proxy's round trip, prefill and the "
         "consumer's queue happen in between; filling past --ec-storage-max-bytes with younger files is an "
         "error, as their eviction would be (0: no protection)")
      ->capture_default_str();
  cmd->add_option("--mm-processor-kwargs", a->mm_processor_kwargs,
                  "with --ec-storage-path: the mm_processor_kwargs (JSON, vLLM's flag) the clients' requests will "
                  "carry: applied to the preprocessing as fovea serve applies a request's, and each key hashed with "
                  "them as vLLM's consumer does (docs/vllm.md)");
  cmd->add_option("--media-io-kwargs", a->media_io_kwargs,
                  "with --ec-storage-path: the media_io_kwargs (JSON, vLLM's flag) the requests will carry (only empty "
                  "options per modality are implemented)");
  cmd->add_option("--served-model-name", a->model_id,
                  "with --mm-processor-kwargs: the model id vLLM's consumer hashes into its keys (the MODEL it was "
                  "started with; default: this MODEL)");
  cmd->add_option(
         "--uuid-from", a->uuid_from,
         "each input's key, and who finds it: sha256 (of the file's bytes) or filename: a client that sends "
         "that as the part's uuid; data-url: vLLM's EPD proxy, for a client sending the file as "
         "data:<type by extension>;base64,<standard base64, no line breaks>; file-url: the proxy, for a client "
         "sending file://<absolute path, percent-encoded as Python's Path.as_uri()>")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", a->max_batch_tokens, "visual tokens per forward when filling the cache")
      ->capture_default_str();
  add_preprocess_flags(cmd, a->preprocess);
  add_video_flags(cmd, a->video);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
