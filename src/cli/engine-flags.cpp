// The engine flags (docs/architecture.md §Engine configuration), registered the same way on every subcommand that runs
// a model (validation lives in fovea::resolve_engine, not here), and the preprocessing budget flags.
#include "cli/commands.h"

namespace fovea::cli {

void add_engine_flags(CLI::App* cmd, EngineOptions& o) {
  cmd->add_option("--mm-encoder-attn-backend", o.backend,
                  "attention backend: AUTO, FOVEA, CUDNN (alias FLASHINFER), CPU")
      ->capture_default_str()
      ->group("Engine");
  cmd->add_option("--mm-encoder-attn-dtype", o.dtype, "attention dtype: auto, bf16, fp8")
      ->capture_default_str()
      ->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-path", o.scale_path, "static FP8 scales: a JSON scale file (vLLM's format)")
      ->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-save-path", o.scale_save_path,
                  "calibrate: run dynamic scaling and write the scales here after 16 forwards")
      ->group("Engine");
  cmd->add_option("--mm-encoder-fp8-scale-save-margin", o.scale_save_margin,
                  "margin multiplied onto saved scales (> 0)")
      ->capture_default_str()
      ->group("Engine");
  cmd->add_option("--device", o.device, "cuda or cpu (default: cuda when a GPU is visible)")->group("Engine");
  cmd->add_flag("--fp8-linears", o.fp8_linears,
                "fovea's own, off by default: the vision blocks' qkv, proj and MLP linears as FP8 GEMMs (E4M3, "
                "per-token and per-channel scales, or an FP8 release's weights as stored; on the CPU, their "
                "emulation)")
      ->group("Engine");
  cmd->add_option("--fp8-scheme", o.fp8_scheme,
                  "fovea's own: FP8 attention scales per tensor (vLLM's) or robust to outlier channels (K smoothing, "
                  "per-head Q/K and per-channel V scales; GPU and CPU): auto, tensor, robust")
      ->capture_default_str()
      ->group("Engine");
  cmd->add_option("--compilation-config", o.compilation_config,
                  "vLLM's JSON; fovea reads its encoder CUDA-graph keys: {\"cudagraph_mm_encoder\": true, "
                  "\"encoder_cudagraph_token_budgets\": [256, 512, ...], "
                  "\"encoder_cudagraph_max_vision_items_per_batch\": 32} (GPU, FOVEA backend)")
      ->group("Engine");
}

// Validation lives in image::load_preprocess_config.
void add_preprocess_flags(CLI::App* cmd, image::PreprocessOverrides& o) {
  cmd->add_option("--max-image-pixels", o.max_image_pixels,
                  "refuse, from the header and before decoding, images with more pixels; 0: auto, "
                  "4 x max(--max-pixels, 4096^2) (67 MP at the shipped budget)")
      ->capture_default_str();
  cmd->add_option("--min-pixels", o.min_pixels, "resize budget: at least this many pixels (default: the checkpoint's)");
  cmd->add_option("--max-pixels", o.max_pixels,
                  "resize budget: at most this many pixels (default: the checkpoint's, 4096^2)");
}

void add_video_flags(CLI::App* cmd, video::VideoOverrides& o) {
  cmd->add_option("--video-fps", o.fps, "frames sampled per second of video (default: the checkpoint's, 2)");
  cmd->add_option("--video-min-pixels", o.min_pixels,
                  "video budget: at least this many pixels over all sampled frames");
  cmd->add_option("--video-max-pixels", o.max_pixels,
                  "video budget: at most this many pixels over all sampled frames (default: the checkpoint's)");
  cmd->add_option("--video-max-frames", o.max_frames,
                  "at most this many frames sampled per clip (default: the checkpoint's, 768)");
  cmd->add_option("--max-video-seconds", o.max_seconds, "refuse clips longer than this (default 3600)");
}

}  // namespace fovea::cli
