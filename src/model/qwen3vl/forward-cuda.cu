// The Qwen3-VL vision encoder forward on the GPU (fovea/encoder.h): bf16 activations, cuBLASLt
// GEMMs with the bias, the block MLP's tanh-GELU and the residual adds fused into their epilogues
// (gemm.cu), LayerNorm and the mergers' exact GELU as row kernels (rows.cu), attention through the
// FOVEA or the CUDNN backend. This file builds the encoder and runs its forward; encoder-batch.cu
// plans batches, stages their pixels and brings their outputs back.
#include <vector>

#include "fovea/bf16.h"
#include "fovea/clock.h"
#include "fovea/error.h"
#include "model/qwen3vl/encoder-impl.cuh"

namespace fovea::qwen3vl::cuda {

Encoder::Encoder(const Model& model, const EncoderOptions& options) : impl_(new Impl) {
  Impl& m = *impl_;
  m.cfg = model.config;
  m.opt = options;
  if (options.dtype != AttnDtype::BF16 && options.dtype != AttnDtype::FP8)
    fail_cat("encoder: dtype must be bf16 or fp8");
  for (const int width : {m.cfg.hidden, m.cfg.merged_dim()})
    if (!row_kernels_take(width))
      fail_cat("encoder: the GPU LayerNorm takes widths that are multiples of 8 up to ", kRowMaxWidth,
               "; this model needs ", width);
  if (options.fp8_linears && !row_kernels_take(m.cfg.intermediate))
    fail_cat("encoder: --fp8-linears quantizes rows whose width is a multiple of 8 up to ", kRowMaxWidth,
             "; this model's intermediate size is ", m.cfg.intermediate);
  if (options.dtype == AttnDtype::FP8) m.init_scales();
  m.upload_weights(model.weights);
  m.make_attention();
}

Encoder::~Encoder() = default;  // Impl frees every device allocation

int64_t Encoder::tokens() const { return impl_->n; }

// The FP8 attention's scales on the device, for the plan's schemes: static q/k/v uploaded (and the
// static guard's counts, from the book's), the book's amax rings, the file's robust arrays, or the
// arrays and histories of the dynamic robust scheme.
void Encoder::Impl::init_scales() {
  if (!opt.scales) fail_cat("encoder: FP8 attention needs a scale book with ", cfg.depth, " layers");
  plan = opt.fp8_plan ? *opt.fp8_plan : Fp8Plan::tensor(opt.scales->mode(), cfg.depth);
  plan.check_book(*opt.scales, "encoder");
  opt.fp8_plan = nullptr;  // copied
  const int H = cfg.heads, hd = cfg.head_dim();
  const size_t cells = size_t(H) * size_t(hd);
  auto arrays = [&](const FineScales* f) {  // uploads f, or allocates for the stats kernel to fill
    fovea::cuda::FineArrays a;
    auto put = [&](const std::vector<float>* v, size_t n) {
      if (v) return upload_f32(*v, owned);
      return alloc_in<float>(owned, n);
    };
    a.k_mean = put(f ? &f->k_mean : nullptr, cells);
    a.q_head = put(f ? &f->q_head : nullptr, size_t(H));
    a.k_head = put(f ? &f->k_head : nullptr, size_t(H));
    a.v_channel = put(f ? &f->v_channel : nullptr, cells);
    if (const size_t n = size_t(H) * size_t(fp8_split_pairs(hd))) {  // a file without them: no pair split
      const std::vector<int32_t> none(n, -1), &split = f && !f->qk_split.empty() ? f->qk_split : none;
      a.qk_split = alloc_in<int32_t>(owned, n);
      if (f) FOVEA_CUDA_CHECK(cudaMemcpy(a.qk_split, split.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
    return a;
  };
  if (opt.scales->mode() == ScaleMode::STATIC) {  // every layer's q/k/v (the per-tensor layers read them)
    std::vector<float> f;
    for (int l = 0; l < cfg.depth; ++l)
      for (int t = 0; t < 3; ++t) f.push_back(opt.scales->scales(l)[t]);
    fixed = upload_f32(f, owned);
    std::vector<GuardCounts> counts;  // running totals from the book's (EncoderRunner's book outlives encoders)
    for (int l = 0; l < cfg.depth; ++l) counts.push_back(opt.scales->guarded(l));
    guard = alloc_in<GuardCounts>(owned, counts.size());
    FOVEA_CUDA_CHECK(cudaMemcpy(guard, counts.data(), guard_bytes(), cudaMemcpyHostToDevice));
  }
  if (plan.any(LayerScheme::TENSOR_DYNAMIC)) {
    amax = alloc_in<LayerAmax>(owned, size_t(cfg.depth));
    FOVEA_CUDA_CHECK(cudaMemcpy(amax, opt.scales->amax_state().data(), sizeof(LayerAmax) * size_t(cfg.depth),
                                cudaMemcpyHostToDevice));
  }
  if (plan.any(LayerScheme::ROBUST_STATIC))
    for (int l = 0; l < cfg.depth; ++l)
      fine_static.push_back(plan.at(l) == LayerScheme::ROBUST_STATIC ? arrays(&plan.fine(l))
                                                                     : fovea::cuda::FineArrays{});
  if (plan.any(LayerScheme::ROBUST_DYNAMIC)) {
    fine_batch = arrays(nullptr);
    opt.scales->enable_fine(H, hd);
    for (const FineHistory& h : opt.scales->fine_state()) fine_hist.emplace_back(h);
  }
}

fovea::cuda::DeviceScales Encoder::Impl::layer_scales(int l) const {
  if (opt.dtype != AttnDtype::FP8) return {};
  switch (plan.at(l)) {
    case LayerScheme::TENSOR_STATIC: return fovea::cuda::tensor_static_scales(fixed + 3 * l, guard + l);
    case LayerScheme::TENSOR_DYNAMIC: return fovea::cuda::tensor_dynamic_scales(amax + l);
    case LayerScheme::ROBUST_STATIC: return fovea::cuda::robust_static_scales(fine_static[size_t(l)], guard + l);
    case LayerScheme::ROBUST_DYNAMIC:
      return fovea::cuda::robust_dynamic_scales(fine_batch, fine_hist[size_t(l)].ring());
  }
  return {};
}

void Encoder::Impl::upload_weights(const Weights& W) {
  auto& o = owned;
  if (opt.fp8_linears) check_fp8_linears(W);
  patch = upload(W.patch_embed, o);
  pos_table = upload_f32(W.pos, o);
  for (const auto& b : W.blocks) {
    DevBlock d;  // one upload per statement: the order of allocations is the order of the owner list
    d.norm1 = upload(b.norm1, o);
    d.norm2 = upload(b.norm2, o);
    const auto up = opt.fp8_linears ? upload_fp8 : static_cast<DevLinear (*)(const Linear&, Owner&)>(upload);
    d.qkv = up(b.qkv, o);
    d.proj = up(b.proj, o);
    d.fc1 = up(b.fc1, o);
    d.fc2 = up(b.fc2, o);
    blocks.push_back(d);
  }
  if (opt.fp8_linears && !blocks.empty()) {  // every block has the same four shapes
    const DevBlock& b = blocks.front();
    if (b.qkv.blocks && cfg.hidden % kFp8Block != 0)  // the LayerNorms write the qkv and fc1 inputs unpadded
      fail_cat("encoder: --fp8-linears runs FP8 weights in [128, 128] blocks with a hidden size that is a multiple of ",
               kFp8Block, "; this model's is ", cfg.hidden, " (run without --fp8-linears)");
    gemm.check_fp8(b.qkv, false, false);
    gemm.check_fp8(b.proj, true, false);
    gemm.check_fp8(b.fc1, false, true);
    gemm.check_fp8(b.fc2, true, false);
  }
  auto up_merger = [&](const Merger& g) {
    DevMerger d;
    d.norm = upload(g.norm, o);
    d.fc1 = upload(g.fc1, o);
    d.fc2 = upload(g.fc2, o);
    return d;
  };
  merger = up_merger(W.merger);
  for (const auto& d : W.deepstack) deepstack.push_back(up_merger(d));
}

void Encoder::Impl::make_attention() {
  if (opt.backend == AttnBackend::CUDNN) {
#if FOVEA_HAVE_CUDNN
    attn = fovea::cuda::make_cudnn_attention(opt.dtype, cfg.heads, cfg.head_dim());
#else
    fail_cat("encoder: this fovea was built without cuDNN (the CUDNN backend)");
#endif
  } else if (opt.backend == AttnBackend::FOVEA) {
    attn = std::make_unique<fovea::cuda::FlashAttention>(opt.dtype, cfg.heads, cfg.head_dim());
  } else {
    fail_cat("encoder: the GPU encoder runs the FOVEA or the CUDNN attention backend");
  }
}

void Encoder::Impl::layernorm(const bf16* in, void* out, const DevNorm& nrm, int64_t rows, cudaStream_t s,
                              float* out_scale) {
  cuda::layernorm(in, out, out_scale, nrm.w, nrm.b, nrm.width, rows, s);  // every norm's width checked at construction
}

void Encoder::Impl::quantize_rows(const bf16* in, const DevLinear& w, int64_t rows, cudaStream_t s) {
  cuda::quantize_rows(in, act8, act_scale, w.in, rows, s, w.k);
}

void Encoder::Impl::run_merger(const DevMerger& mg, const bf16* in_norm, bf16* out, cudaStream_t s) {
  const int64_t merged_rows = rows / 4;
  gemm.run(in_norm, mg.fc1, m2, merged_rows, nullptr, false, s);
  gelu_erf(m2, merged_rows * mg.fc1.out, s);
  gemm.run(m2, mg.fc2, out, merged_rows, nullptr, false, s);
}

void Encoder::forward(cudaStream_t s) {
  Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: forward() before plan()");
  if (m.budget >= 0) {
    m.graphs[size_t(m.budget)].graph->launch(s);
    m.graph_counts.replays += 1;
    return;
  }
  if (!m.graphs.empty()) m.graph_counts.eager += 1;
  m.run_layers(*m.attn, s);
}

int Encoder::capture_graphs(cudaStream_t stream) {
  Impl& m = *impl_;
  const GraphBudgets& gb = m.opt.graphs;
  if (!gb.on()) return 0;
  if (!m.graphs.empty()) fail_cat("encoder: capture_graphs() twice");
  if (m.opt.backend != AttnBackend::FOVEA)
    fail_cat("encoder: CUDA graphs per token budget need the FOVEA attention backend (segments read on the device)");
  if (gb.max_items < 1) fail_cat("encoder: CUDA graphs need max_items >= 1, got ", gb.max_items);
  const auto t = Clock::now();
  const int64_t per = int64_t(m.cfg.merge) * m.cfg.merge;
  m.n = 0, m.budget = -1;
  m.grids.clear();
  m.layout_arena(gb.tokens.back() * per);  // the arena for the largest budget, before any graph holds it
  for (const int64_t tokens : gb.tokens) {
    Impl::BudgetGraph g;
    g.patches = tokens * per;
    g.attn = std::make_unique<fovea::cuda::FlashAttention>(m.opt.dtype, m.cfg.heads, m.cfg.head_dim());
    g.attn->plan_capacity(g.patches, gb.max_items);
    g.cu.reset(size_t(gb.max_items) + 1);
    FOVEA_CUDA_CHECK(cudaMemsetAsync(g.cu.data(), 0, g.cu.count() * sizeof(int32_t), stream));  // no segments yet
    m.graphs.push_back(std::move(g));
  }
  FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Captured on a stream of its own (the caller's may be the legacy default stream, which cannot be
  // captured), in thread-local mode so that other threads' CUDA calls go on; replayed on the caller's.
  const fovea::cuda::Stream cap;
  for (Impl::BudgetGraph& g : m.graphs) {
    m.layout_arena(g.patches);
    m.rows = g.patches;
    g.graph = std::make_unique<fovea::cuda::Graph>(
        cap.get(),
        [&] {
          g.attn->schedule(g.cu.data(), gb.max_items, cap.get());
          m.run_layers(*g.attn, cap.get());
        },
        cudaStreamCaptureModeThreadLocal);
  }
  m.rows = 0;
  m.graph_counts.captured = int64_t(m.graphs.size());
  m.graph_counts.capture_ms = ms_since(t);
  return int(m.graphs.size());
}

GraphCounts Encoder::graph_counts() const { return impl_->graph_counts; }

void Encoder::Impl::run_layers(fovea::cuda::Attention& attention, cudaStream_t s) {
  Impl& m = *this;
  const int64_t n = rows;
  const int D = m.cfg.hidden;
  m.gemm.run(m.pixels, m.patch, m.x, n, m.pe, false, s);  // patch embed + bias + position embedding
  size_t tap = 0;
  for (int l = 0; l < m.cfg.depth; ++l) {
    const DevBlock& b = m.blocks[size_t(l)];
    // FP8 linears: each block linear's input goes to E4M3 with per-row scales (fused into the
    // LayerNorms; its own pass for the attention output and the MLP's hidden layer).
    const bool f8 = m.opt.fp8_linears;
    auto linear = [&](const bf16* in, const DevLinear& w, bf16* out, const bf16* residual, bool gelu) {
      if (!f8) return m.gemm.run(in, w, out, n, residual, gelu, s);
      if (in) m.quantize_rows(in, w, n, s);
      if (w.blocks) repeat_row_scales(m.act_scale, n, w.k / kFp8Block, s);
      m.gemm.run_fp8(m.act8, m.act_scale, w, out, n, residual, gelu, s);
    };
    if (f8)
      m.layernorm(m.x, m.act8, b.norm1, n, s, m.act_scale);
    else
      m.layernorm(m.x, m.ln, b.norm1, n, s);
    linear(f8 ? nullptr : m.ln, b.qkv, m.qkv, nullptr, false);
    attention.prepare(m.qkv, 3 * int64_t(D), m.cos, m.sin, m.layer_scales(l), s);
    attention.attend(m.att, s);
    linear(m.att, b.proj, m.x, m.x, false);  // + residual, in place
    if (f8)
      m.layernorm(m.x, m.act8, b.norm2, n, s, m.act_scale);
    else
      m.layernorm(m.x, m.ln, b.norm2, n, s);
    linear(f8 ? nullptr : m.ln, b.fc1, m.h, nullptr, true);  // tanh-GELU in the epilogue
    linear(m.h, b.fc2, m.x, m.x, false);
    if (tap < m.cfg.deepstack.size() && m.cfg.deepstack[tap] == l) {
      // Deepstack: the [N, D] buffer is already [N/4, 4D] row-major; LayerNorm over 4D.
      m.layernorm(m.x, m.m1, m.deepstack[tap].norm, n / 4, s);
      m.run_merger(m.deepstack[tap], m.m1, m.ds[tap], s);
      ++tap;
    }
  }
  m.layernorm(m.x, m.ln, m.merger.norm, n, s);  // over D per patch, then the (free) shuffle
  m.run_merger(m.merger, m.ln, m.merged, s);
}

void Encoder::sync_scales(cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.fine_hist.empty()) {
    FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto& state = m.opt.scales->fine_state();
    for (size_t l = 0; l < m.fine_hist.size(); ++l) m.fine_hist[l].download(state[l]);
  }
  if (m.guard) {
    std::vector<GuardCounts> counts(size_t(m.cfg.depth));
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(counts.data(), m.guard, m.guard_bytes(), cudaMemcpyDeviceToHost, stream));
    FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
    m.take_guard_counts(counts.data());
  }
  if (!m.amax) return;
  auto& state = m.opt.scales->amax_state();
  FOVEA_CUDA_CHECK(
      cudaMemcpyAsync(state.data(), m.amax, sizeof(LayerAmax) * state.size(), cudaMemcpyDeviceToHost, stream));
  FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<float> linear_on_gpu(const Linear& l, const std::vector<float>& x, int64_t rows, bool fp8,
                                 const std::vector<float>* residual, bool gelu) {
  if (rows <= 0 || int64_t(x.size()) != rows * l.in)
    fail_cat("linear_on_gpu: ", x.size(), " values for ", rows, " rows of ", l.in);
  if (residual && int64_t(residual->size()) != rows * l.out)
    fail_cat("linear_on_gpu: the residual has ", residual->size(), " values");
  if (fp8 && !row_kernels_take(l.in)) fail_cat("linear_on_gpu: FP8 inputs need a width that is a multiple of 8");
  Owner o;
  Gemm gemm;
  const DevLinear w = fp8 ? upload_fp8(l, o) : upload(l, o);
  if (w.blocks && rows % 4 != 0) fail_cat("linear_on_gpu: block-scaled FP8 takes rows in multiples of 4 (", rows, ")");
  bf16* xd = upload_bf16(x, o);
  bf16* yd = residual ? upload_bf16(*residual, o) : alloc_in<bf16>(o, size_t(rows) * l.out);
  if (fp8) {
    uint8_t* codes = alloc_in<uint8_t>(o, size_t(rows) * size_t(w.k));
    float* scales = alloc_in<float>(o, size_t(rows) * size_t(w.k / kFp8Block + 1));
    quantize_rows(xd, codes, scales, l.in, rows, nullptr, w.k);
    if (w.blocks) repeat_row_scales(scales, rows, w.k / kFp8Block, nullptr);
    gemm.run_fp8(codes, scales, w, yd, rows, residual ? yd : nullptr, gelu, nullptr);
  } else {
    gemm.run(xd, w, yd, rows, residual ? yd : nullptr, gelu, nullptr);
  }
  std::vector<uint16_t> bits(size_t(rows) * l.out);
  FOVEA_CUDA_CHECK(cudaMemcpy(bits.data(), yd, bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> y(bits.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = bf16_to_float(bits[i]);
  return y;
}

}  // namespace fovea::qwen3vl::cuda
