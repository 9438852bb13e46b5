// Engine flag validation and resolution: one place for every subcommand that runs a model.
#include "fovea/engine.h"

#include <cctype>
#include <algorithm>
#include <cfloat>
#include <filesystem>

#include "fovea/error.h"
#include "fovea/json.h"

namespace fovea {

const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }

namespace {
bool is_hopper(const GpuInfo& g) { return g.cc_major == 9 && g.cc_minor == 0; }
}  // namespace

AttnBackend best_backend(AttnDtype d, Device dev, const SystemInfo& sys, bool fovea_head_dim) {
  if (dev == Device::CPU) return AttnBackend::CPU;
  const bool fovea = fovea_head_dim && !backend_unsupported(AttnBackend::FOVEA, d, dev, sys);
  return fovea || d == AttnDtype::FP8 ? AttnBackend::FOVEA : AttnBackend::CUDNN;
}

std::optional<std::string> backend_unsupported(AttnBackend b, AttnDtype d, Device dev, const SystemInfo& sys) {
  switch (b) {
    case AttnBackend::AUTO: return "AUTO is resolved before this check";
    case AttnBackend::CPU:
      if (dev != Device::CPU) return "the CPU backend runs with --device cpu";
      return std::nullopt;
    case AttnBackend::FOVEA:
      if (dev != Device::CUDA) return "the FOVEA backend runs on a GPU (--device cuda)";
      if (!sys.cuda_built) return "this fovea was built without CUDA";
      if (sys.gpus.empty() || !is_hopper(sys.gpus[0]))
        return fmt::format("the FOVEA backend needs a Hopper GPU (sm_90: H100/H200){}",
                           sys.gpus.empty() ? std::string()
                                            : fmt::format("; GPU 0 is {} (sm_{}{})", sys.gpus[0].name,
                                                          sys.gpus[0].cc_major, sys.gpus[0].cc_minor));
      return std::nullopt;
    case AttnBackend::CUDNN:
      if (dev != Device::CUDA) return "the CUDNN backend runs on a GPU (--device cuda)";
      if (!sys.cudnn_built) return "this fovea was built without cuDNN (the CUDNN backend)";
      if (sys.cudnn_version < 91500)
        return fmt::format(
            "the CUDNN backend needs cuDNN 9.15 or newer at run time (its SDPA operation with sequence "
            "lengths); this process loaded {}.{}.{}",
            sys.cudnn_version / 10000, sys.cudnn_version / 100 % 100, sys.cudnn_version % 100);
      if (sys.gpus.empty()) return "no GPU is visible";
      if (sys.gpus[0].cc_major < 8)
        return fmt::format("the CUDNN backend needs sm_80 or newer (this build's oldest target); GPU 0 is sm_{}{}",
                           sys.gpus[0].cc_major, sys.gpus[0].cc_minor);
      if (d == AttnDtype::FP8)
        return "the CUDNN backend runs BF16 only: cuDNN's FP8 attention on Hopper writes FP8 output, takes no packed "
               "segments and no head_dim 72, and fovea's FP8 path through cuDNN on Blackwell is not written";
      return std::nullopt;
  }
  return "unknown backend";
}

namespace {

// The scheme a static file runs: --fp8-scheme robust needs its fine scales; auto runs robust on the
// layers whose fovea_robust_gain reaches kAutoRobustGain (docs/fp8.md §Choosing a scheme).
void static_scheme(EngineConfig& cfg, const std::string& path, bool autoscheme) {
  const ScaleFile& file = *cfg.scale_file;
  if (cfg.fp8_robust && file.fine.empty())
    fail(
        "--fp8-scheme robust with static scales needs the file's fine scales (fovea_q_head, fovea_k_head, "
        "fovea_v_channel, fovea_k_mean; docs/fp8.md §Fine scales); '{}' has per-layer q/k/v only",
        path);
  std::vector<int> robust;
  for (const auto& [l, f] : file.fine)
    if (auto_runs_robust(f)) robust.push_back(l);
  const bool gains =
      std::any_of(file.fine.begin(), file.fine.end(), [](const auto& f) { return f.second.robust_gain > 0; });
  if (autoscheme && !robust.empty()) {
    cfg.fp8_robust = cfg.fp8_auto_layers = true;
    cfg.scheme_note = fmt::format("auto: robust on layers {} of {} (fovea_robust_gain >= {}), tensor on the rest",
                                  fmt::join(robust, ","), file.layers.size(), kAutoRobustGain);
  } else if (autoscheme && gains) {
    cfg.scheme_note = fmt::format("auto: tensor (no layer's fovea_robust_gain reaches {})", kAutoRobustGain);
  } else if (!cfg.fp8_robust && !file.fine.empty()) {
    warn(fmt::format(
        "--mm-encoder-fp8-scale-path: '{}' also has fine scales (fovea_q_head, fovea_k_head, "
        "fovea_v_channel, fovea_k_mean) for the FP8 scheme robust to outlier channels, unused with per-tensor "
        "scales (--fp8-scheme robust uses them{}); the per-layer q/k/v are used, as vLLM uses them",
        path, autoscheme ? "; auto needs a file whose calibration wrote fovea_robust_gain" : ""));
  }
}

}  // namespace

