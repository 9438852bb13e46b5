// fovea export-model MODEL DIR: write a model (e.g. a synthetic preset) as a checkpoint folder, so
// transformers or another fovea can load exactly the same weights.
#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/model.h"

namespace fovea::cli {

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
