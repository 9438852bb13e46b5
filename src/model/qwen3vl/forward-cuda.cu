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
#include "attention/cuda/ptx.cuh"
#include "fovea/bf16.h"
#include "fovea/cuda-support.h"
#include "fovea/encoder.h"
#include "fovea/fp8.h"
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
  uint8_t* q = nullptr;  // FP8 linears: E4M3 codes [out, in] instead of w, and
  float* qs = nullptr;   // their per-channel dequantization scales [out]
};
struct DevNorm {
  float* w = nullptr;
  float* b = nullptr;
  int width = 0;
};

// LayerNorm over `width` columns (a multiple of 8), kLnRows rows a block, one after the other: each
// thread holds kChunks runs of 8 columns in registers (one 16-byte load and one 16-byte store each),
// so a row is read from memory once, and its runs of the weight and bias, loaded once for all the
// block's rows; the next row's load is in flight while this one is reduced. fp32 statistics in two
// passes over the registers (mean, then the mean squared deviation), bf16 in and out. Measured
// (3 x 4K, 97920 rows of 1152): one 128-thread block a row with 2-byte accesses and three passes
// through L1, 300 us (34% of the copy bandwidth); one block a row with 16-byte accesses, 174 us
// (58%; 40% of its sectors excess: the weight and bias re-read for every row).
constexpr int kLnMaxThreads = 1024, kLnMaxChunks = 8;  // widths up to 65536
constexpr int kLnRows = 4;

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) s += red[i];
  __syncthreads();  // red is written again by the next call
  return s;
}

__device__ __forceinline__ unsigned block_max(unsigned v, unsigned* red) {
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned m = 0;
  for (int i = 0; i < int(blockDim.x / 32); ++i) m = max(m, red[i]);
  __syncthreads();
  return m;
}

// The FP8 linears' activations (docs/fp8.md §FP8 linears): one row, held as kChunks runs of 8 values
// a thread, to E4M3 codes with the row's amax / 448 scale (fovea::e4m3_row_scale; the amax over
// |x| as float bits, so a NaN wins and propagates).
template <int kChunks>
__device__ __forceinline__ void store_row_fp8(const float (&v)[kChunks][8], int runs, uint8_t* codes, float* scale,
                                              unsigned* red) {
  unsigned m = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
    if (threadIdx.x + c * int(blockDim.x) < runs)
#pragma unroll
      for (int j = 0; j < 8; ++j) m = max(m, __float_as_uint(fabsf(v[c][j])));
  const float s = e4m3_row_scale(__uint_as_float(block_max(m, red)));
  if (threadIdx.x == 0) *scale = s;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int run = threadIdx.x + c * int(blockDim.x);
    if (run >= runs) continue;
    const float* x = v[c];
    reinterpret_cast<uint2*>(codes)[run] =
        make_uint2(fovea::cuda::ptx::pack_e4m3x4(__fdiv_rn(x[0], s), __fdiv_rn(x[1], s), __fdiv_rn(x[2], s), __fdiv_rn(x[3], s)),
                   fovea::cuda::ptx::pack_e4m3x4(__fdiv_rn(x[4], s), __fdiv_rn(x[5], s), __fdiv_rn(x[6], s), __fdiv_rn(x[7], s)));
  }
}

// This thread's kChunks runs of 8 bf16 of one row (zeros past the row), and as floats.
template <int kChunks>
__device__ __forceinline__ void load_runs(const bf16* row, int runs, uint4 (&raw)[kChunks]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int run = threadIdx.x + c * int(blockDim.x);
    raw[c] = run < runs ? reinterpret_cast<const uint4*>(row)[run] : make_uint4(0, 0, 0, 0);
  }
}
template <int kChunks>
__device__ __forceinline__ void unpack_runs(const uint4 (&raw)[kChunks], float (&v)[kChunks][8]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[c]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      v[c][2 * j] = f.x, v[c][2 * j + 1] = f.y;
    }
  }
}
// This thread's runs of an fp32 vector of `width` (zeros past it).
template <int kChunks>
__device__ __forceinline__ void load_runs_f32(const float* p, int runs, float (&v)[kChunks][8]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int run = threadIdx.x + c * int(blockDim.x);
    const float4 a = run < runs ? reinterpret_cast<const float4*>(p)[2 * run] : make_float4(0, 0, 0, 0);
    const float4 b = run < runs ? reinterpret_cast<const float4*>(p)[2 * run + 1] : make_float4(0, 0, 0, 0);
    v[c][0] = a.x, v[c][1] = a.y, v[c][2] = a.z, v[c][3] = a.w, v[c][4] = b.x, v[c][5] = b.y, v[c][6] = b.z, v[c][7] = b.w;
  }
}