namespace {

// --device: the flag, else the GPU where this build has CUDA and one is visible (the CPU for --backend CPU).
void resolve_device(const EngineOptions& opt, const SystemInfo& sys, EngineConfig& cfg) {
  std::string device = opt.device;
  for (auto& c : device) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (device.empty()) {
    cfg.device = (sys.cuda_built && !sys.gpus.empty()) ? Device::CUDA : Device::CPU;
    if (parse_backend(opt.backend) == AttnBackend::CPU) cfg.device = Device::CPU;
  } else if (device == "cuda") {
    if (!sys.cuda_built) fail("--device cuda: this fovea was built without CUDA (rebuild where nvcc is installed)");
    if (sys.gpus.empty()) fail("--device cuda: no CUDA GPU is visible ({})", sys.gpu_error);
    cfg.device = Device::CUDA;
  } else if (device == "cpu") {
    cfg.device = Device::CPU;
  } else {
    fail("--device: '{}' is not one of cuda, cpu", opt.device);
  }
  if (cfg.device == Device::CUDA) cfg.gpu = sys.gpus.at(0);
}

// --mm-encoder-attn-dtype: auto means BF16 (no crossover has been measured yet; vLLM's default too).
void resolve_dtype(const EngineOptions& opt, EngineConfig& cfg) {
  const auto dtype = parse_dtype(opt.dtype);
  if (!dtype) fail("--mm-encoder-attn-dtype: '{}' is not one of auto, bf16, fp8", opt.dtype);
  cfg.dtype = *dtype;
  if (cfg.dtype == AttnDtype::AUTO) {
    cfg.dtype = AttnDtype::BF16;
    cfg.dtype_note = "auto: bf16 (FP8 is chosen only with --mm-encoder-attn-dtype fp8)";
  }
}

// The FP8 scale flags alone and together (docs/fp8.md §Engine options): the margin (checked as the
// float the scale book keeps: 1e-50 or 1e300 pass as a double, not as a float), the scheme, and the
// static and save paths, each only with FP8 and not both.
void check_fp8_flags(const EngineOptions& opt, EngineConfig& cfg) {
  if (!(opt.scale_save_margin > 0) || !(opt.scale_save_margin <= FLT_MAX) || !(float(opt.scale_save_margin) > 0))
    fail("--mm-encoder-fp8-scale-save-margin must be a number > 0, got {}", opt.scale_save_margin);
  cfg.scale_save_margin = float(opt.scale_save_margin);
  cfg.fp8_linears = opt.fp8_linears;
  const bool fp8 = cfg.dtype == AttnDtype::FP8;
  if (!parse_scheme_choice(opt.fp8_scheme))
    fail("--fp8-scheme: '{}' is not one of auto, tensor, robust", opt.fp8_scheme);
  if (opt.fp8_scheme == "robust") {
    if (!fp8)
      fail("--fp8-scheme robust needs --mm-encoder-attn-dtype fp8 (the attention dtype is {})", dtype_name(cfg.dtype));
    cfg.fp8_robust = true;
  }
  if (!opt.scale_path.empty() && !opt.scale_save_path.empty())
    fail(
        "--mm-encoder-fp8-scale-path and --mm-encoder-fp8-scale-save-path are exclusive: static scales are read "
        "from a file, calibration writes one");
  if (!opt.scale_path.empty() && !fp8)
    fail("--mm-encoder-fp8-scale-path needs --mm-encoder-attn-dtype fp8 (the attention dtype is {})",
         dtype_name(cfg.dtype));
  if (!opt.scale_save_path.empty() && !fp8)
    fail("--mm-encoder-fp8-scale-save-path needs --mm-encoder-attn-dtype fp8 (the attention dtype is {})",
         dtype_name(cfg.dtype));
  if (!opt.scale_save_path.empty()) {
    namespace fs = std::filesystem;
    const fs::path p(opt.scale_save_path);
    const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      fail("--mm-encoder-fp8-scale-save-path '{}': folder '{}' does not exist", opt.scale_save_path, dir.string());
    if (fs::is_directory(p, ec))
      fail("--mm-encoder-fp8-scale-save-path '{}' is a folder; give a file name", opt.scale_save_path);
  }
}

// The scale mode (static from a file, calibration, dynamic) and the scheme auto picks with it.
void resolve_scales(const EngineOptions& opt, EngineConfig& cfg) {
  const bool autoscheme = opt.fp8_scheme == "auto";
  if (!opt.scale_path.empty()) {
    cfg.scale_mode = ScaleMode::STATIC;
    try {
      cfg.scale_file = read_scale_file(opt.scale_path);
    } catch (const Error& e) {
      fail("--mm-encoder-fp8-scale-path: {}", e.what());
    }
    static_scheme(cfg, opt.scale_path, autoscheme);
  } else if (!opt.scale_save_path.empty()) {
    cfg.scale_mode = ScaleMode::CALIBRATE;
    if (autoscheme) {  // the statistic comes from the robust scheme's histories
      cfg.fp8_robust = true;
      cfg.scheme_note =
          "auto: calibrating with the robust scheme, whose file records per layer whether it needs it "
          "(fovea_robust_gain); serve with the file and auto to use it";
    }
  } else {
    cfg.scale_mode = ScaleMode::DYNAMIC;
  }
  if (autoscheme && cfg.scheme_note.empty())
    // Per-tensor scales (vLLM's): without a calibrated file no statistic says which layers have
    // outlier channels, and on well-spread inputs the robust scheme gains little and costs more
    // (bench/RESULTS.md); --fp8-scheme robust forces it.
    cfg.scheme_note =
        "auto: tensor (robust is chosen per layer only from a calibrated file, or with --fp8-scheme robust)";
}

// --mm-encoder-attn-backend: AUTO is the CPU on the CPU, FOVEA where it runs, else CUDNN; a backend that
// cannot run here is an error listing what can.
void resolve_backend(const EngineOptions& opt, const SystemInfo& sys, EngineConfig& cfg) {
  const auto backend = parse_backend(opt.backend);
  if (!backend) fail("--mm-encoder-attn-backend: '{}' is not one of AUTO, FOVEA, CUDNN, FLASHINFER, CPU", opt.backend);
  cfg.backend = *backend == AttnBackend::AUTO ? best_backend(cfg.dtype, cfg.device, sys) : *backend;
  if (auto why = backend_unsupported(cfg.backend, cfg.dtype, cfg.device, sys)) {
    std::vector<std::string> can;
    for (AttnBackend b : {AttnBackend::FOVEA, AttnBackend::CUDNN, AttnBackend::CPU})
      for (Device d : {Device::CUDA, Device::CPU})
        if (!backend_unsupported(b, cfg.dtype, d, sys))
          can.push_back(fmt::format("{} (--device {})", backend_name(b), device_name(d)));
    fail("--mm-encoder-attn-backend {}: {}; {} attention runs here on: {}", backend_name(cfg.backend), *why,
         dtype_name(cfg.dtype), can.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(can, ", ")));
  }
}

