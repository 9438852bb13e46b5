// The fp32 CPU reference forward of the Qwen3-VL vision encoder (spec §3.11), every intermediate
// named so it can be compared with transformers. Attention goes through the CPU reference
// (exact, or the BF16 / FP8 kernel emulations with the scale book), so FP8 scaling, calibration and
// static scales run end to end on a machine without a GPU.
#include <cmath>

#include "fovea/checked.h"
#include "fovea/error.h"
#include "fovea/model.h"
#include "fovea/rope.h"
#include "fovea/threads.h"

namespace fovea::qwen3vl {

namespace {

constexpr float kLnEps = 1e-6f;

// y[M, out] = x[M, in] @ W^T + b
std::vector<float> linear(const Linear& l, const std::vector<float>& x, int64_t rows, int threads) {
  std::vector<float> y(size_t(rows) * l.out);
  parallel_for(rows, [&](int64_t r) {
    const float* xr = x.data() + r * l.in;
    float* yr = y.data() + r * l.out;
    for (int o = 0; o < l.out; ++o) {
      const float* wr = l.w.data() + int64_t(o) * l.in;
      float acc = 0.f;
      for (int i = 0; i < l.in; ++i) acc += xr[i] * wr[i];
      yr[o] = acc + l.b[size_t(o)];
    }
  }, threads, 4);
  return y;
}

std::vector<float> layer_norm(const Norm& n, const std::vector<float>& x, int64_t rows, int width) {
  std::vector<float> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * width;
    double mean = 0, var = 0;
    for (int i = 0; i < width; ++i) mean += xr[i];
    mean /= width;
    for (int i = 0; i < width; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= width;
    const float inv = float(1.0 / std::sqrt(var + kLnEps));
    for (int i = 0; i < width; ++i) y[size_t(r * width + i)] = float(xr[i] - mean) * inv * n.w[size_t(i)] + n.b[size_t(i)];
  }
  return y;
}

float gelu_tanh(float x) { return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))); }
float gelu_erf(float x) { return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f)); }

// Merger MLP: fc1, exact GELU, fc2 (spec §3.7, §3.8).
std::vector<float> merger_mlp(const Merger& m, std::vector<float> x, int64_t rows, int threads) {
  std::vector<float> h = linear(m.fc1, x, rows, threads);
  for (auto& v : h) v = gelu_erf(v);
  return linear(m.fc2, h, rows, threads);
}

}  // namespace

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
// repeated per frame (spec §3.3; fp32 weights as transformers v5 computes them).
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
    // embedding is written at its merge-window row (spec §2.5), once per frame.
    parallel_for(h, [&](int64_t r) {
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
    }, int64_t(h) * w * D >= (int64_t(1) << 20) ? 0 : 1);
    base += int64_t(t) * h * w;
  }
  return out;
}

void vision_rope_tables(const std::vector<GridThw>& grids, int head_dim, std::vector<float>& cos, std::vector<float>& sin) {
  const int half = head_dim / 2, quarter = head_dim / 4;
  std::vector<float> inv_freq(static_cast<size_t>(quarter));
  for (int j = 0; j < quarter; ++j) inv_freq[size_t(j)] = 1.0f / std::pow(10000.0f, float(2 * j) / float(half));
  const auto pos = patch_positions(grids);
  cos.assign(pos.size() * size_t(half), 0.f);
  sin.assign(cos.size(), 0.f);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int d = 0; d < half; ++d) {
      const float angle = float(pos[t][d < quarter ? 0 : 1]) * inv_freq[size_t(d % quarter)];
      cos[t * half + size_t(d)] = std::cos(angle);
      sin[t * half + size_t(d)] = std::sin(angle);
    }
}

EmbeddingError embedding_error(const std::vector<float>& out, const std::vector<float>& ref, int width) {
  if (out.size() != ref.size() || width <= 0 || out.size() % size_t(width) != 0)
    fail("embedding_error: {} values against {} (width {})", out.size(), ref.size(), width);
  double num = 0, den = 0, cos_sum = 0;
  const size_t rows = out.size() / size_t(width);
  for (size_t r = 0; r < rows; ++r) {
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < width; ++i) {
      const double x = out[r * width + i], y = ref[r * width + i];
      num += (x - y) * (x - y);
      den += y * y;
      ab += x * y, aa += x * x, bb += y * y;
    }
    cos_sum += ab / std::sqrt(aa * bb);
  }
  return {std::sqrt(num / den), rows ? cos_sum / double(rows) : 0.0};
}