// y: bf16 [rows, width]; or with kFp8Out, the bf16-rounded result as E4M3 codes [rows, width] and
// one scale per row in y_scale (the qkv and fc1 inputs of the FP8 linears).
template <int kChunks, bool kFp8Out>
__global__ void layernorm_kernel(const bf16* __restrict__ x, void* __restrict__ y, float* __restrict__ y_scale,
                                 const float* __restrict__ w, const float* __restrict__ b, int width, int64_t rows) {
  __shared__ float red[kLnMaxThreads / 32];
  const int runs = width / 8;
  float ws[kChunks][8], bs[kChunks][8];
  load_runs_f32<kChunks>(w, runs, ws);
  load_runs_f32<kChunks>(b, runs, bs);
  const int64_t first = int64_t(blockIdx.x) * kLnRows, last = first + kLnRows < rows ? first + kLnRows : rows;
  uint4 raw[kChunks];
  load_runs<kChunks>(x + first * width, runs, raw);
  for (int64_t r = first; r < last; ++r) {
    float v[kChunks][8];
    unpack_runs<kChunks>(raw, v);
    if (r + 1 < last) load_runs<kChunks>(x + (r + 1) * width, runs, raw);  // in flight while this row is reduced
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) s += v[c][2 * j] + v[c][2 * j + 1];  // zeros past the row
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
      uint4 out;
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 p = __floats2bfloat162_rn((v[c][2 * j] - mean) * inv * ws[c][2 * j] + bs[c][2 * j],
                                                       (v[c][2 * j + 1] - mean) * inv * ws[c][2 * j + 1] + bs[c][2 * j + 1]);
        o[j] = *reinterpret_cast<const uint32_t*>(&p);
        if constexpr (kFp8Out) {
          const float2 f = __bfloat1622float2(p);
          v[c][2 * j] = f.x, v[c][2 * j + 1] = f.y;
        }
      }
      if constexpr (!kFp8Out) reinterpret_cast<uint4*>(static_cast<bf16*>(y) + r * width)[run] = out;
    }
    if constexpr (kFp8Out)
      store_row_fp8<kChunks>(v, runs, static_cast<uint8_t*>(y) + r * width, y_scale + r, reinterpret_cast<unsigned*>(red));
  }
}

