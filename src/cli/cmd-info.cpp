// fovea info: version, build options, visible GPUs and the resolved engine configuration.
#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/serve.h"
#include "fovea/video.h"

namespace fovea::cli {

namespace {
std::string version_str(int v) { return v ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : "none"; }
}  // namespace

void add_info(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("info", "version, build options, GPUs and the resolved engine configuration");
  auto opt = std::make_shared<EngineOptions>();
  add_engine_flags(cmd, *opt);
  cmd->callback([&run, opt] {
    run = [opt] {
      const SystemInfo sys = query_system();
      fmt::print("fovea {}\n", FOVEA_VERSION);
      fmt::print("build: CUDA {} (runtime {}, driver {}), cuDNN {}{}\n", sys.cuda_built ? "yes" : "no",
                 version_str(sys.cuda_runtime_version), version_str(sys.cuda_driver_version),
                 sys.cudnn_built ? "yes" : "no",
                 sys.cudnn_version ? fmt::format(" ({}.{}.{})", sys.cudnn_version / 10000,
                                                 sys.cudnn_version / 100 % 100, sys.cudnn_version % 100)
                                   : "");
      fmt::print("video: {}\n", video::video_supported() ? "yes (" + video::ffmpeg_versions() + ")"
                                                         : "no (built without FFmpeg's libraries)");
      fmt::print("http media: {}\n", server::http_media_supported()
                                         ? "yes (fovea serve --allowed-media-domains; libcurl)"
                                         : "no (built without libcurl: fovea serve refuses http(s) URLs)");
      if (sys.gpus.empty()) fmt::print("GPUs: none ({})\n", sys.gpu_error);
      for (const auto& g : sys.gpus) {
        fmt::print("GPU {}: {}, sm_{}{}, {} SMs, {:.1f} GiB\n", g.index, g.name, g.cc_major, g.cc_minor, g.sms,
                   double(g.memory_bytes) / (1 << 30));
        // What each GPU attention backend runs on this GPU, and why not where it does not.
        SystemInfo one = sys;
        one.gpus = {g};
        for (const AttnBackend b : {AttnBackend::FOVEA, AttnBackend::CUDNN}) {
          std::string runs, why;
          for (const AttnDtype d : {AttnDtype::BF16, AttnDtype::FP8}) {
            if (const auto w = backend_unsupported(b, d, Device::CUDA, one)) {
              if (why.empty()) why = fmt::format("{}: {}", dtype_name(d), *w);
            } else {
              runs += runs.empty() ? dtype_name(d) : fmt::format(", {}", dtype_name(d));
            }
          }
          fmt::print("  {:<6} {}{}\n", backend_name(b), runs.empty() ? "-" : runs,
                     why.empty() ? "" : "  [" + why + "]");
        }
      }
      std::fflush(stdout);
      const EngineConfig cfg = resolve_engine(*opt, sys);
      fmt::print("engine:\n");
      fmt::print("  device:  {}{}\n", device_name(cfg.device),
                 cfg.gpu ? fmt::format(" (GPU {}: {})", cfg.gpu->index, cfg.gpu->name) : "");
      fmt::print("  backend: {}\n", backend_name(cfg.backend));
      fmt::print("  dtype:   {}{}\n", dtype_name(cfg.dtype),
                 cfg.dtype_note.empty() ? "" : "  [" + cfg.dtype_note + "]");
      if (!cfg.scale_mode) {
        fmt::print("  scales:  none (bf16 attention)\n");
      } else if (*cfg.scale_mode == ScaleMode::STATIC) {
        fmt::print("  scales:  static, {} layers from {}\n", cfg.scale_file->layers.size(), cfg.scale_path);
      } else if (*cfg.scale_mode == ScaleMode::CALIBRATE) {
        fmt::print("  scales:  calibrate (dynamic; after {} forwards writes scales x {} to {})\n", kAmaxHistoryLen,
                   cfg.scale_save_margin, cfg.scale_save_path);
      } else {
        fmt::print("  scales:  dynamic (per-tensor amax, history of {} forwards)\n", kAmaxHistoryLen);
      }
      if (cfg.scale_mode)
        fmt::print("  scheme:  {}{}\n",
                   !cfg.fp8_robust       ? "tensor"
                   : cfg.fp8_auto_layers ? "robust on some layers, tensor on the rest"
                                         : "robust (K smoothing, per-head Q/K, per-channel V, split pairs)",
                   cfg.scheme_note.empty() ? "" : "  [" + cfg.scheme_note + "]");
      fmt::print("  linears: {}\n",
                 cfg.fp8_linears ? "fp8 (--fp8-linears: E4M3, per-token and per-channel scales)" : "bf16");
      return 0;
    };
  });
}

}  // namespace fovea::cli
