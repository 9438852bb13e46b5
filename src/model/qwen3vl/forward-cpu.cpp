// The fp32 CPU reference forward of the Qwen3-VL vision encoder (docs/encoder.md §CPU forward), every intermediate
// named so it can be compared with transformers. Attention goes through the CPU reference
// (exact, or the BF16 / FP8 kernel emulations with the scale book), so FP8 scaling, calibration and
// static scales run end to end on a machine without a GPU.
#include <cmath>

#include "fovea/bf16.h"
#include "fovea/checked.h"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "fovea/model.h"
#include "fovea/rope.h"
#include "fovea/threads.h"

namespace fovea::qwen3vl {

namespace {

constexpr float kLnEps = 1e-6f;

// y[M, out] = x[M, in] @ W^T + b
std::vector<float> linear(const Linear& l, const std::vector<float>& x, int64_t rows, int threads) {
  std::vector<float> y(size_t(rows) * l.out);
  parallel_for(
      rows,
      [&](int64_t r) {
        const float* xr = x.data() + r * l.in;
        float* yr = y.data() + r * l.out;
        for (int o = 0; o < l.out; ++o) {
          const float* wr = l.w.data() + int64_t(o) * l.in;
          float acc = 0.f;
          for (int i = 0; i < l.in; ++i) acc += xr[i] * wr[i];
          yr[o] = acc + l.b[size_t(o)];
        }
      },
      threads, 4);
  return y;
}

// One row to E4M3 codes with its amax / 448 scale; returns the scale.
float quantize_row(const float* x, int n, uint8_t* codes) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::isnan(x[i]) || std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  const float s = e4m3_row_scale(amax);
  for (int i = 0; i < n; ++i) codes[i] = e4m3_quantize(x[i], s);
  return s;
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
    for (int i = 0; i < width; ++i)
      y[size_t(r * width + i)] = float(xr[i] - mean) * inv * n.w[size_t(i)] + n.b[size_t(i)];
  }
  return y;
}

float gelu_tanh(float x) { return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))); }
float gelu_erf(float x) { return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f)); }

// Merger MLP: fc1, exact GELU, fc2 (docs/encoder.md §Merger, §Deepstack).
std::vector<float> merger_mlp(const Merger& m, std::vector<float> x, int64_t rows, int threads) {
  std::vector<float> h = linear(m.fc1, x, rows, threads);
  for (auto& v : h) v = gelu_erf(v);
  return linear(m.fc2, h, rows, threads);
}

}  // namespace

Fp8LinearForm fp8_linear_form(const Linear& l, const std::string& name) {
  if (!l.fp8) return Fp8LinearForm::REQUANTIZED;
  const auto& b = l.fp8->block;
  if (l.fp8->out != l.out || l.fp8->in != l.in)
    fail("{}: the stored FP8 weight is [{}, {}], the linear [{}, {}]", name, l.fp8->out, l.fp8->in, l.out, l.in);
  if (b[1] == 0 && (b[0] == 0 || b[0] == 1)) return Fp8LinearForm::STORED_CHANNELS;
  if (b[0] == 128 && b[1] == 128) return Fp8LinearForm::STORED_BLOCKS;
  fail(
      "{}: --fp8-linears runs FP8 weights as stored with one scale per [128, 128] block, per output channel or "
      "per tensor; this checkpoint has blocks of [{}, {}] (run without --fp8-linears: the weights are then "
      "dequantized to BF16 at load)",
      name, b[0], b[1]);
}

void quantize_weight_rows(const Linear& l, std::vector<uint8_t>& codes, std::vector<float>& scales, int threads) {
  if (fp8_linear_form(l, "linear") == Fp8LinearForm::STORED_CHANNELS) {
    codes = l.fp8->codes;
    scales.resize(size_t(l.out));
    for (int o = 0; o < l.out; ++o) scales[size_t(o)] = l.fp8->scale_at(o, 0);
    return;
  }
  codes.resize(size_t(l.out) * size_t(l.in));
  scales.resize(size_t(l.out));
  parallel_for(
      l.out,
      [&](int64_t o) {
        std::vector<float> row(size_t(l.in));
        for (int i = 0; i < l.in; ++i) row[size_t(i)] = bf16_round(l.w[size_t(o * l.in + i)]);
        scales[size_t(o)] = quantize_row(row.data(), l.in, codes.data() + o * l.in);
      },
      threads, 16);
}

