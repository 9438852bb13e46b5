// fovea: the command line. `fovea --help` lists the subcommands.
#include <cstdio>

#include "cli/commands.h"
#include "fovea/error.h"

int main(int argc, char** argv) {
  CLI::App app{"fovea " FOVEA_VERSION ": FP8 attention runtime for vision-language encoders", "fovea"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fovea " FOVEA_VERSION);
  fovea::cli::Runner run;
  fovea::cli::add_encode(app, run);
  fovea::cli::add_serve(app, run);
  fovea::cli::add_info(app, run);
  fovea::cli::add_scales(app, run);
  fovea::cli::add_export_model(app, run);
  fovea::cli::add_check_golden(app, run);
  CLI::App* bench = app.add_subcommand("bench", "benchmarks: attention, encoder, mm-processor, calibration");
  bench->require_subcommand(1);
  fovea::cli::add_bench_attention(bench, run);
  fovea::cli::add_bench_encoder(bench, run);
  fovea::cli::add_bench_mm_processor(bench, run);
  fovea::cli::add_bench_calibration(bench, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run ? run() : 2;
  } catch (const fovea::Error& e) {
    std::fprintf(stderr, "fovea: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fovea: internal error: %s\n", e.what());
    return 3;
  }
}
