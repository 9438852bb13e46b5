// The Qwen3-VL vision encoder forward on the GPU (fovea/encoder.h): bf16 activations, cuBLASLt
// GEMMs with the bias, the block MLP's tanh-GELU and the residual adds fused into their epilogues,
// LayerNorm and the mergers' exact GELU as small kernels, FOVEA attention (prepare + attend).
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <type_traits>

#include "attention/cuda/kernels.cuh"
#include "fovea/bf16.h"
#include "fovea/cuda-support.h"
#include "fovea/encoder.h"
#include "fovea/threads.h"

namespace fovea::qwen3vl::cuda {

namespace {

using bf16 = __nv_bfloat16;
using fovea::cuda::DeviceBuffer;

// Device allocations freed together with the list (the weights, or one plan's buffers): every
// allocation enters its owner before anything is copied, so nothing leaks when a later step throws.
using Owner = std::vector<DeviceBuffer<uint8_t>>;
template <class T>
T* alloc_in(Owner& owner, size_t count) {
  owner.emplace_back(count * sizeof(T));
  return reinterpret_cast<T*>(owner.back().data());
}

// Host conversions of whole activations (tens of millions of values per image batch) run on every
// core in chunks; on one core they cost more than the forward itself (bench mm-processor's
// "upload" and "download" stages).
constexpr int64_t kConvertGrain = 1 << 16;
void to_bf16(const float* v, size_t count, uint16_t* out) {
  parallel_ranges(int64_t(count), kConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = bf16_from_float(v[i]);
  });
}

bf16* upload_bf16(const std::vector<float>& v, Owner& owner) {
  std::vector<uint16_t> h(v.size());
  to_bf16(v.data(), v.size(), h.data());
  bf16* d = alloc_in<bf16>(owner, v.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}
float* upload_f32(const std::vector<float>& v, Owner& owner) {
  float* d = alloc_in<float>(owner, v.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

struct DevLinear {
  bf16* w = nullptr;
  bf16* b = nullptr;
  int out = 0, in = 0;
};
struct DevNorm {
  float* w = nullptr;
  float* b = nullptr;
  int width = 0;
};

// LayerNorm over `width` columns (a multiple of 8), one block per row: each thread holds kChunks
// runs of 8 columns in registers (one 16-byte load and one 16-byte store each), so the row is read
// from memory once; fp32 statistics in two passes over the registers (mean, then the mean squared
// deviation), bf16 in and out. Measured before (one 128-thread block per row, 2-byte accesses, three
// passes through L1): 300 us for 3 x 4K's 97920 rows of 1152, 34% of the copy bandwidth.
constexpr int kLnMaxThreads = 1024, kLnMaxChunks = 8;  // widths up to 65536

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) s += red[i];
  __syncthreads();  // red is written again by the next call
  return s;
}

template <int kChunks>
__global__ void layernorm_kernel(const bf16* __restrict__ x, bf16* __restrict__ y, const float* __restrict__ w,
                                 const float* __restrict__ b, int width) {
  __shared__ float red[kLnMaxThreads / 32];
  const int runs = width / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x + int64_t(blockIdx.x) * width);
  uint4* yr = reinterpret_cast<uint4*>(y + int64_t(blockIdx.x) * width);
  float v[kChunks][8];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int run = threadIdx.x + c * int(blockDim.x);
    const uint4 raw = run < runs ? xr[run] : make_uint4(0, 0, 0, 0);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      v[c][2 * j] = f.x, v[c][2 * j + 1] = f.y;
      s += f.x + f.y;
    }
  }
  const float mean = block_sum(s, red) / float(width);
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (threadIdx.x + c * int(blockDim.x) >= runs) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) q += (v[c][j] - mean) * (v[c][j] - mean);
  }
  const float inv = rsqrtf(block_sum(q, red) / float(width) + 1e-6f);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int run = threadIdx.x + c * int(blockDim.x);
    if (run >= runs) continue;
    const float4* w4 = reinterpret_cast<const float4*>(w) + 2 * run;
    const float4* b4 = reinterpret_cast<const float4*>(b) + 2 * run;
    const float4 wa = w4[0], wb = w4[1], ba = b4[0], bb = b4[1];
    const float ws[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    const float bs[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 p = __floats2bfloat162_rn((v[c][2 * j] - mean) * inv * ws[2 * j] + bs[2 * j],
                                                     (v[c][2 * j + 1] - mean) * inv * ws[2 * j + 1] + bs[2 * j + 1]);
      o[j] = *reinterpret_cast<const uint32_t*>(&p);
    }
    yr[run] = out;
  }
}