std::vector<float> linear_fp8(const Linear& l, const std::vector<float>& x, int64_t rows, int threads) {
  if (int64_t(x.size()) != rows * l.in) fail("linear_fp8: {} values for {} rows of {}", x.size(), rows, l.in);
  const bool blocks = fp8_linear_form(l, "linear") == Fp8LinearForm::STORED_BLOCKS;
  std::vector<uint8_t> wq;
  std::vector<float> ws;  // per channel; blocks: the stored grid
  if (blocks)
    wq = l.fp8->codes, ws = l.fp8->scales;
  else
    quantize_weight_rows(l, wq, ws, threads);
  std::vector<float> wf(wq.size());
  for (size_t i = 0; i < wq.size(); ++i) wf[i] = e4m3_to_float(wq[i]);
  constexpr int kB = 128;
  const int kblocks = (l.in + kB - 1) / kB;
  std::vector<float> y(size_t(rows) * l.out);
  parallel_for(
      rows,
      [&](int64_t r) {
        std::vector<uint8_t> xq(size_t(l.in));
        const float xs = quantize_row(x.data() + r * l.in, l.in, xq.data());
        std::vector<float> xf(size_t(l.in));
        for (int i = 0; i < l.in; ++i) xf[size_t(i)] = e4m3_to_float(xq[size_t(i)]);
        float* yr = y.data() + r * l.out;
        for (int o = 0; o < l.out; ++o) {
          const float* wr = wf.data() + int64_t(o) * l.in;
          if (!blocks) {
            float acc = 0.f;  // every product of two E4M3 values is exact in fp32
            for (int i = 0; i < l.in; ++i) acc += xf[size_t(i)] * wr[i];
            yr[o] = acc * xs * ws[size_t(o)] + l.b[size_t(o)];
            continue;
          }
          float acc = 0.f;  // each block's exact partial sum, scaled by its weight scale times the row's
          for (int k = 0; k < kblocks; ++k) {
            float part = 0.f;
            for (int i = k * kB; i < std::min(l.in, (k + 1) * kB); ++i) part += xf[size_t(i)] * wr[i];
            acc += part * (xs * ws[size_t((o / kB) * kblocks + k)]);
          }
          yr[o] = acc + l.b[size_t(o)];
        }
      },
      threads, 4);
  return y;
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
  const GridShape packed = check_grids(grids, "forward");
  const int64_t N = packed.patches;
  const std::vector<int>& seqlens = packed.seqlens;
  if (int64_t(pixels.size()) != checked_mul<int64_t>(N, c.patch_dim(), "forward: pixel values"))
    fail("forward: pixel_values has {} values, expected N x {} = {} for the given grids", pixels.size(), c.patch_dim(),
         N * c.patch_dim());
  Fp8Plan plan;
  if (opt.attention == cpu::RefMode::FP8) {
    if (!opt.scales) fail("forward: FP8 attention needs a scale book with {} layers", c.depth);
    plan = opt.fp8_plan ? *opt.fp8_plan : Fp8Plan::tensor(opt.scales->mode(), c.depth);
    plan.check_book(*opt.scales, "forward");
    if (plan.any(LayerScheme::ROBUST_DYNAMIC)) opt.scales->enable_fine(H, hd);
  } else if (opt.fp8_plan) {
    fail("forward: an FP8 plan for {} attention", cpu::ref_mode_name(opt.attention));
  }

  ForwardResult res;
  std::vector<float> x = linear(W.patch_embed, pixels, N, opt.threads);
  if (opt.keep_intermediates) res.intermediates["pixel_values"] = pixels, res.intermediates["patch_embed"] = x;
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
  if (opt.fp8_linears) check_fp8_linears(W);
  for (int layer = 0; layer < c.depth; ++layer) {
    const Block& b = W.blocks[size_t(layer)];
    // The blocks' linears, in FP8 when asked (the merger's and the patch embedding stay fp32).
    auto block_linear = [&](const Linear& l, const std::vector<float>& in) {
      return opt.fp8_linears ? linear_fp8(l, in, N, opt.threads) : linear(l, in, N, opt.threads);
    };
    std::vector<float> qkv = block_linear(b.qkv, layer_norm(b.norm1, x, N, D));  // [N, 3, H, hd]
    apply_rope_qk(shape, cos, sin, qkv);
    cpu::RefOptions ro;
    ro.mode = opt.attention;
    ro.threads = opt.threads;
    if (ro.mode == cpu::RefMode::FP8) {
      FineScales f;
      switch (plan.at(layer)) {
        case LayerScheme::TENSOR_STATIC:
        case LayerScheme::TENSOR_DYNAMIC:  // a static book returns its fixed scales, guarded
          ro.fp8_scales = opt.scales->record(layer, amax(shape, view(qkv, 0)), amax(shape, view(qkv, 1)),
                                             amax(shape, view(qkv, 2)));
          break;
        case LayerScheme::ROBUST_STATIC:  // the file's, K's calibrated mean included, guarded by this batch
          f = opt.scales->guard_fine(layer, plan.fine(layer),
                                     cpu::fine_batch(shape, view(qkv, 0), view(qkv, 1), view(qkv, 2)));
          break;
        case LayerScheme::ROBUST_DYNAMIC:  // this batch in the layer's history, its own K mean
          f = opt.scales->record_fine(layer, cpu::fine_batch(shape, view(qkv, 0), view(qkv, 1), view(qkv, 2)));
          break;
      }
      if (is_robust(plan.at(layer))) ro.fp8_fine = cpu::robust_fine(f);
    }
    std::vector<double> attn64(size_t(N) * D);
    cpu::attention(shape, view(qkv, 0), view(qkv, 1), view(qkv, 2), ro, attn64.data());
    const std::vector<float> attn(attn64.begin(), attn64.end());
    const std::vector<float> proj = block_linear(b.proj, attn);
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    std::vector<float> h = block_linear(b.fc1, layer_norm(b.norm2, x, N, D));
    for (auto& v : h) v = gelu_tanh(v);
    const std::vector<float> mlp = block_linear(b.fc2, h);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
    if (opt.keep_intermediates) {  // transformers' module names: blocks.<l>.attn and .mlp, before the residual adds
      const std::string at = "blocks." + std::to_string(layer);
      res.intermediates[at + ".attn"] = proj;
      res.intermediates[at + ".mlp"] = mlp;
      res.intermediates[at] = x;
    }
    if (next_tap < c.deepstack.size() && c.deepstack[next_tap] == layer) {
      // Deepstack: shuffle [N, D] -> [N/4, 4D] first, then LayerNorm over 4D (docs/encoder.md §Deepstack).
      const Merger& dm = W.deepstack[next_tap];
      res.deepstack.push_back(merger_mlp(dm, layer_norm(dm.norm, x, N / 4, c.merged_dim()), N / 4, opt.threads));
      ++next_tap;
    }
  }
  // Final merger: LayerNorm over D per patch, then the shuffle (a no-op on the row-major buffer).
  res.merged = merger_mlp(W.merger, layer_norm(W.merger.norm, x, N, D), N / 4, opt.threads);
  if (opt.keep_intermediates) {
    res.intermediates["merger"] = res.merged;
    for (size_t k = 0; k < res.deepstack.size(); ++k)
      res.intermediates["deepstack_merger_list." + std::to_string(k)] = res.deepstack[k];
  }
  return res;
}

}  // namespace fovea::qwen3vl
