// fovea check-golden MODEL GOLDEN: run fovea's encoder (CPU or GPU, any engine flags) on the pixel
// inputs of a golden file made by tools/make-golden.py and report its error against the reference
// outputs stored there (transformers fp32), and, when the file also holds transformers' own BF16
// outputs ("<name>.bf16"), that error too and the ratio between the two.
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"
#include "fovea/safetensors.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string model, golden, json_path;
  double require_ratio = 0;  // > 0: fail when fovea's error exceeds this x transformers BF16's
  EngineOptions engine;
};

int run(const Args& a) {
  const SystemInfo sys = query_system();
  const EngineConfig cfg = resolve_engine(a.engine, sys);
  const qwen3vl::Model m = qwen3vl::load_model(a.model);
  const Checkpoint g = Checkpoint::open(a.golden);
  if (a.require_ratio > 0 && !g.find("merged.bf16"))
    fail("check-golden: --require-ratio needs transformers' BF16 outputs ('merged.bf16') in '{}'", a.golden);
  auto need = [&](const std::string& name) {
    const TensorInfo* t = g.find(name);
    if (!t) fail("check-golden: '{}' has no tensor '{}'", a.golden, name);
    return t->to_float();
  };
  Batch batch;
  batch.pixels = need("pixel_values");
  const std::vector<float> grid = need("grid_thw");
  std::vector<qwen3vl::GridThw>& grids = batch.grids;
  if (grid.empty() || grid.size() % 3)
    fail("check-golden: '{}': grid_thw has {} values, not (t, h, w) triples", a.golden, grid.size());
  for (size_t i = 0; i < grid.size(); ++i)  // float -> int of a value out of range would be UB
    if (!(grid[i] >= 1 && grid[i] <= 65536) || grid[i] != float(int(grid[i])))
      fail("check-golden: '{}': grid_thw[{}] = {} is not an integer in 1..65536", a.golden, i, grid[i]);
  for (size_t i = 0; i + 2 < grid.size(); i += 3) grids.push_back({int(grid[i]), int(grid[i + 1]), int(grid[i + 2])});

  EncoderRunner runner(m, cfg);
  auto [merged, deepstack] = runner.run(batch);
  const ScaleBook* book = runner.book();
  fmt::print("fovea check-golden | {} | {} | device {} | {} attention{}{}{}\n", a.model, a.golden,
             device_name(cfg.device), dtype_name(cfg.dtype),
             book ? fmt::format(" ({} scales)", scale_mode_name(book->mode())) : "",
             book ? ": " + runner.fp8_plan().describe() : "", cfg.fp8_linears ? " | fp8 linears" : "");
  fmt::print("{:<12} | {:>14} | {:>12} | {:>18} | {:>12}\n", "output", "rel_l2 vs ref", "mean cosine",
             "transformers bf16", "ratio");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::vector<std::pair<std::string, const std::vector<float>*>> ours = {{"merged", &merged}};
  for (size_t k = 0; k < deepstack.size(); ++k) ours.push_back({"deepstack." + std::to_string(k), &deepstack[k]});
  const int width = m.config.out_hidden;
  std::vector<std::string> over;
  for (const auto& [name, v] : ours) {
    const auto d = qwen3vl::embedding_error(*v, need(name), width);
    std::string hf = "-", ratio = "-";
    nlohmann::ordered_json row = {{"output", name}, {"rel_l2", d.rel_l2}, {"mean_cosine", d.mean_cosine}};
    if (g.find(name + ".bf16")) {
      const auto h = qwen3vl::embedding_error(g.find(name + ".bf16")->to_float(), need(name), width);
      hf = fmt::format("{:.3e}", h.rel_l2);
      ratio = fmt::format("{:.2f}", d.rel_l2 / h.rel_l2);
      row["transformers_bf16_rel_l2"] = h.rel_l2;
      if (a.require_ratio > 0 && !(d.rel_l2 <= a.require_ratio * h.rel_l2)) over.push_back(name);
    }
    fmt::print("{:<12} | {:>14.3e} | {:>12.6f} | {:>18} | {:>12}\n", name, d.rel_l2, d.mean_cosine, hf, ratio);
    rows.push_back(row);
    if (!std::isfinite(d.rel_l2)) fail("check-golden: fovea's '{}' has non-finite values", name);
  }
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {{"model", a.model},
                                        {"golden", a.golden},
                                        {"device", device_name(cfg.device)},
                                        {"dtype", dtype_name(cfg.dtype)},
                                        {"outputs", rows}};
    write_file_atomic(a.json_path, doc.dump(2) + "\n", "--json");
  }
  if (!over.empty())
    fail("check-golden: fovea's error exceeds {} x transformers BF16's on {} (of {} outputs)", a.require_ratio,
         fmt::join(over, ", "), ours.size());
  return 0;
}

}  // namespace

void add_check_golden(CLI::App& app, Runner& runner) {
  auto* cmd = app.add_subcommand(
      "check-golden",
      "run the encoder on a golden file's pixels and report its error against the stored reference outputs");
  auto a = std::make_shared<Args>();
  cmd->add_option("MODEL", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("GOLDEN", a->golden, "safetensors file from tools/make-golden.py")->required();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->add_option(
         "--require-ratio", a->require_ratio,
         "exit 1 when fovea's rel. error on any output exceeds this multiple of transformers BF16's (e.g. 1.5)")
      ->check(CLI::PositiveNumber);
  add_engine_flags(cmd, a->engine);
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
