// fovea/engine.h: the engine flags every model-running subcommand shares (vLLM's names), their
// validation and resolution against the machine (fovea/system.h) into an EngineConfig, and the scale
// book an FP8 engine runs with. Errors name the offending flag.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "fovea/attention.h"
#include "fovea/encoder.h"
#include "fovea/fp8-plan.h"
#include "fovea/scales.h"
#include "fovea/system.h"

namespace fovea {

// What the flags say, as given (vLLM's names: --mm-encoder-attn-backend, ...).
struct EngineOptions {
  std::string backend = "AUTO";  // AUTO, FOVEA, CUDNN, FLASHINFER (= CUDNN), CPU
  std::string dtype = "auto";    // auto, bf16, fp8
  std::string scale_path;        // --mm-encoder-fp8-scale-path
  std::string scale_save_path;   // --mm-encoder-fp8-scale-save-path
  double scale_save_margin = kDefaultScaleMargin;
  std::string device;               // cuda, cpu; empty: cuda when a GPU is visible, else cpu
  bool fp8_linears = false;         // --fp8-linears (fovea's own): the blocks' linears as FP8 GEMMs
  std::string fp8_scheme = "auto";  // --fp8-scheme (fovea's own): auto, tensor, robust
  // --compilation-config (vLLM's): a JSON object; fovea reads its encoder CUDA-graph keys.
  std::string compilation_config;
};

// The graph budgets a --compilation-config value asks for (none unless cudagraph_mm_encoder is true);
// `ignored` gets the keys fovea does not read. Throws naming the key for a malformed value.
qwen3vl::GraphBudgets parse_graph_config(const std::string& json, std::vector<std::string>* ignored = nullptr);

enum class Device { CUDA, CPU };
const char* device_name(Device d);

struct EngineConfig {
  Device device = Device::CPU;
  AttnBackend backend = AttnBackend::CPU;
  AttnDtype dtype = AttnDtype::BF16;    // resolved: BF16 or FP8
  std::string dtype_note;               // how auto was resolved, if it was
  std::optional<ScaleMode> scale_mode;  // set iff dtype is FP8
  std::string scale_path, scale_save_path;
  float scale_save_margin = kDefaultScaleMargin;
  std::optional<ScaleFile> scale_file;  // static mode: the file, read and validated
  std::optional<GpuInfo> gpu;           // device CUDA: the GPU used (device 0)
  bool fp8_linears = false;             // docs/fp8.md §FP8 linears
  // FP8 only: the scheme robust to outlier channels (docs/fp8.md §Outlier channels: K smoothing,
  // per-head Q/K and per-channel V scales, split pairs) instead of per-tensor scales; how auto was
  // resolved. With fp8_auto_layers (auto with a static file) only the layers whose file entry reaches
  // kAutoRobustGain run it, the others their per-tensor q/k/v.
  bool fp8_robust = false;
  bool fp8_auto_layers = false;
  std::string scheme_note;
  // FP8 only: what each layer of a model of `layers` blocks of `heads` x `head_dim` quantizes with,
  // from the above (a static file's fine scales checked against the model's shape here).
  Fp8Plan fp8_plan(int layers, int heads, int head_dim) const;
  qwen3vl::GraphBudgets graphs;  // encoder CUDA graphs (FOVEA backend only); off unless asked for
};

// Why a backend cannot run dtype on this device and machine, or nullopt if it can.
std::optional<std::string> backend_unsupported(AttnBackend b, AttnDtype d, Device dev, const SystemInfo& sys);
// The backend AUTO stands for, the one rule of the engine and the C ABI: CPU on the CPU; on a GPU,
// FOVEA where it runs (and, `fovea_head_dim`, is built for the head size), else CUDNN for BF16. FP8
// is FOVEA's alone, so AUTO FP8 is FOVEA even where it cannot run: backend_unsupported then says why.
AttnBackend best_backend(AttnDtype d, Device dev, const SystemInfo& sys, bool fovea_head_dim = true);

// Validates and resolves the flags; throws fovea::Error whose message names the offending option.
EngineConfig resolve_engine(const EngineOptions& opt, const SystemInfo& sys);

// The scale book an FP8 engine runs a model of num_layers attention layers with: dynamic, static
// (the scale file's layers 0..num_layers-1; missing layers are an error naming the file), or
// calibrating (writes the save path after 16 forwards). Throws if the engine is not FP8.
ScaleBook make_scale_book(const EngineConfig& cfg, int num_layers);

}  // namespace fovea