// --compilation-config: the encoder graph budgets, on a GPU with the FOVEA backend only (its attention
// reads the segments on the device; CUDNN plans each layout on the host).
void resolve_graphs(const EngineOptions& opt, EngineConfig& cfg) {
  if (opt.compilation_config.empty()) return;
  std::vector<std::string> ignored;
  cfg.graphs = parse_graph_config(opt.compilation_config, &ignored);
  if (!ignored.empty())
    warn(fmt::format("--compilation-config: fovea reads only its encoder CUDA-graph keys; ignored: {}",
                     fmt::join(ignored, ", ")));
  if (!cfg.graphs.on()) return;
  if (cfg.device != Device::CUDA || cfg.backend != AttnBackend::FOVEA)
    fail(
        "--compilation-config: cudagraph_mm_encoder runs on a GPU with the FOVEA attention backend (it reads each "
        "batch's segments on the device); this engine runs {} on {}",
        backend_name(cfg.backend), device_name(cfg.device));
}

}  // namespace

qwen3vl::GraphBudgets parse_graph_config(const std::string& text, std::vector<std::string>* ignored) {
  JsonLimits lim;
  lim.max_bytes = size_t(1) << 16;
  const nlohmann::json j = parse_json_bounded(text, lim, "--compilation-config");
  if (!j.is_object()) fail("--compilation-config: expected a JSON object, got {}", quote_for_error(j));
  qwen3vl::GraphBudgets g;
  bool on = false;
  for (const auto& [key, v] : j.items()) {
    if (key == "cudagraph_mm_encoder") {
      if (!v.is_boolean())
        fail("--compilation-config: cudagraph_mm_encoder must be true or false, got {}", quote_for_error(v));
      on = v.get<bool>();
    } else if (key == "encoder_cudagraph_token_budgets") {
      if (!v.is_array() || v.size() > qwen3vl::kMaxGraphBudgets)
        fail("--compilation-config: encoder_cudagraph_token_budgets must be a list of at most {} token counts, got {}",
             qwen3vl::kMaxGraphBudgets, quote_for_error(v));
      for (const auto& b : v) {
        if (!b.is_number_integer() || b.get<int64_t>() < 1 || b.get<int64_t>() > qwen3vl::kMaxGraphBudget)
          fail("--compilation-config: encoder_cudagraph_token_budgets: {} is not a token count from 1 to {}",
               quote_for_error(b), qwen3vl::kMaxGraphBudget);
        g.tokens.push_back(b.get<int64_t>());
      }
    } else if (key == "encoder_cudagraph_max_vision_items_per_batch") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 4096)
        fail(
            "--compilation-config: encoder_cudagraph_max_vision_items_per_batch must be 0 (the default, {}) to 4096, "
            "got {}",
            qwen3vl::kDefaultGraphItems, quote_for_error(v));
      g.max_items = int(v.get<int64_t>());
    } else if (ignored) {
      ignored->push_back(escape_for_error(key));
    }
  }
  if (!on) return {};
  if (g.tokens.empty())
    g.tokens.assign(std::begin(qwen3vl::kDefaultGraphBudgets), std::end(qwen3vl::kDefaultGraphBudgets));
  std::sort(g.tokens.begin(), g.tokens.end());
  g.tokens.erase(std::unique(g.tokens.begin(), g.tokens.end()), g.tokens.end());
  if (g.max_items == 0) g.max_items = qwen3vl::kDefaultGraphItems;
  return g;
}