// bf16 activations [rows, width] to E4M3 codes and per-row scales (the proj and fc2 inputs).
template <int kChunks>
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ scale,
                                     int width) {
  __shared__ unsigned red[kLnMaxThreads / 32];
  const int runs = width / 8;
  uint4 raw[kChunks];
  load_runs<kChunks>(x + int64_t(blockIdx.x) * width, runs, raw);
  float v[kChunks][8];
  unpack_runs<kChunks>(raw, v);
  store_row_fp8<kChunks>(v, runs, codes + int64_t(blockIdx.x) * width, scale + blockIdx.x, red);
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
// Calls f with the chunk count as a compile-time constant (the row kernels' template argument).
template <class F>
void with_row_chunks(int chunks, int width, F&& f) {
  switch (chunks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: fail_cat("encoder: no row kernel for width ", width);
  }
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
    matmul(a, nullptr, w, d, m, c, gelu, stream);
  }
  // The FP8 linears (docs/fp8.md §FP8 linears): a is E4M3 [M, K] with one scale per row (a_scale),
  // w.q E4M3 [N, K] with one per output channel (w.qs); cuBLASLt applies both as outer-vector
  // scales to the fp32 accumulator (no fast accumulation), then the same epilogue as run().
  void run_fp8(const uint8_t* a, const float* a_scale, const DevLinear& w, bf16* d, int64_t m, const bf16* c, bool gelu,
               cudaStream_t stream) {
    matmul(a, a_scale, w, d, m, c, gelu, stream);
  }
  // Fails now, naming the linear, if cuBLASLt has no FP8 algorithm for w's shape and epilogue
  // (asked for 128 rows; nothing runs), rather than at the first forward.
  void check_fp8(const DevLinear& w, bool residual, bool gelu) {
    const float one = 1.f;
    matmul(nullptr, &one, w, nullptr, 128, residual ? reinterpret_cast<const bf16*>(&one) : nullptr, gelu, nullptr, true);
  }

 private:
  void matmul(const void* a, const float* a_scale, const DevLinear& w, bf16* d, int64_t m, const bf16* c, bool gelu,
              cudaStream_t stream, bool probe_only = false) {
    const bool fp8 = a_scale != nullptr;
    const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
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
    if (fp8) {
      // cuBLASLt's A is W (its M is the output channels), its B the activations (N: the tokens).
      const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      const int8_t no_fast_accum = 0;
      const void* w_scale = w.qs;
      FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer));
      FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer));
      FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof w_scale));
      FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof a_scale));
      FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &no_fast_accum, sizeof no_fast_accum));
    }
    cublasLtMatrixLayout_t la, lb, lc;
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&la, in_type, w.in, w.out, w.in));  // W: K x N
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&lb, in_type, w.in, m, w.in));      // A: K x M
    FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, w.out, m, w.out));  // C, D: N x M
    const float alpha = 1.f, beta = c ? 1.f : 0.f;
    const auto key = std::make_tuple(m, w.out, w.in, gelu, c != nullptr, fp8);
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulPreference_t pref;
      FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      const size_t ws = kWorkspace;
      FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, op, la, lb, lc, lc, pref, 1, &result, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(op);
        fail_cat("cuBLASLt (", cublasLtGetVersion(), ") has no ", fp8 ? "FP8 (E4M3, per-row and per-channel scales) " : "BF16 ",
                 "algorithm for [", m, " x ", w.in, "] x [", w.in, " x ", w.out, "]",
                 fp8 ? " on this GPU; run without --fp8-linears" : "");
      }
      it = algos_.emplace(key, result.algo).first;
    }
    if (!probe_only)
      FOVEA_CUDA_CHECK(cublasLtMatmul(handle_, op, &alpha, fp8 ? static_cast<const void*>(w.q) : w.w, la, a, lb, &beta,
                                    c ? c : d, lc, d, lc, &it->second, workspace_.data(), kWorkspace, stream));
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }

  static constexpr size_t kWorkspace = size_t(32) << 20;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  std::map<std::tuple<int64_t, int, int, bool, bool, bool>, cublasLtMatmulAlgo_t> algos_;
};