ForwardResult forward_cpu(const Model& m, const std::vector<float>& pixels, const std::vector<GridThw>& grids,
                          const ForwardOptions& opt) {
  const VisionConfig& c = m.config;
  const Weights& W = m.weights;
  const int D = c.hidden, H = c.heads, hd = c.head_dim();
  int64_t N = 0;
  std::vector<int> seqlens;
  for (const auto& g : grids) {
    if (g[0] < 1 || g[1] < 2 || g[2] < 2 || g[1] % 2 || g[2] % 2)
      fail("forward: grid_thw ({}, {}, {}) must have t >= 1 and even h, w >= 2", g[0], g[1], g[2]);
    // Grids may come from files (check-golden): every product checked.
    const int hw = checked_mul(g[1], g[2], "forward: grid_thw h x w");
    for (int f = 0; f < g[0]; ++f) seqlens.push_back(hw);  // one attention segment per frame
    N = checked_add(N, checked_mul<int64_t>(g[0], hw, "forward: grid_thw t x h x w"), "forward: total patches");
  }
  if (grids.empty()) fail("forward: no images");
  if (int64_t(pixels.size()) != checked_mul<int64_t>(N, c.patch_dim(), "forward: pixel values"))
    fail("forward: pixel_values has {} values, expected N x {} = {} for the given grids", pixels.size(), c.patch_dim(),
         N * c.patch_dim());
  if (opt.attention == cpu::RefMode::FP8 && (!opt.scales || opt.scales->num_layers() != c.depth))
    fail("forward: FP8 attention needs a scale book with {} layers", c.depth);

  ForwardResult res;
  std::vector<float> x = linear(W.patch_embed, pixels, N, opt.threads);
  const std::vector<float> pe = position_embedding(c, W.pos, grids);
  for (size_t i = 0; i < x.size(); ++i) x[i] += pe[i];
  if (opt.keep_intermediates) res.intermediates["embed"] = x;

  std::vector<float> cos, sin;
  vision_rope_tables(grids, hd, cos, sin);
  const VarlenShape shape = varlen_from_seqlens(seqlens, H, hd);
  auto view = [&](const std::vector<float>& qkv, int w) {
    return ThdView<const float>{qkv.data() + int64_t(w) * H * hd, 3 * int64_t(H) * hd, hd};
  };
  size_t next_tap = 0;
  for (int layer = 0; layer < c.depth; ++layer) {
    const Block& b = W.blocks[size_t(layer)];
    std::vector<float> qkv = linear(b.qkv, layer_norm(b.norm1, x, N, D), N, opt.threads);  // [N, 3, H, hd]
    apply_rope_qk(shape, cos, sin, qkv);
    cpu::RefOptions ro;
    ro.mode = opt.attention;
    ro.threads = opt.threads;
    if (ro.mode == cpu::RefMode::FP8)
      ro.fp8_scales = opt.scales->record(layer, amax(shape, view(qkv, 0)), amax(shape, view(qkv, 1)), amax(shape, view(qkv, 2)));
    std::vector<double> attn64(size_t(N) * D);
    cpu::attention(shape, view(qkv, 0), view(qkv, 1), view(qkv, 2), ro, attn64.data());
    const std::vector<float> attn(attn64.begin(), attn64.end());
    const std::vector<float> proj = linear(b.proj, attn, N, opt.threads);
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    std::vector<float> h = linear(b.fc1, layer_norm(b.norm2, x, N, D), N, opt.threads);
    for (auto& v : h) v = gelu_tanh(v);
    const std::vector<float> mlp = linear(b.fc2, h, N, opt.threads);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
    if (opt.keep_intermediates && layer == 0) res.intermediates["block0"] = x;
    if (next_tap < c.deepstack.size() && c.deepstack[next_tap] == layer) {
      // Deepstack: shuffle [N, D] -> [N/4, 4D] first, then LayerNorm over 4D (spec §3.8).
      const Merger& dm = W.deepstack[next_tap];
      res.deepstack.push_back(merger_mlp(dm, layer_norm(dm.norm, x, N / 4, c.merged_dim()), N / 4, opt.threads));
      ++next_tap;
    }
  }
  if (opt.keep_intermediates) res.intermediates["last_hidden"] = x;
  // Final merger: LayerNorm over D per patch, then the shuffle (a no-op on the row-major buffer).
  res.merged = merger_mlp(W.merger, layer_norm(W.merger.norm, x, N, D), N / 4, opt.threads);
  if (opt.scales) opt.scales->after_forward();
  return res;
}

}  // namespace fovea::qwen3vl
