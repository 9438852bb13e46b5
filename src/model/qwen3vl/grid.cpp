// Grid tables of the Qwen3-VL vision encoder, shared by the CPU and GPU forwards: the batch shape a
// set of grid_thw gives, each patch's (row, col) in merge-window order, the learned position table
// resampled to each grid, and the 2D RoPE cos / sin tables (docs/encoder.md).
#include <algorithm>
#include <cmath>

#include "fovea/checked.h"
#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/model.h"
#include "fovea/threads.h"

namespace fovea::qwen3vl {

GridShape check_grids(const std::vector<GridThw>& grids, const std::string& what) {
  GridShape s;
  for (const auto& g : grids) {
    if (g[0] < 1 || g[1] < 2 || g[2] < 2 || g[1] % 2 || g[2] % 2)
      fail("{}: grid_thw ({}, {}, {}) must have t >= 1 and even h, w >= 2", what, g[0], g[1], g[2]);
    // Grids may come from files (check-golden): every product checked.
    const int hw = checked_mul(g[1], g[2], (what + ": grid_thw h x w").c_str());
    for (int f = 0; f < g[0]; ++f) s.seqlens.push_back(hw);  // one attention segment per frame
    s.patches = checked_add(s.patches, checked_mul<int64_t>(g[0], hw, (what + ": grid_thw t x h x w").c_str()),
                            (what + ": total patches").c_str());
  }
  if (grids.empty()) fail("{}: no images", what);
  return s;
}

std::vector<std::array<int, 2>> patch_positions(const std::vector<GridThw>& grids) {
  std::vector<std::array<int, 2>> pos;
  for (const auto& g : grids)
    for (int f = 0; f < g[0]; ++f)
      for (int bh = 0; bh < g[1] / 2; ++bh)
        for (int bw = 0; bw < g[2] / 2; ++bw)
          for (int mh = 0; mh < 2; ++mh)
            for (int mw = 0; mw < 2; ++mw) pos.push_back({2 * bh + mh, 2 * bw + mw});
  return pos;
}

// Bilinear resampling of the 48x48 position table to each image's grid, merge-window order,
// repeated per frame (docs/encoder.md §Position embedding; fp32 weights as transformers v5 computes them).
std::vector<float> position_embedding(const VisionConfig& c, const std::vector<float>& table,
                                      const std::vector<GridThw>& grids) {
  const int G = c.pos_side(), D = c.hidden;
  int64_t total = 0;
  for (const auto& g : grids) total += int64_t(g[0]) * g[1] * g[2];
  std::vector<float> out(size_t(total) * D);
  int64_t base = 0;  // first row of this image
  for (const auto& g : grids) {
    const int t = g[0], h = g[1], w = g[2];
    // Rows of the grid in parallel (a 4K image has 32640 patches of 1152 values); each patch's
    // embedding is written at its merge-window row (docs/encoder.md §Merge-window order), once per frame.
    parallel_for(
        h,
        [&](int64_t r) {
          for (int col = 0; col < w; ++col) {
            const float sr = h == 1 ? 0.f : float(r) * (float(G - 1) / float(h - 1));
            const float sc = w == 1 ? 0.f : float(col) * (float(G - 1) / float(w - 1));
            const int r0 = int(std::floor(sr)), c0 = int(std::floor(sc));
            const int r1 = std::min(r0 + 1, G - 1), c1 = std::min(c0 + 1, G - 1);
            const float fr = sr - float(r0), fc = sc - float(c0);
            const float w00 = (1 - fr) * (1 - fc), w01 = (1 - fr) * fc, w10 = fr * (1 - fc), w11 = fr * fc;
            const float* e00 = table.data() + int64_t(r0 * G + c0) * D;
            const float* e01 = table.data() + int64_t(r0 * G + c1) * D;
            const float* e10 = table.data() + int64_t(r1 * G + c0) * D;
            const float* e11 = table.data() + int64_t(r1 * G + c1) * D;
            const int64_t row = ((r / 2) * (w / 2) + col / 2) * 4 + (r % 2) * 2 + col % 2;
            float* dst = out.data() + (base + row) * D;
            for (int d = 0; d < D; ++d) dst[d] = w00 * e00[d] + w01 * e01[d] + w10 * e10[d] + w11 * e11[d];
            for (int f = 1; f < t; ++f) std::copy(dst, dst + D, dst + int64_t(f) * h * w * D);
          }
        },
        int64_t(h) * w * D >= (int64_t(1) << 20) ? 0 : 1);
    base += int64_t(t) * h * w;
  }
  return out;
}

void rope_frequency_table(int positions, int head_dim, std::vector<float>& cos, std::vector<float>& sin) {
  const int half = head_dim / 2, quarter = head_dim / 4;
  cos.assign(size_t(positions) * size_t(quarter), 0.f);
  sin.assign(cos.size(), 0.f);
  for (int j = 0; j < quarter; ++j) {
    const float inv_freq = 1.0f / std::pow(10000.0f, float(2 * j) / float(half));
    for (int p = 0; p < positions; ++p) {
      const float angle = float(p) * inv_freq;
      cos[size_t(p) * quarter + size_t(j)] = std::cos(angle);
      sin[size_t(p) * quarter + size_t(j)] = std::sin(angle);
    }
  }
}

void vision_rope_tables(const std::vector<GridThw>& grids, int head_dim, std::vector<float>& cos,
                        std::vector<float>& sin) {
  const int half = head_dim / 2, quarter = head_dim / 4;
  int side = 0;
  for (const auto& g : grids) side = std::max({side, g[1], g[2]});
  std::vector<float> tc, ts;
  rope_frequency_table(side, head_dim, tc, ts);
  const auto pos = patch_positions(grids);
  cos.assign(pos.size() * size_t(half), 0.f);
  sin.assign(cos.size(), 0.f);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int d = 0; d < half; ++d) {  // dims [0, hd/4) rotate by the row, [hd/4, hd/2) by the column
      const size_t at = size_t(pos[t][d < quarter ? 0 : 1]) * quarter + size_t(d % quarter);
      cos[t * half + size_t(d)] = tc[at];
      sin[t * half + size_t(d)] = ts[at];
    }
}

int GraphBudgets::pick(int64_t merged_tokens, int64_t segments) const {
  if (segments > max_items) return -1;
  for (size_t k = 0; k < tokens.size(); ++k)
    if (merged_tokens <= tokens[k]) return int(k);
  return -1;
}

}  // namespace fovea::qwen3vl