// Device, dtype, FP8 scales, backend: each step reads the ones before it.
EngineConfig resolve_engine(const EngineOptions& opt, const SystemInfo& sys) {
  EngineConfig cfg;
  resolve_device(opt, sys, cfg);
  resolve_dtype(opt, cfg);
  check_fp8_flags(opt, cfg);
  if (cfg.dtype == AttnDtype::FP8) resolve_scales(opt, cfg);
  cfg.scale_path = opt.scale_path;
  cfg.scale_save_path = opt.scale_save_path;
  resolve_backend(opt, sys, cfg);
  resolve_graphs(opt, cfg);
  if (cfg.fp8_linears && cfg.device == Device::CUDA && !sys.gpus.empty() && sys.gpus[0].cc_major < 9)
    fail(
        "--fp8-linears on the GPU needs sm_90 or newer (cuBLASLt's per-token and per-channel FP8 scales); GPU 0 is {} "
        "(sm_{}{})",
        sys.gpus[0].name, sys.gpus[0].cc_major, sys.gpus[0].cc_minor);
  return cfg;
}

Fp8Plan EngineConfig::fp8_plan(int layers, int heads, int head_dim) const {
  if (!scale_mode) fail("FP8 plan requested, but the engine runs {} attention", dtype_name(dtype));
  const SchemeChoice c = !fp8_robust       ? SchemeChoice::TENSOR
                         : fp8_auto_layers ? SchemeChoice::AUTO
                                           : SchemeChoice::ROBUST;
  try {
    return Fp8Plan::choose(c, *scale_mode, scale_file ? &*scale_file : nullptr, layers, heads, head_dim);
  } catch (const Error& e) {
    fail("--mm-encoder-fp8-scale-path '{}': {}", scale_path, e.what());
  }
}

ScaleBook make_scale_book(const EngineConfig& cfg, int num_layers) {
  if (!cfg.scale_mode) fail("FP8 scales requested, but the engine runs {} attention", dtype_name(cfg.dtype));
  switch (*cfg.scale_mode) {
    case ScaleMode::STATIC: return ScaleBook::fixed(scales_for_model(*cfg.scale_file, num_layers));
    case ScaleMode::CALIBRATE: return ScaleBook::calibrating(num_layers, cfg.scale_save_path, cfg.scale_save_margin);
    case ScaleMode::DYNAMIC: break;
  }
  return ScaleBook::dynamic(num_layers);
}

}  // namespace fovea