// The block size and chunk count for a width, or {0, 0} where the kernel cannot take it.
struct LnShape {
  int threads = 0, chunks = 0;
};
LnShape layernorm_shape(int width) {
  if (width <= 0 || width % 8 != 0) return {};
  const int runs = width / 8;
  for (int chunks = 1; chunks <= kLnMaxChunks; chunks *= 2) {
    const int threads = ((runs + chunks - 1) / chunks + 31) / 32 * 32;
    if (threads <= kLnMaxThreads) return {threads, chunks};
  }
  return {};
}

// One image of a batch for grid_tables_kernel: its first row and its grid.
struct ImageDesc {
  int64_t base;
  int32_t t, h, w, pad;
};

// The tables that depend only on the grids, one block per patch row of the batch: the learned
// position table resampled bilinearly to the patch's image (bf16, added in the patch GEMM's epilogue)
// and its RoPE cos / sin rows, gathered from the [side][hd/4] frequency tables. Every float
// operation is the one position_embedding() does on the host, in its order and rounded alike (no
// fused multiply-adds), so both give the same bits.
__global__ void grid_tables_kernel(const ImageDesc* __restrict__ images, int num_images, const float* __restrict__ table,
                                   int G, int D, const float* __restrict__ freq_cos, const float* __restrict__ freq_sin,
                                   int quarter, bf16* __restrict__ pe, float* __restrict__ cos, float* __restrict__ sin) {
  const int64_t i = blockIdx.x;
  int lo = 0, hi = num_images - 1;  // the last image whose first row is <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (images[mid].base <= i) lo = mid;
    else hi = mid - 1;
  }
  const ImageDesc im = images[lo];
  const int64_t q = (i - im.base) % (int64_t(im.h) * im.w);  // index in its frame, merge-window order
  const int64_t window = q / 4;
  const int r = int(window / (im.w / 2)) * 2 + int(q % 4) / 2, c = int(window % (im.w / 2)) * 2 + int(q % 2);
  const float sr = im.h == 1 ? 0.f : __fmul_rn(float(r), __fdiv_rn(float(G - 1), float(im.h - 1)));
  const float sc = im.w == 1 ? 0.f : __fmul_rn(float(c), __fdiv_rn(float(G - 1), float(im.w - 1)));
  const int r0 = int(floorf(sr)), c0 = int(floorf(sc));
  const int r1 = min(r0 + 1, G - 1), c1 = min(c0 + 1, G - 1);
  const float fr = __fsub_rn(sr, float(r0)), fc = __fsub_rn(sc, float(c0));
  const float w00 = __fmul_rn(__fsub_rn(1.f, fr), __fsub_rn(1.f, fc)), w01 = __fmul_rn(__fsub_rn(1.f, fr), fc);
  const float w10 = __fmul_rn(fr, __fsub_rn(1.f, fc)), w11 = __fmul_rn(fr, fc);
  const float* e00 = table + int64_t(r0 * G + c0) * D;
  const float* e01 = table + int64_t(r0 * G + c1) * D;
  const float* e10 = table + int64_t(r1 * G + c0) * D;
  const float* e11 = table + int64_t(r1 * G + c1) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = __fadd_rn(__fmul_rn(w00, e00[d]), __fmul_rn(w01, e01[d]));
    v = __fadd_rn(__fadd_rn(v, __fmul_rn(w10, e10[d])), __fmul_rn(w11, e11[d]));
    pe[i * D + d] = __float2bfloat16_rn(v);
  }
  const int half = 2 * quarter;
  for (int d = threadIdx.x; d < half; d += blockDim.x) {  // dims [0, hd/4) by the row, the rest by the column
    const int at = (d < quarter ? r : c) * quarter + d % quarter;
    cos[i * half + d] = freq_cos[at];
    sin[i * half + d] = freq_sin[at];
  }
}