DevLinear upload(const Linear& l, Owner& owner) {
  return {upload_bf16(l.w, owner), upload_bf16(l.b, owner), l.out, l.in};
}
// The FP8 linears' weights: E4M3 per output channel, quantized on the host (quantize_weight_rows,
// the emulation's own function), and the bf16 bias; no bf16 weight.
DevLinear upload_fp8(const Linear& l, Owner& owner) {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  quantize_weight_rows(l, codes, scales);
  DevLinear d{nullptr, upload_bf16(l.b, owner), l.out, l.in};
  d.q = alloc_in<uint8_t>(owner, codes.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d.q, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  d.qs = upload_f32(scales, owner);
  return d;
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
  std::unique_ptr<fovea::cuda::Attention> attn;  // FOVEA or CUDNN
  LayerAmax* amax = nullptr;    // FP8 dynamic / calibrate: [depth] rings on the device
  float* fixed = nullptr;       // FP8 static: [depth][3]
  // FP8 robust scheme: [depth] layers' arrays (static), or one set every layer refills (dynamic,
  // calibrate) from its batch and its history on the device (the book's, copied back by sync_scales).
  std::vector<fovea::cuda::FineArrays> fine;
  bool fine_current = false;
  std::vector<fovea::cuda::DeviceFineHistory> fine_hist;
  // Per plan():
  std::vector<GridThw> grids;
  int64_t n = 0;
  uint8_t* raw = nullptr;  // raw uint8 patches, when uploaded in that form
  bf16 *pixels = nullptr, *pe = nullptr, *x = nullptr, *ln = nullptr, *qkv = nullptr, *att = nullptr, *h = nullptr;
  bf16 *m1 = nullptr, *m2 = nullptr, *merged = nullptr;
  uint8_t* act8 = nullptr;     // FP8 linears: the next linear's input as E4M3 codes [N, max(D, I)]
  float* act_scale = nullptr;  // and its per-row scales [N]
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
    bool fine = false;               // and, calibrating the robust scheme, its histories
    int64_t ticket = -1;             // the download it holds until collected; -1: free
  } out[2];
  int64_t next_ticket = 0;

  // Bytes of the robust scheme's histories that follow a download's outputs: calibration only.
  size_t fine_history_bytes() const {
    if (fine_hist.empty() || opt.scales->mode() != ScaleMode::CALIBRATE) return 0;
    return fine_hist.size() * fine_hist[0].bytes();
  }
  void layout_arena(int64_t n);  // points every buffer above into the arena, growing it if needed
  void grid_tables(const std::vector<GridThw>& grids, cudaStream_t stream);
  template <class T>
  void collect(int64_t ticket, std::vector<std::vector<T>>& out);
  std::vector<std::span<const uint16_t>> collect_views(int64_t ticket);
  // LayerNorm into bf16 `out`, or with `out_scale` into E4M3 codes and per-row scales (FP8 linears).
  void layernorm(const bf16* in, void* out, const DevNorm& nrm, int64_t rows, cudaStream_t s, float* out_scale = nullptr) {
    const LnShape ln = layernorm_shape(nrm.width);  // checked for every norm at construction
    const auto launch = [&](auto chunks) {
      constexpr int c = decltype(chunks)::value;
      const unsigned blocks = unsigned((rows + kLnRows - 1) / kLnRows);
      if (out_scale) layernorm_kernel<c, true><<<blocks, unsigned(ln.threads), 0, s>>>(in, out, out_scale, nrm.w, nrm.b, nrm.width, rows);
      else layernorm_kernel<c, false><<<blocks, unsigned(ln.threads), 0, s>>>(in, out, nullptr, nrm.w, nrm.b, nrm.width, rows);
    };
    with_row_chunks(ln.chunks, nrm.width, launch);
    FOVEA_CUDA_CHECK(cudaGetLastError());
  }
  void quantize_rows(const bf16* in, int width, int64_t rows, cudaStream_t s) {
    const LnShape ln = layernorm_shape(width);
    with_row_chunks(ln.chunks, width, [&](auto chunks) {
      quantize_rows_kernel<decltype(chunks)::value><<<unsigned(rows), unsigned(ln.threads), 0, s>>>(in, act8, act_scale, width);
    });
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
  if (options.fp8_linears && layernorm_shape(m.cfg.intermediate).chunks == 0)
    fail_cat("encoder: --fp8-linears quantizes rows whose width is a multiple of 8 up to ", 8 * kLnMaxThreads * kLnMaxChunks,
             "; this model's intermediate size is ", m.cfg.intermediate);
  if (options.dtype == AttnDtype::FP8) {
    if (!options.scales || options.scales->num_layers() != m.cfg.depth)
      fail_cat("encoder: FP8 attention needs a scale book with ", m.cfg.depth, " layers");
    if (options.fp8_robust) {
      const int H = m.cfg.heads, hd = m.cfg.head_dim();
      const size_t cells = size_t(H) * size_t(hd);
      auto arrays = [&](const FineScales* f) {  // uploads f, or allocates for the stats kernel to fill
        fovea::cuda::FineArrays a;
        auto put = [&](const std::vector<float>* v, size_t n) {
          if (v) return upload_f32(*v, m.owned);
          return alloc_in<float>(m.owned, n);
        };
        a.k_mean = put(f ? &f->k_mean : nullptr, cells);
        a.q_head = put(f ? &f->q_head : nullptr, size_t(H));
        a.k_head = put(f ? &f->k_head : nullptr, size_t(H));
        a.v_channel = put(f ? &f->v_channel : nullptr, cells);
        return a;
      };
      switch (options.scales->mode()) {
        case ScaleMode::STATIC:
          if (!options.fine_scales || options.fine_scales->size() != size_t(m.cfg.depth))
            fail_cat("encoder: the robust FP8 scheme with static scales needs fine scales for all ", m.cfg.depth, " layers");
          for (const FineScales& f : *options.fine_scales) {
            if (f.q_head.size() != size_t(H) || f.k_head.size() != size_t(H) || f.v_channel.size() != cells ||
                f.k_mean.size() != cells)
              fail_cat("encoder: fine scales for ", f.q_head.size(), " heads and ", f.v_channel.size(),
                       " V channels; the model has ", H, " heads of ", hd);
            m.fine.push_back(arrays(&f));
          }
          break;
        case ScaleMode::DYNAMIC:
        case ScaleMode::CALIBRATE:
          m.fine.push_back(arrays(nullptr));
          m.fine_current = true;
          options.scales->enable_fine(H, hd);
          for (const FineHistory& h : options.scales->fine_state()) m.fine_hist.emplace_back(h);
          break;
      }
    } else if (options.scales->mode() == ScaleMode::STATIC) {
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
    const auto up = options.fp8_linears ? upload_fp8 : static_cast<DevLinear (*)(const Linear&, Owner&)>(upload);
    d.qkv = up(b.qkv, o);
    d.proj = up(b.proj, o);
    d.fc1 = up(b.fc1, o);
    d.fc2 = up(b.fc2, o);
    m.blocks.push_back(d);
  }
  if (options.fp8_linears && !m.blocks.empty()) {  // every block has the same four shapes
    const DevBlock& b = m.blocks.front();
    m.gemm.check_fp8(b.qkv, false, false);
    m.gemm.check_fp8(b.proj, true, false);
    m.gemm.check_fp8(b.fc1, false, true);
    m.gemm.check_fp8(b.fc2, true, false);
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
  if (options.backend == AttnBackend::CUDNN) {
#if FOVEA_HAVE_CUDNN
    m.attn = fovea::cuda::make_cudnn_attention(options.dtype, m.cfg.heads, m.cfg.head_dim());
#else
    fail_cat("encoder: this fovea was built without cuDNN (the CUDNN backend)");
#endif
  } else if (options.backend == AttnBackend::FOVEA) {
    m.attn = std::make_unique<fovea::cuda::FlashAttention>(options.dtype, m.cfg.heads, m.cfg.head_dim());
  } else {
    fail_cat("encoder: the GPU encoder runs the FOVEA or the CUDNN attention backend");
  }
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
      {(void**)&cos, size_t(n) * cfg.head_dim() / 2 * 4}, {(void**)&sin, size_t(n) * cfg.head_dim() / 2 * 4},
      {(void**)&act8, opt.fp8_linears ? size_t(n) * size_t(std::max(D, I)) : 0},
      {(void**)&act_scale, opt.fp8_linears ? size_t(n) * 4 : 0}};
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
  const size_t out_bytes = m.fine_history_bytes() + size_t(patches / 4) * m.cfg.out_hidden * 2 * outputs + rings;
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
    // FP8 linears: each block linear's input goes to E4M3 with per-row scales (fused into the
    // LayerNorms; its own pass for the attention output and the MLP's hidden layer).
    const bool f8 = m.opt.fp8_linears;
    auto linear = [&](const bf16* in, const DevLinear& w, bf16* out, const bf16* residual, bool gelu) {
      if (!f8) return m.gemm.run(in, w, out, n, residual, gelu, s);
      if (in) m.quantize_rows(in, w.in, n, s);
      m.gemm.run_fp8(m.act8, m.act_scale, w, out, n, residual, gelu, s);
    };
    if (f8) m.layernorm(m.x, m.act8, b.norm1, n, s, m.act_scale);
    else m.layernorm(m.x, m.ln, b.norm1, n, s);
    linear(f8 ? nullptr : m.ln, b.qkv, m.qkv, nullptr, false);
    fovea::cuda::DeviceScales sc;
    if (!m.fine.empty()) {
      sc.fine = m.fine[m.fine_current ? 0 : size_t(l)];
      sc.fine_current = m.fine_current;
      if (m.fine_current) sc.fine_ring = m.fine_hist[size_t(l)].ring();
    } else {
      if (m.amax) sc.dynamic = m.amax + l;
      if (m.fixed) sc.fixed = m.fixed + 3 * l;
    }
    m.attn->prepare(m.qkv, 3 * int64_t(D), m.cos, m.sin, sc, s);
    m.attn->attend(m.att, s);
    linear(m.att, b.proj, m.x, m.x, false);  // + residual, in place
    if (f8) m.layernorm(m.x, m.act8, b.norm2, n, s, m.act_scale);
    else m.layernorm(m.x, m.ln, b.norm2, n, s);
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
  if (!m.amax) return;
  auto& state = m.opt.scales->amax_state();
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(state.data(), m.amax, sizeof(LayerAmax) * state.size(), cudaMemcpyDeviceToHost, stream));
  FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void Encoder::after_forward(cudaStream_t stream) {
  Impl& m = *impl_;
  if ((!m.amax && m.fine_hist.empty()) || m.opt.scales->mode() != ScaleMode::CALIBRATE) return;
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
  const size_t rings = o.amax ? sizeof(LayerAmax) * size_t(m.cfg.depth) : 0, hist = m.fine_history_bytes();
  o.fine = hist > 0;
  uint8_t* h = o.mem.take(o.count * 2 * o.outputs + rings + hist);
  for (size_t k = 0; k < from.size(); ++k)
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + k * o.count * 2, from[k], o.count * 2, cudaMemcpyDeviceToHost, stream));
  if (rings) FOVEA_CUDA_CHECK(cudaMemcpyAsync(h + o.count * 2 * o.outputs, m.amax, rings, cudaMemcpyDeviceToHost, stream));
  if (o.fine) {
    uint8_t* at = h + o.count * 2 * o.outputs + rings;
    for (const auto& fh : m.fine_hist) {
      FOVEA_CUDA_CHECK(cudaMemcpyAsync(at, fh.data(), fh.bytes(), cudaMemcpyDeviceToHost, stream));
      at += fh.bytes();
    }
  }
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
  const auto* bytes = reinterpret_cast<const uint8_t*>(h + o.count * o.outputs);
  if (o.amax) {
    auto& state = opt.scales->amax_state();
    std::memcpy(state.data(), bytes, sizeof(LayerAmax) * state.size());
    bytes += sizeof(LayerAmax) * state.size();
  }
  if (o.fine) {
    auto& state = opt.scales->fine_state();
    for (size_t l = 0; l < fine_hist.size(); bytes += fine_hist[l].bytes(), ++l) fine_hist[l].unpack(bytes, state[l]);
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

std::vector<float> linear_on_gpu(const Linear& l, const std::vector<float>& x, int64_t rows, bool fp8,
                                 const std::vector<float>* residual, bool gelu) {
  if (rows <= 0 || int64_t(x.size()) != rows * l.in) fail_cat("linear_on_gpu: ", x.size(), " values for ", rows, " rows of ", l.in);
  if (residual && int64_t(residual->size()) != rows * l.out) fail_cat("linear_on_gpu: the residual has ", residual->size(), " values");
  if (fp8 && layernorm_shape(l.in).chunks == 0) fail_cat("linear_on_gpu: FP8 inputs need a width that is a multiple of 8");
  Owner o;
  Gemm gemm;
  const DevLinear w = fp8 ? upload_fp8(l, o) : upload(l, o);
  bf16* xd = upload_bf16(x, o);
  bf16* yd = residual ? upload_bf16(*residual, o) : alloc_in<bf16>(o, size_t(rows) * l.out);
  if (fp8) {
    uint8_t* codes = alloc_in<uint8_t>(o, x.size());
    float* scales = alloc_in<float>(o, size_t(rows));
    const LnShape ln = layernorm_shape(l.in);
    with_row_chunks(ln.chunks, l.in, [&](auto chunks) {
      quantize_rows_kernel<decltype(chunks)::value><<<unsigned(rows), unsigned(ln.threads)>>>(xd, codes, scales, l.in);
    });
    FOVEA_CUDA_CHECK(cudaGetLastError());
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
