#include "fovea/fp8-plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "fovea/error.h"

namespace fovea {

const char* layer_scheme_name(LayerScheme s) {
  switch (s) {
    case LayerScheme::TENSOR_STATIC: return "tensor static";
    case LayerScheme::TENSOR_DYNAMIC: return "tensor dynamic";
    case LayerScheme::ROBUST_STATIC: return "robust static";
    case LayerScheme::ROBUST_DYNAMIC: return "robust dynamic";
  }
  return "?";
}

std::optional<SchemeChoice> parse_scheme_choice(std::string_view s) {
  if (s == "auto") return SchemeChoice::AUTO;
  if (s == "tensor") return SchemeChoice::TENSOR;
  if (s == "robust") return SchemeChoice::ROBUST;
  return std::nullopt;
}

Fp8Plan Fp8Plan::choose(SchemeChoice c, ScaleMode mode, const ScaleFile* file, int layers, int heads, int head_dim) {
  if ((mode == ScaleMode::STATIC) != (file != nullptr))
    fail("FP8 plan: {} scales {} a scale file", scale_mode_name(mode), file ? "with" : "without");
  if (c == SchemeChoice::TENSOR || (c == SchemeChoice::AUTO && mode == ScaleMode::DYNAMIC)) return tensor(mode, layers);
  if (!file) return robust_dynamic(mode, layers);
  if (c == SchemeChoice::ROBUST && file->fine.empty())
    fail(
        "the robust scheme with static scales needs the file's fine scales (fovea_q_head, fovea_k_head, "
        "fovea_v_channel, fovea_k_mean; docs/fp8.md §Fine scales); it has per-layer q/k/v only");
  std::vector<FineScales> fine;  // every layer is in the file (scales_for_model checks that)
  for (int l = 0; l < layers; ++l) {
    const auto it = file->fine.find(l);
    const bool robust = it != file->fine.end() && (c == SchemeChoice::ROBUST || auto_runs_robust(it->second));
    fine.push_back(robust ? it->second : FineScales{});
  }
  return robust_static(std::move(fine), heads, head_dim);
}

Fp8Plan Fp8Plan::tensor(ScaleMode mode, int layers) {
  if (layers < 0) fail("FP8 plan: {} layers", layers);
  Fp8Plan p;
  p.schemes_.assign(size_t(layers),
                    mode == ScaleMode::STATIC ? LayerScheme::TENSOR_STATIC : LayerScheme::TENSOR_DYNAMIC);
  p.fine_.resize(size_t(layers));
  return p;
}

Fp8Plan Fp8Plan::robust_dynamic(ScaleMode mode, int layers) {
  if (mode == ScaleMode::STATIC)
    fail("FP8 plan: the robust scheme with static scales takes each layer's fine scales (robust_static)");
  Fp8Plan p = tensor(mode, layers);
  p.schemes_.assign(size_t(layers), LayerScheme::ROBUST_DYNAMIC);
  return p;
}

Fp8Plan Fp8Plan::robust_static(std::vector<FineScales> fine, int heads, int head_dim) {
  Fp8Plan p;
  for (size_t l = 0; l < fine.size(); ++l) {
    const FineScales& f = fine[l];
    if (f == FineScales{}) {  // this layer runs its per-tensor q/k/v
      p.schemes_.push_back(LayerScheme::TENSOR_STATIC);
      continue;
    }
    const size_t cells = size_t(heads) * size_t(head_dim);
    if (f.q_head.size() != size_t(heads) || f.k_head.size() != size_t(heads) || f.v_channel.size() != cells ||
        f.k_mean.size() != cells)
      fail(
          "layer {}'s fine scales are for {} heads (fovea_q_head; fovea_k_head {}) and {} V channels ({} K means); "
          "the model has {} heads of {}",
          l, f.q_head.size(), f.k_head.size(), f.v_channel.size(), f.k_mean.size(), heads, head_dim);
    check_split_pairs(f.qk_split, heads, head_dim, fmt::format("layer {}'s fovea_qk_split", l));
    p.schemes_.push_back(LayerScheme::ROBUST_STATIC);
  }
  p.fine_ = std::move(fine);
  return p;
}

bool Fp8Plan::any(LayerScheme s) const {
  for (LayerScheme x : schemes_)
    if (x == s) return true;
  return false;
}

void Fp8Plan::check_book(const ScaleBook& book, const std::string& what) const {
  if (book.num_layers() != layers())
    fail("{}: a scale book of {} layers for an FP8 plan of {}", what, book.num_layers(), layers());
  const bool fixed = any(LayerScheme::TENSOR_STATIC) || any(LayerScheme::ROBUST_STATIC);
  if (fixed != (book.mode() == ScaleMode::STATIC))
    fail("{}: a {} scale book for an FP8 plan of {} scales", what, scale_mode_name(book.mode()),
         fixed ? "static" : "dynamic");
}

std::string Fp8Plan::describe() const {
  std::string out;
  for (LayerScheme s : {LayerScheme::ROBUST_STATIC, LayerScheme::ROBUST_DYNAMIC, LayerScheme::TENSOR_STATIC,
                        LayerScheme::TENSOR_DYNAMIC}) {
    std::vector<int> on;
    for (int l = 0; l < layers(); ++l)
      if (at(l) == s) on.push_back(l);
    if (on.empty()) continue;
    if (!out.empty()) out += "; ";
    out += on.size() == size_t(layers())
               ? fmt::format("{} on every layer", layer_scheme_name(s))
               : fmt::format("{} on layer{} {}", layer_scheme_name(s), on.size() > 1 ? "s" : "", fmt::join(on, ","));
  }
  return out.empty() ? "no layers" : out;
}

}  // namespace fovea