// Raw uint8 patches [rows, 3, plane] to the encoder's bf16 pixels [rows, 3, T, plane]: rescale and
// normalize as image::patchify does on the host, (x - mean*255) / (std*255) in float32, correctly
// rounded (no contraction), then rounded to bf16 as the host's upload does; every frame the same.
struct Normalize {
  float mean255[3], std255[3];
};
__global__ void normalize_kernel(const uint8_t* __restrict__ raw, bf16* __restrict__ px, int64_t rows, int plane, int T,
                                 Normalize nm) {
  const int64_t row = 3 * int64_t(T) * plane, total = rows * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row;
    const int col = int(i % row), c = col / (T * plane), k = col % plane;
    const float v = float(raw[r * 3 * plane + int64_t(c) * plane + k]);
    px[i] = __float2bfloat16_rn(__fdiv_rn(__fsub_rn(v, nm.mean255[c]), nm.std255[c]));
  }
}

__global__ void gelu_erf_kernel(bf16* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(x[i]);
    x[i] = __float2bfloat16_rn(0.5f * v * (1.f + erff(v * 0.70710678118654752f)));
  }
}

// D[M, N] = A[M, K] W[N, K]^T + bias (+ C) (tanh-GELU), row-major bf16, fp32 accumulation. In
// cuBLASLt's column-major terms: D^T (N x M) = W^T... i.e. op(W) = T on the K x N view of W.
class Gemm {
 public:
  Gemm() : workspace_(kWorkspace) { FOVEA_CUDA_CHECK(cublasLtCreate(&handle_)); }
  ~Gemm() { cublasLtDestroy(handle_); }
  void run(const bf16* a, const DevLinear& w, bf16* d, int64_t m, const bf16* c, bool gelu, cudaStream_t stream) {
    cublasLtMatmulDesc_t op;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const cublasLtEpilogue_t epi = gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    const void* bias = w.b;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const cudaDataType_t bias_type = CUDA_R_16BF;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    cublasLtMatrixLayout_t la, lb, lc;
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, w.in, w.out, w.in));  // W: K x N
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, w.in, m, w.in));      // A: K x M
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, w.out, m, w.out));    // C, D: N x M
    const float alpha = 1.f, beta = c ? 1.f : 0.f;
    const auto key = std::make_tuple(m, w.out, w.in, gelu, c != nullptr);
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulPreference_t pref;
      FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      const size_t ws = kWorkspace;
      FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      FOVEA_CUDA_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &result, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      if (found == 0) fail_cat("cuBLASLt has no algorithm for [", m, " x ", w.in, "] x [", w.in, " x ", w.out, "]");
      it = algos_.emplace(key, result.algo).first;
    }
    FOVEA_CUDA_CHECK(cublasLtMatmul(handle_, op, &alpha, w.w, la, a, lb, &beta, c ? c : d, lc, d, lc, &it->second,
                                    workspace_.data(), kWorkspace, stream));
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }

 private:
  static constexpr size_t kWorkspace = size_t(32) << 20;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  std::map<std::tuple<int64_t, int, int, bool, bool>, cublasLtMatmulAlgo_t> algos_;
};

DevLinear upload(const Linear& l, Owner& owner) {
  return {upload_bf16(l.w, owner), upload_bf16(l.b, owner), l.out, l.in};
}
DevNorm upload(const Norm& n, Owner& owner) {
  return {upload_f32(n.w, owner), upload_f32(n.b, owner), int(n.w.size())};
}

struct DevBlock {
  DevNorm norm1, norm2;
  DevLinear qkv, proj, fc1, fc2;
};
struct DevMerger {
  DevNorm norm;
  DevLinear fc1, fc2;
};

}  // namespace

