// fovea export-model MODEL DIR: write a model (e.g. a synthetic preset) as a checkpoint folder, so
// transformers or another fovea can load exactly the same weights; --fp8-weights writes the blocks'
// linears as an FP8 release stores them, or an FP8 release's as BF16 (its dequantized values).
#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/model.h"

namespace fovea::cli {

void add_export_model(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand(
      "export-model", "write a model (e.g. synthetic:qwen3-vl-8b) as a Hugging Face-style checkpoint folder");
  struct Args {
    std::string model, folder, fp8 = "keep";
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("DIR", a->folder, "existing folder to write config.json and model.safetensors into")->required();
  cmd->add_option("--fp8-weights", a->fp8,
                  "the blocks' qkv, proj and MLP weights: keep (as MODEL holds them), blocks (E4M3 in [128, 128] "
                  "blocks, transformers' \"fp8\" as Qwen's FP8 releases), channel (E4M3 per output channel, "
                  "llm-compressor's FP8_DYNAMIC) or none (BF16: an FP8 release's dequantized values)")
      ->check(CLI::IsMember({"keep", "blocks", "channel", "none"}));
  cmd->callback([&run, a] {
    run = [a] {
      qwen3vl::Model m = qwen3vl::load_model(a->model);
      if (a->fp8 == "blocks") qwen3vl::quantize_block_linears(m, {128, 128});
      if (a->fp8 == "channel") qwen3vl::quantize_block_linears(m, {1, 0});
      if (a->fp8 == "none")
        for (auto& b : m.weights.blocks)
          for (auto [name, l] : qwen3vl::block_linears(b, 0)) l->fp8.reset();
      qwen3vl::save_model(m, a->folder);
      fmt::print("wrote {} ({} blocks, hidden {}) to {}/config.json and {}/model.safetensors\n", a->model,
                 m.config.depth, m.config.hidden, a->folder, a->folder);
      return 0;
    };
  });
}

}  // namespace fovea::cli
