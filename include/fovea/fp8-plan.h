// fovea/fp8-plan.h: what FP8 attention quantizes with, layer by layer (docs/fp8.md §The plan).
//
// The engine resolves the flags (scale file or not, --fp8-scheme, auto's per-layer choice) into one
// Fp8Plan when it loads the model; the CPU forward, the GPU encoder and the attention's prepare step
// read it and decide nothing themselves. The plan is a value: the scale book (scales.h) holds the
// state that changes from forward to forward (amax rings, robust histories).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fovea/scales.h"

namespace fovea {

// How one layer's Q, K and V go to E4M3.
enum class LayerScheme : uint8_t {
  TENSOR_STATIC,   // one scale per tensor, fixed: the scale book's (a scale file's q/k/v)
  TENSOR_DYNAMIC,  // one scale per tensor from this forward and the layer's amax ring
  ROBUST_STATIC,   // the robust scheme (docs/fp8.md §Outlier channels) with the file's fine scales
  ROBUST_DYNAMIC,  // the robust scheme with arrays from this forward and the layer's FineHistory
};
const char* layer_scheme_name(LayerScheme s);
constexpr bool is_robust(LayerScheme s) { return s == LayerScheme::ROBUST_STATIC || s == LayerScheme::ROBUST_DYNAMIC; }

// --fp8-scheme: what the user asks for; Fp8Plan::choose turns it into each layer's scheme.
enum class SchemeChoice { AUTO, TENSOR, ROBUST };
std::optional<SchemeChoice> parse_scheme_choice(std::string_view s);  // "auto", "tensor", "robust"

class Fp8Plan {
 public:
  Fp8Plan() = default;
  // fovea's rule (docs/fp8.md §Choosing a scheme), the one the engine and the C ABI run, for `layers`
  // blocks of heads x head_dim; `file` is the static scale file (mode STATIC), else null:
  //   TENSOR  per tensor everywhere (static with a file, else from the book's rings);
  //   ROBUST  robust everywhere: the file's fine scales (it must have them), else robust dynamic;
  //   AUTO    with a file, robust static on the layers whose fovea_robust_gain reaches
  //           kAutoRobustGain and per tensor on the rest; calibrating, robust dynamic (its file then
  //           records that statistic); dynamic, per tensor.
  static Fp8Plan choose(SchemeChoice c, ScaleMode mode, const ScaleFile* file, int layers, int heads, int head_dim);
  // Every layer per tensor: static scales with a static book, the book's rings otherwise.
  static Fp8Plan tensor(ScaleMode mode, int layers);
  // Every layer robust with arrays from its forwards (a dynamic or calibrating book).
  static Fp8Plan robust_dynamic(ScaleMode mode, int layers);
  // A static file's plan: layer l runs the robust scheme with fine[l] where that is not empty, its
  // per-tensor q/k/v otherwise. fine has one entry per layer, each checked against the model's heads
  // and head_dim (sizes, split pairs): a mismatch is a fovea::Error naming the layer.
  static Fp8Plan robust_static(std::vector<FineScales> fine, int heads, int head_dim);

  int layers() const { return int(schemes_.size()); }
  LayerScheme at(int layer) const { return schemes_.at(size_t(layer)); }
  // ROBUST_STATIC layers: the file's arrays (the others: an empty FineScales).
  const FineScales& fine(int layer) const { return fine_.at(size_t(layer)); }
  bool any(LayerScheme s) const;
  bool any_robust() const { return any(LayerScheme::ROBUST_STATIC) || any(LayerScheme::ROBUST_DYNAMIC); }
  // The scale mode a book must have for this plan (static for TENSOR_STATIC / ROBUST_STATIC layers):
  // throws fovea::Error (prefixed by `what`) unless `book` matches, layers included.
  void check_book(const ScaleBook& book, const std::string& what) const;
  // One line: each scheme with its layers, e.g. "robust static on layers 1,2; tensor static on 0".
  std::string describe() const;

 private:
  std::vector<LayerScheme> schemes_;
  std::vector<FineScales> fine_;  // [layers]; empty except on ROBUST_STATIC layers
};

}  // namespace fovea