struct Encoder::Impl {
  VisionConfig cfg;
  EncoderOptions opt;
  Gemm gemm;
  Owner owned;  // weights and scale state
  DevLinear patch;
  float* pos_table = nullptr;  // device [G*G, hidden], resampled to the grids per plan()
  std::vector<DevBlock> blocks;
  DevMerger merger;
  std::vector<DevMerger> deepstack;
  std::unique_ptr<fovea::cuda::FlashAttention> attn;
  LayerAmax* amax = nullptr;    // FP8 dynamic / calibrate: [depth] rings on the device
  float* fixed = nullptr;       // FP8 static: [depth][3]
  // Per plan():
  std::vector<GridThw> grids;
  int64_t n = 0;
  uint8_t* raw = nullptr;  // raw uint8 patches, when uploaded in that form
  bf16 *pixels = nullptr, *pe = nullptr, *x = nullptr, *ln = nullptr, *qkv = nullptr, *att = nullptr, *h = nullptr;
  bf16 *m1 = nullptr, *m2 = nullptr, *merged = nullptr;
  std::vector<bf16*> ds;
  float *cos = nullptr, *sin = nullptr;
  // Every per-batch device buffer is a slice of one arena, grown (never shrunk) when a batch needs
  // more than it holds, so a new set of grids allocates nothing unless it is the largest yet.
  DeviceBuffer<uint8_t> arena;
  // The RoPE frequency tables (cos, then sin: [side][hd/4] each) for positions up to rope_side, and
  // the batch's image descriptors for grid_tables_kernel.
  DeviceBuffer<float> rope_freq;
  int rope_side = 0;
  DeviceBuffer<ImageDesc> images;
  // Host staging: pinned, reused, two of each so the host fills one batch's while the GPU copies the
  // last one's (each waits for its previous copy's event before it is written again).
  fovea::cuda::StagingSlot plan_in[2], pixels_in[2];
  int next_plan = 0, next_pixels = 0;
  void* staged = nullptr;  // the slot pixel_staging() or raw_staging() gave, until it is uploaded
  int staged_slot = -1;
  void* take_staging(size_t bytes);
  void upload_from_staging(void* to, size_t bytes, cudaStream_t stream);
  struct OutSlot {
    fovea::cuda::StagingSlot mem;
    size_t count = 0, outputs = 0;  // values per output, outputs copied
    bool amax = false;               // the FP8 rings follow the outputs
    int64_t ticket = -1;             // the download it holds until collected; -1: free
  } out[2];
  int64_t next_ticket = 0;

  void layout_arena(int64_t n);  // points every buffer above into the arena, growing it if needed
  void grid_tables(const std::vector<GridThw>& grids, cudaStream_t stream);
  template <class T>
  void collect(int64_t ticket, std::vector<std::vector<T>>& out);
  std::vector<std::span<const uint16_t>> collect_views(int64_t ticket);
  void layernorm(const bf16* in, bf16* out, const DevNorm& nrm, int64_t rows, cudaStream_t s) {
    const LnShape ln = layernorm_shape(nrm.width);  // checked for every norm at construction
    const auto launch = [&](auto kernel) { kernel<<<unsigned(rows), unsigned(ln.threads), 0, s>>>(in, out, nrm.w, nrm.b, nrm.width); };
    switch (ln.chunks) {
      case 1: launch(layernorm_kernel<1>); break;
      case 2: launch(layernorm_kernel<2>); break;
      case 4: launch(layernorm_kernel<4>); break;
      case 8: launch(layernorm_kernel<8>); break;
      default: fail_cat("encoder: no LayerNorm kernel for width ", nrm.width);
    }
    FOVEA_CUDA_CHECK(cudaGetLastError());
  }
  void run_merger(const DevMerger& mg, const bf16* in_norm, bf16* out, cudaStream_t s) {
    const int64_t rows = n / 4;
    gemm.run(in_norm, mg.fc1, m2, rows, nullptr, false, s);
    gelu_erf_kernel<<<1024, 256, 0, s>>>(m2, rows * mg.fc1.out);
    FOVEA_CUDA_CHECK(cudaGetLastError());
    gemm.run(m2, mg.fc2, out, rows, nullptr, false, s);
  }
};

