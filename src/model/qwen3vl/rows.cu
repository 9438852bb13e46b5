// The GPU encoder's row kernels (rows.cuh): one block takes whole rows, each thread holding runs of
// 8 columns in registers (16-byte loads and stores), so a row is read from memory once.
#include <type_traits>

#include "attention/cuda/ptx.cuh"
#include "fovea/cuda-support.h"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "model/qwen3vl/rows.cuh"

namespace fovea::qwen3vl::cuda {

namespace {

// LayerNorm over `width` columns (a multiple of 8), kLnRows rows a block, one after the other: each
// thread holds kChunks runs of 8 columns in registers (one 16-byte load and one 16-byte store each),
// so a row is read from memory once, and its runs of the weight and bias, loaded once for all the
// block's rows; the next row's load is in flight while this one is reduced. fp32 statistics in two
// passes over the registers (mean, then the mean squared deviation), bf16 in and out. Measured
// (H200, 3 x 4K, 97920 rows of 1152): 147 us, 68% of the copy bandwidth (docs/kernels.md).
constexpr int kLnMaxThreads = 1024, kLnMaxChunks = 8;
static_assert(8 * kLnMaxThreads * kLnMaxChunks == kRowMaxWidth);
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
    reinterpret_cast<uint2*>(codes)[run] = make_uint2(
        fovea::cuda::ptx::pack_e4m3x4(__fdiv_rn(x[0], s), __fdiv_rn(x[1], s), __fdiv_rn(x[2], s), __fdiv_rn(x[3], s)),
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
    v[c][0] = a.x, v[c][1] = a.y, v[c][2] = a.z, v[c][3] = a.w, v[c][4] = b.x, v[c][5] = b.y, v[c][6] = b.z,
    v[c][7] = b.w;
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
        const __nv_bfloat162 p =
            __floats2bfloat162_rn((v[c][2 * j] - mean) * inv * ws[c][2 * j] + bs[c][2 * j],
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
      store_row_fp8<kChunks>(v, runs, static_cast<uint8_t*>(y) + r * width, y_scale + r,
                             reinterpret_cast<unsigned*>(red));
  }
}

// bf16 activations [rows, width] to E4M3 codes and per-row scales (the proj and fc2 inputs).
template <int kChunks>
__global__ void quantize_rows_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ scale,
                                     int width, int ld) {
  __shared__ unsigned red[kLnMaxThreads / 32];
  const int runs = width / 8;
  uint4 raw[kChunks];
  load_runs<kChunks>(x + int64_t(blockIdx.x) * width, runs, raw);
  float v[kChunks][8];
  unpack_runs<kChunks>(raw, v);
  uint8_t* row = codes + int64_t(blockIdx.x) * ld;
  store_row_fp8<kChunks>(v, runs, row, scale + blockIdx.x, red);
  for (int i = width + int(threadIdx.x); i < ld; i += int(blockDim.x)) row[i] = 0;
}

__global__ void repeat_row_scales_kernel(float* s, int64_t rows, int copies) {
  const int64_t total = rows * (copies - 1);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    s[rows + i] = s[i % rows];
}

__global__ void bias_gelu_kernel(bf16* y, const bf16* bias, int64_t rows, int cols, bool add_bias, bool gelu) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = __bfloat162float(y[i]);
    if (add_bias) v += __bfloat162float(bias[i % cols]);
    if (gelu) v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    y[i] = __float2bfloat16_rn(v);
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

__global__ void gelu_erf_kernel(bf16* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(x[i]);
    x[i] = __float2bfloat16_rn(0.5f * v * (1.f + erff(v * 0.70710678118654752f)));
  }
}

}  // namespace

bool row_kernels_take(int width) { return layernorm_shape(width).chunks != 0; }

void layernorm(const bf16* in, void* out, float* out_scale, const float* w, const float* b, int width, int64_t rows,
               cudaStream_t stream) {
  const LnShape ln = layernorm_shape(width);
  const auto launch = [&](auto chunks) {
    constexpr int c = decltype(chunks)::value;
    const unsigned blocks = unsigned((rows + kLnRows - 1) / kLnRows);
    if (out_scale)
      layernorm_kernel<c, true><<<blocks, unsigned(ln.threads), 0, stream>>>(in, out, out_scale, w, b, width, rows);
    else
      layernorm_kernel<c, false><<<blocks, unsigned(ln.threads), 0, stream>>>(in, out, nullptr, w, b, width, rows);
  };
  with_row_chunks(ln.chunks, width, launch);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void quantize_rows(const bf16* in, uint8_t* codes, float* scales, int width, int64_t rows, cudaStream_t stream,
                   int ld) {
  const LnShape ln = layernorm_shape(width);
  if (ld == 0) ld = width;
  if (ld < width || (ld != width && ld % 16 != 0)) fail_cat("quantize_rows: rows of ", width, " codes ", ld, " apart");
  with_row_chunks(ln.chunks, width, [&](auto chunks) {
    quantize_rows_kernel<decltype(chunks)::value>
        <<<unsigned(rows), unsigned(ln.threads), 0, stream>>>(in, codes, scales, width, ld);
  });
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void repeat_row_scales(float* scales, int64_t rows, int copies, cudaStream_t stream) {
  if (copies <= 1 || rows <= 0) return;
  repeat_row_scales_kernel<<<256, 256, 0, stream>>>(scales, rows, copies);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void bias_gelu(bf16* y, const bf16* bias, int64_t rows, int cols, bool add_bias, bool gelu, cudaStream_t stream) {
  if (!add_bias && !gelu) return;
  bias_gelu_kernel<<<1024, 256, 0, stream>>>(y, bias, rows, cols, add_bias, gelu);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void gelu_erf(bf16* x, int64_t n, cudaStream_t stream) {
  gelu_erf_kernel<<<1024, 256, 0, stream>>>(x, n);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fovea::qwen3vl::cuda
