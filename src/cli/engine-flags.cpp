// The engine flags (design.md §5), registered the same way on every subcommand that runs a model.
// Validation lives in fovea::resolve_engine, not here.
#include "cli/commands.h"

namespace fovea::cli {

void add_engine_flags(CLI::App* cmd, EngineOptions& o) {
  cmd->add_option("--mm-encoder-attn-backend", o.backend,
                  "attention backend: AUTO, FOVEA, CUDNN (alias FLASHINFER), CPU")
      ->capture_default_str()->group("Engine");
  cmd->add_option("--mm-encoder-attn-dtype", o.dtype, "attention dtype: auto, bf16, fp8")
      ->capture_default_str()->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-path", o.scale_path,
                  "static FP8 scales: a JSON scale file (vLLM's format)")->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-save-path", o.scale_save_path,
                  "calibrate: run dynamic scaling and write the scales here after 16 forwards")->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-save-margin", o.scale_save_margin,
                  "margin multiplied onto saved scales (> 0)")->capture_default_str()->group("Engine");
  cmd->add_option("--device", o.device, "cuda or cpu (default: cuda when a GPU is visible)")->group("Engine");
}

}  // namespace fovea::cli
