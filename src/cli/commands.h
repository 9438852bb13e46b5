// The fovea command's subcommands. Each add_* registers its subcommand on the app and sets `run`
// to what executes it; main() turns fovea::Error into "fovea: error: ..." and exit code 1.
#pragma once
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/video.h"

namespace fovea::cli {

using Runner = std::function<int()>;

void add_engine_flags(CLI::App* cmd, EngineOptions& opt);
// --min-pixels, --max-pixels, --max-image-pixels (encode, serve).
void add_preprocess_flags(CLI::App* cmd, image::PreprocessOverrides& o);
void add_video_flags(CLI::App* cmd, video::VideoOverrides& o);

void add_info(CLI::App& app, Runner& run);
void add_scales(CLI::App& app, Runner& run);
void add_export_model(CLI::App& app, Runner& run);
void add_check_golden(CLI::App& app, Runner& run);
void add_encode(CLI::App& app, Runner& run);
void add_serve(CLI::App& app, Runner& run);
void add_bench_attention(CLI::App* bench, Runner& run);
void add_bench_encoder(CLI::App* bench, Runner& run);
void add_bench_mm_processor(CLI::App* bench, Runner& run);
void add_bench_calibration(CLI::App* bench, Runner& run);

}  // namespace fovea::cli