Encoder::Encoder(const Model& model, const EncoderOptions& options) : impl_(new Impl) {
  Impl& m = *impl_;
  m.cfg = model.config;
  m.opt = options;
  const auto& W = model.weights;
  if (options.dtype != AttnDtype::BF16 && options.dtype != AttnDtype::FP8) fail_cat("encoder: dtype must be bf16 or fp8");
  for (const int width : {m.cfg.hidden, m.cfg.merged_dim()})
    if (layernorm_shape(width).chunks == 0)
      fail_cat("encoder: the GPU LayerNorm takes widths that are multiples of 8 up to ", 8 * kLnMaxThreads * kLnMaxChunks,
               "; this model needs ", width);
  if (options.dtype == AttnDtype::FP8) {
    if (!options.scales || options.scales->num_layers() != m.cfg.depth)
      fail_cat("encoder: FP8 attention needs a scale book with ", m.cfg.depth, " layers");
    if (options.scales->mode() == ScaleMode::STATIC) {
      std::vector<float> f;
      for (int l = 0; l < m.cfg.depth; ++l)
        for (int t = 0; t < 3; ++t) f.push_back(options.scales->scales(l)[t]);
      m.fixed = upload_f32(f, m.owned);
    } else {
      m.amax = alloc_in<LayerAmax>(m.owned, size_t(m.cfg.depth));
      FOVEA_CUDA_CHECK(cudaMemcpy(m.amax, options.scales->amax_state().data(), sizeof(LayerAmax) * size_t(m.cfg.depth),
                                  cudaMemcpyHostToDevice));
    }
  }
  auto& o = m.owned;
  m.patch = upload(W.patch_embed, o);
  m.pos_table = upload_f32(W.pos, o);
  for (const auto& b : W.blocks) {
    DevBlock d;  // one upload per statement: the order of allocations is the order of the owner list
    d.norm1 = upload(b.norm1, o);
    d.norm2 = upload(b.norm2, o);
    d.qkv = upload(b.qkv, o);
    d.proj = upload(b.proj, o);
    d.fc1 = upload(b.fc1, o);
    d.fc2 = upload(b.fc2, o);
    m.blocks.push_back(d);
  }
  auto merger = [&](const Merger& g) {
    DevMerger d;
    d.norm = upload(g.norm, o);
    d.fc1 = upload(g.fc1, o);
    d.fc2 = upload(g.fc2, o);
    return d;
  };
  m.merger = merger(W.merger);
  for (const auto& d : W.deepstack) m.deepstack.push_back(merger(d));
  m.attn = std::make_unique<fovea::cuda::FlashAttention>(options.dtype, m.cfg.heads, m.cfg.head_dim());
}

Encoder::~Encoder() = default;  // Impl frees every device allocation

int64_t Encoder::tokens() const { return impl_->n; }

void Encoder::Impl::layout_arena(int64_t n) {
  const int64_t D = cfg.hidden, I = cfg.intermediate, M4 = cfg.merged_dim(), O = cfg.out_hidden;
  struct Slice {
    void** ptr;
    size_t bytes;
  };
  ds.assign(deepstack.size(), nullptr);
  std::vector<Slice> slices = {
      {(void**)&raw, size_t(n) * cfg.patch_dim() / cfg.temporal_patch},
      {(void**)&pixels, size_t(n) * cfg.patch_dim() * 2}, {(void**)&x, size_t(n * D) * 2},
      {(void**)&ln, size_t(n * D) * 2},  {(void**)&qkv, size_t(n * 3 * D) * 2},
      {(void**)&att, size_t(n * D) * 2}, {(void**)&h, size_t(n * I) * 2},
      {(void**)&m1, size_t(n / 4 * M4) * 2}, {(void**)&m2, size_t(n / 4 * M4) * 2},
      {(void**)&merged, size_t(n / 4 * O) * 2}, {(void**)&pe, size_t(n * D) * 2},
      {(void**)&cos, size_t(n) * cfg.head_dim() / 2 * 4}, {(void**)&sin, size_t(n) * cfg.head_dim() / 2 * 4}};
  for (auto& d : ds) slices.push_back({(void**)&d, size_t(n / 4 * O) * 2});
  constexpr size_t kAlign = 256;  // cuBLASLt and TMA want 16-byte aligned rows; 256 keeps every slice apart
  size_t total = 0;
  for (const Slice& sl : slices) total += (sl.bytes + kAlign - 1) / kAlign * kAlign;
  if (arena.count() < total) arena.reset(total);
  size_t at = 0;
  for (const Slice& sl : slices) {
    *sl.ptr = arena.data() + at;
    at += (sl.bytes + kAlign - 1) / kAlign * kAlign;
  }
}

