// fovea scales inspect FILE [--num-layers N]: validate a scale file and print every layer's scales
// and the amax each implies (s x 448).
#include <algorithm>

#include <fmt/format.h>

#include "cli/commands.h"
#include "fovea/scales.h"

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
      fmt::print("{:>5}  {:<28} {:>12} {:>12} {:>12}   {:>10} {:>10} {:>10}\n", "layer", "name", "q_scale", "k_scale",
                 "v_scale", "q_amax", "k_amax", "v_amax");
      for (const auto& [i, s] : f.layers)
        fmt::print("{:>5}  {:<28} {:>12.6g} {:>12.6g} {:>12.6g}   {:>10.4g} {:>10.4g} {:>10.4g}\n", i, f.names.at(i),
                   s.q, s.k, s.v, s.q * kE4M3Max, s.k * kE4M3Max, s.v * kE4M3Max);
      fmt::print("(amax = scale x 448: the largest |x| each scale represents without saturating)\n");
      if (!f.fine.empty()) {
        const FineScales& s0 = f.fine.begin()->second;
        fmt::print(
            "fine scales (fovea_q_head, fovea_k_head, fovea_v_channel, fovea_k_mean) in every layer: {} heads, {} V "
            "channels\n",
            s0.q_head.size(), s0.v_channel.size());
        for (const auto& [i, s] : f.fine) {
          auto range = [](const std::vector<float>& v) {
            const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
            return fmt::format("{:.4g}..{:.4g}", *lo, *hi);
          };
          // split pairs: those in use / the slots (fovea_qk_split; "-" where the layer has none)
          const auto used = std::count_if(s.qk_split.begin(), s.qk_split.end(), [](int32_t p) { return p >= 0; });
          const std::string split = s.qk_split.empty() ? "-" : fmt::format("{}/{}", used, s.qk_split.size());
          // robust gain (fovea_robust_gain): the statistic auto reads; "-" where calibration did not write it
          const std::string gain =
              s.robust_gain > 0
                  ? fmt::format("{:.3g}{}", s.robust_gain, auto_runs_robust(s) ? " (outliers: robust under auto)" : "")
                  : "-";
          fmt::print(
              "{:>5}  q_head {:<22} k_head {:<22} v_channel {:<22} k_mean {:<22} split pairs {:<6} robust gain {}\n", i,
              range(s.q_head), range(s.k_head), range(s.v_channel), range(s.k_mean), split, gain);
        }
        const auto flagged =
            std::count_if(f.fine.begin(), f.fine.end(), [](const auto& e) { return auto_runs_robust(e.second); });
        fmt::print(
            "(robust gain: the robust scheme's estimated cut of a layer's Q.K rounding error; --fp8-scheme auto runs "
            "it on "
            "the {} layer(s) at {} or more)\n",
            flagged, kAutoRobustGain);
      }
      return 0;
    };
  });
}

}  // namespace fovea::cli
