// fovea scales inspect FILE [--num-layers N]: validate a scale file and print every layer's scales
// and the amax each implies (s x 448).
#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/model.h"

namespace fovea::cli {

void add_scales(CLI::App& app, Runner& run) {
  auto* scales = app.add_subcommand("scales", "FP8 scale files");
  scales->require_subcommand(1);
  auto* inspect = scales->add_subcommand("inspect", "validate a scale file and print its layers");
  struct Args {
    std::string file;
    int num_layers = 0;
  };
  auto a = std::make_shared<Args>();
  inspect->add_option("FILE", a->file, "scale file (JSON)")->required();
  inspect->add_option("--num-layers", a->num_layers, "also require layers 0..N-1 to be present")
      ->check(CLI::PositiveNumber);
  inspect->callback([&run, a] {
    run = [a] {
      const ScaleFile f = read_scale_file(a->file);
      if (a->num_layers > 0) scales_for_model(f, a->num_layers);  // throws if layers are missing
      fmt::print("scale file {}: {} layers ({} format)\n", f.path, f.layers.size(),
                 f.nested ? "nested \"layers\"" : "flat");
      fmt::print("{:>5}  {:<28} {:>12} {:>12} {:>12}   {:>10} {:>10} {:>10}\n", "layer", "name", "q_scale",
                 "k_scale", "v_scale", "q_amax", "k_amax", "v_amax");
      for (const auto& [i, s] : f.layers)
        fmt::print("{:>5}  {:<28} {:>12.6g} {:>12.6g} {:>12.6g}   {:>10.4g} {:>10.4g} {:>10.4g}\n", i,
                   f.names.at(i), s.q, s.k, s.v, s.q * kE4M3Max, s.k * kE4M3Max, s.v * kE4M3Max);
      fmt::print("(amax = scale x 448: the largest |x| each scale represents without saturating)\n");
      return 0;
    };
  });
}

// fovea export-model MODEL DIR: write a model (e.g. a synthetic preset) as a checkpoint folder, so
// transformers or another fovea can load exactly the same weights.
void add_export_model(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("export-model", "write a model (e.g. synthetic:qwen3-vl-8b) as a Hugging Face-style checkpoint folder");
  struct Args {
    std::string model, folder;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("DIR", a->folder, "existing folder to write config.json and model.safetensors into")->required();
  cmd->callback([&run, a] {
    run = [a] {
      const qwen3vl::Model m = qwen3vl::load_model(a->model);
      qwen3vl::save_model(m, a->folder);
      fmt::print("wrote {} ({} blocks, hidden {}) to {}/config.json and {}/model.safetensors\n", a->model, m.config.depth,
                 m.config.hidden, a->folder, a->folder);
      return 0;
    };
  });
}

}  // namespace fovea::cli