void Encoder::reserve(int64_t patches, bool with_deepstack, int batches) {
  if (patches <= 0) return;
  Impl& m = *impl_;
  m.layout_arena(patches);
  const size_t raw = size_t(patches) * m.cfg.patch_dim() / m.cfg.temporal_patch;
  const size_t outputs = 1 + (with_deepstack ? m.cfg.deepstack.size() : 0);
  const size_t rings = m.amax ? sizeof(LayerAmax) * size_t(m.cfg.depth) : 0;
  const size_t out_bytes = size_t(patches / 4) * m.cfg.out_hidden * 2 * outputs + rings;
  for (int k = 0; k < std::clamp(batches, 0, 2); ++k) {  // the slots the next batches take, in order
    const int px = (m.next_pixels + k) % 2;
    if (!(m.staged && m.staged_slot == px)) m.pixels_in[px].reserve(raw);
    Impl::OutSlot& o = m.out[(m.next_ticket + k) % 2];
    if (o.ticket < 0) o.mem.reserve(out_bytes);  // never under a download waiting to be collected
  }
}

void Encoder::Impl::grid_tables(const std::vector<GridThw>& grids, cudaStream_t stream) {
  const int quarter = cfg.head_dim() / 4;
  int side = 0;
  for (const auto& g : grids) side = std::max({side, g[1], g[2]});
  if (side > rope_side) {  // grown rarely (a larger image side than any yet): a synchronous upload
    std::vector<float> c, s;
    rope_side = std::max(side, 2 * rope_side);
    rope_frequency_table(rope_side, cfg.head_dim(), c, s);
    c.insert(c.end(), s.begin(), s.end());
    rope_freq.reset(c.size());
    FOVEA_CUDA_CHECK(cudaMemcpy(rope_freq.data(), c.data(), c.size() * 4, cudaMemcpyHostToDevice));
  }
  if (images.count() < grids.size()) images.reset(std::max(grids.size(), size_t(64)));
  fovea::cuda::StagingSlot& st = plan_in[next_plan];
  next_plan ^= 1;
  auto* desc = reinterpret_cast<ImageDesc*>(st.take(grids.size() * sizeof(ImageDesc)));
  int64_t base = 0;
  for (size_t k = 0; k < grids.size(); ++k) {
    desc[k] = {base, grids[k][0], grids[k][1], grids[k][2], 0};
    base += int64_t(grids[k][0]) * grids[k][1] * grids[k][2];
  }
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(images.data(), desc, grids.size() * sizeof(ImageDesc), cudaMemcpyHostToDevice, stream));
  st.release(stream);
  grid_tables_kernel<<<unsigned(base), 128, 0, stream>>>(images.data(), int(grids.size()), pos_table, cfg.pos_side(),
                                                        cfg.hidden, rope_freq.data(), rope_freq.data() + size_t(rope_side) * quarter,
                                                        quarter, pe, cos, sin);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void Encoder::plan(const std::vector<GridThw>& grids, cudaStream_t stream) {
  Impl& m = *impl_;
  const GridShape shape = check_grids(grids, "encoder");
  if (shape.patches > std::numeric_limits<int32_t>::max())
    fail_cat("encoder: ", shape.patches, " patches in one batch; cu_seqlens are int32");
  if (m.n > 0 && m.grids == grids) return;  // the same batch shape: buffers and tables stand
  std::vector<int32_t> cu = {0};
  for (const int len : shape.seqlens) cu.push_back(cu.back() + len);
  m.n = 0;  // forward() refuses to run until this plan is complete (a throw below leaves no dangling plan)
  m.grids = grids;
  m.layout_arena(shape.patches);
  m.grid_tables(grids, stream);
  m.attn->plan(cu, stream);
  m.n = shape.patches;
}

