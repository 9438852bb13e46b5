// fovea/rope.h: Qwen3-VL's 2D vision RoPE on the host (docs/encoder.md §RoPE): tables and application.
#pragma once
#include <vector>

#include "fovea/attention.h"

namespace fovea {

// cos/sin tables [N, hd/2] for a packed batch whose segment s is a grid of rows x cols patches in
// row-major order, rows*cols = len_s (cols = floor(sqrt(len)), so any length works): the first hd/4
// angles are row * inv_freq[j], the next hd/4 col * inv_freq[j], inv_freq[j] = 10000^(-2j/(hd/2)).
// (The encoder's real tables follow the merge-window order (docs/encoder.md §Merge-window order); this helper is for
// tests and benchmarks, where any valid positions do.)
void rope_tables_grid(const VarlenShape& shape, std::vector<float>& cos, std::vector<float>& sin);

// Rotates the q and k heads of a fused [N, 3, H, hd] fp32 buffer in place, rotate-half convention,
// products and sums rounded separately (no FMA), exactly as the GPU prepare step does.
void apply_rope_qk(const VarlenShape& shape, const std::vector<float>& cos, const std::vector<float>& sin,
                   std::vector<float>& qkv);

}  // namespace fovea