void Encoder::grid_tables(std::vector<uint16_t>& pe, std::vector<float>& cos, std::vector<float>& sin) const {
  const Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: grid_tables() before plan()");
  pe.resize(size_t(m.n) * m.cfg.hidden);
  cos.resize(size_t(m.n) * (m.cfg.head_dim() / 2));
  sin.resize(cos.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(pe.data(), m.pe, pe.size() * 2, cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(cos.data(), m.cos, cos.size() * 4, cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(sin.data(), m.sin, sin.size() * 4, cudaMemcpyDeviceToHost));
}

void* Encoder::Impl::take_staging(size_t bytes) {
  if (n == 0) fail_cat("encoder: pixel staging before plan()");
  staged_slot = next_pixels;
  next_pixels ^= 1;
  staged = pixels_in[staged_slot].take(bytes);
  return staged;
}

void Encoder::Impl::upload_from_staging(void* to, size_t bytes, cudaStream_t stream) {
  if (!staged) fail_cat("encoder: upload without pixel staging");
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(to, staged, bytes, cudaMemcpyHostToDevice, stream));
  pixels_in[staged_slot].release(stream);
  staged = nullptr;
}

uint16_t* Encoder::pixel_staging() {
  return static_cast<uint16_t*>(impl_->take_staging(size_t(impl_->n) * impl_->cfg.patch_dim() * 2));
}

void Encoder::upload_staged(cudaStream_t stream) {
  Impl& m = *impl_;
  m.upload_from_staging(m.pixels, size_t(m.n) * m.cfg.patch_dim() * 2, stream);
}

uint8_t* Encoder::raw_staging() {
  return static_cast<uint8_t*>(impl_->take_staging(size_t(impl_->n) * impl_->cfg.patch_dim() / impl_->cfg.temporal_patch));
}

void Encoder::upload_raw(const float mean[3], const float std[3], cudaStream_t stream) {
  Impl& m = *impl_;
  const int T = m.cfg.temporal_patch, plane = m.cfg.patch * m.cfg.patch;
  m.upload_from_staging(m.raw, size_t(m.n) * m.cfg.patch_dim() / T, stream);
  Normalize nm;
  for (int c = 0; c < 3; ++c) {  // the host's float products, as patchify computes them
    nm.mean255[c] = mean[c] * 255.0f;
    nm.std255[c] = std[c] * 255.0f;
  }
  normalize_kernel<<<1024, 256, 0, stream>>>(m.raw, m.pixels, m.n, plane, T, nm);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void Encoder::upload_pixels(const std::vector<float>& pixels, cudaStream_t stream) {
  Impl& m = *impl_;
  if (int64_t(pixels.size()) != m.n * m.cfg.patch_dim())
    fail_cat("encoder: pixel_values has ", pixels.size(), " values, the plan expects ", m.n * m.cfg.patch_dim());
  to_bf16(pixels.data(), pixels.size(), pixel_staging());
  upload_staged(stream);
}

void Encoder::forward(cudaStream_t s) {
  Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: forward() before plan()");
  const int64_t n = m.n;
  const int D = m.cfg.hidden;
  m.gemm.run(m.pixels, m.patch, m.x, n, m.pe, false, s);  // patch embed + bias + position embedding
  size_t tap = 0;
  for (int l = 0; l < m.cfg.depth; ++l) {
    const DevBlock& b = m.blocks[size_t(l)];
    m.layernorm(m.x, m.ln, b.norm1, n, s);
    m.gemm.run(m.ln, b.qkv, m.qkv, n, nullptr, false, s);
    fovea::cuda::DeviceScales sc;
    if (m.amax) sc.dynamic = m.amax + l;
    if (m.fixed) sc.fixed = m.fixed + 3 * l;
    m.attn->prepare(m.qkv, 3 * int64_t(D), m.cos, m.sin, sc, s);
    m.attn->attend(m.att, s);
    m.gemm.run(m.att, b.proj, m.x, n, m.x, false, s);  // + residual, in place
    m.layernorm(m.x, m.ln, b.norm2, n, s);
    m.gemm.run(m.ln, b.fc1, m.h, n, nullptr, true, s);  // tanh-GELU in the epilogue
    m.gemm.run(m.h, b.fc2, m.x, n, m.x, false, s);
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
  if (!m.amax) return;
  auto& state = m.opt.scales->amax_state();
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(state.data(), m.amax, sizeof(LayerAmax) * state.size(), cudaMemcpyDeviceToHost, stream));
  FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void Encoder::after_forward(cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.amax || m.opt.scales->mode() != ScaleMode::CALIBRATE) return;
  sync_scales(stream);
  m.opt.scales->after_forward();
}

int64_t Encoder::download(bool with_deepstack, cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.n == 0) fail_cat("encoder: download() before plan()");
  const int64_t ticket = m.next_ticket;
  Impl::OutSlot& o = m.out[ticket % 2];
  if (o.ticket >= 0) fail_cat("encoder: the outputs of download ", o.ticket, " were never collected");
  std::vector<const bf16*> from = {m.merged};
  if (with_deepstack) from.insert(from.end(), m.ds.begin(), m.ds.end());
  o.count = size_t(m.n / 4 * m.cfg.out_hidden);
  o.outputs = from.size();
  o.amax = m.amax != nullptr;
  const size_t rings = o.amax ? sizeof(LayerAmax) * size_t(m.cfg.depth) : 0;
  uint8_t* h = o.mem.take(o.count * 2 * o.outputs + rings);
  for (size_t k = 0; k < from.size(); ++k)
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + k * o.count * 2, from[k], o.count * 2, cudaMemcpyDeviceToHost, stream));
  if (rings) FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + o.count * 2 * o.outputs, m.amax, rings, cudaMemcpyDeviceToHost, stream));
  o.mem.release(stream);
  o.ticket = ticket;
  m.next_ticket += 1;
  return ticket;
}

// Waits for download `ticket`; its outputs' views in the pinned slot. The FP8 rings copied with the
// outputs go to the scale book.
std::vector<std::span<const uint16_t>> Encoder::Impl::collect_views(int64_t ticket) {
  OutSlot& o = out[ticket % 2];
  if (ticket < 0 || o.ticket != ticket) fail_cat("encoder: download ", ticket, " is not waiting to be collected");
  o.mem.wait();
  o.ticket = -1;
  const auto* h = reinterpret_cast<const uint16_t*>(o.mem.data());
  std::vector<std::span<const uint16_t>> views;
  for (size_t k = 0; k < o.outputs; ++k) views.emplace_back(h + k * o.count, o.count);
  if (o.amax) {
    auto& state = opt.scales->amax_state();
    std::memcpy(state.data(), h + o.count * o.outputs, sizeof(LayerAmax) * state.size());
  }
  return views;
}

// collect_views(), then one vector per output filled on every core: bf16 bits as they are, or
// widened to fp32. Vectors that already hold enough keep their (warm) memory: no page faults on reuse.
template <class T>
void Encoder::Impl::collect(int64_t ticket, std::vector<std::vector<T>>& dst) {
  const std::vector<std::span<const uint16_t>> views = collect_views(ticket);
  dst.resize(views.size());
  for (size_t k = 0; k < views.size(); ++k) {
    dst[k].resize(views[k].size());
    const uint16_t* src = views[k].data();
    T* to = dst[k].data();
    parallel_ranges(int64_t(views[k].size()), kConvertGrain, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t i = b; i < e; ++i) to[i] = bf16_to_float(src[i]);
      } else {
        std::memcpy(to + b, src + b, size_t(e - b) * 2);
      }
    });
  }
}

void Encoder::collect(int64_t ticket, std::vector<std::vector<uint16_t>>& out) { impl_->collect(ticket, out); }
std::vector<std::span<const uint16_t>> Encoder::collect_views(int64_t ticket) { return impl_->collect_views(ticket); }

void Encoder::outputs_bf16(bool with_deepstack, std::vector<std::vector<uint16_t>>& out, cudaStream_t stream) {
  collect(download(with_deepstack, stream), out);
}

std::vector<float> Encoder::merged(cudaStream_t stream) {
  std::vector<std::vector<float>> out;
  impl_->collect(download(false, stream), out);
  return std::move(out[0]);
}

std::vector<std::vector<float>> Encoder::deepstack(cudaStream_t stream) {
  std::vector<std::vector<float>> out;
  impl_->collect(download(true, stream), out);
  out.erase(out.begin());  // the merged output comes first
  return out;
}

}  // namespace fovea::qwen3vl::cuda
