// The prepare step: 2D RoPE on q and k, per-tensor amax (dynamic FP8), E4M3 quantization or bf16
// rounding, and the padded / transposed layouts of layout.cuh, straight from the fused qkv output.
//
// Launches per layer: BF16 1 (prepare); FP8 static 1 (prepare); FP8 dynamic 2 (amax, prepare). The
// amax kernel's last CTA records the three amax values in the layer's device ring
// (amax_history_record, the scale book's own function) and resets its scratch, so repeated launches
// need no host work and replay correctly inside a CUDA graph.
#include <cuda_bf16.h>

#include "attention/cuda/head-dims.cuh"
#include "attention/cuda/kernels.cuh"
#include "attention/cuda/layout.cuh"
#include "attention/cuda/ptx.cuh"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "fovea/scales.h"

namespace fovea::cuda {

namespace {

constexpr int kThreads = layout::kTilePad;  // one padded row per thread

// Segment of a padded row (binary search in cu_padded), and the token it holds or -1 for padding.
__device__ __forceinline__ int padded_row_token(const PrepareArgs& a, int row) {
  int lo = 0, hi = a.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.cu_padded[mid] <= row) lo = mid; else hi = mid - 1;
  }
  const int off = row - a.cu_padded[lo];
  const int len = a.cu_seqlens[lo + 1] - a.cu_seqlens[lo];
  return off < len ? a.cu_seqlens[lo] + off : -1;
}

// One head-row of q, k or v in fp32, with RoPE applied when `rope` (q and k).
template <int kHeadDim>
__device__ __forceinline__ void load_row(const PrepareArgs& a, int token, int head, int which, bool rope,
                                         float (&x)[kHeadDim]) {
  const __nv_bfloat16* src = a.qkv + int64_t(token) * a.qkv_token_stride + (int64_t(which) * a.heads + head) * kHeadDim;
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) {
    const uint4 v = reinterpret_cast<const uint4*>(src)[i];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      x[8 * i + 2 * j] = f.x;
      x[8 * i + 2 * j + 1] = f.y;
    }
  }
  if (rope && a.rope_cos) {
    constexpr int kHalf = kHeadDim / 2;
    const float4* c4 = reinterpret_cast<const float4*>(a.rope_cos + int64_t(token) * kHalf);
    const float4* s4 = reinterpret_cast<const float4*>(a.rope_sin + int64_t(token) * kHalf);
#pragma unroll
    for (int i = 0; i < kHalf / 4; ++i) {
      const float4 cv = c4[i], sv = s4[i];
      const float c[4] = {cv.x, cv.y, cv.z, cv.w}, s[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // Unfused multiply and add, rounded like the CPU reference's (and transformers' fp32) RoPE,
        // so the amax and every quantized value agree bit for bit with the host.
        const int d = 4 * i + j;
        const float x1 = x[d], x2 = x[d + kHalf];
        x[d] = __fsub_rn(__fmul_rn(x1, c[j]), __fmul_rn(x2, s[j]));
        x[d + kHalf] = __fadd_rn(__fmul_rn(x2, c[j]), __fmul_rn(x1, s[j]));
      }
    }
  }
}

// x8 = sat(rne(x / s)) for four values, packed (the hardware conversion, bit-identical to
// fovea::e4m3_from_float: tests/gpu/test-fp8-device.cu).
__device__ __forceinline__ uint32_t quantize4(float a, float b, float c, float d, float s) {
  return ptx::pack_e4m3x4(__fdiv_rn(a, s), __fdiv_rn(b, s), __fdiv_rn(c, s), __fdiv_rn(d, s));
}

// One head-row of q, k or v as it sits in the qkv output: kHeadDim / 2 packed bf16 pairs, or zeros
// for a padding row (token < 0).
template <int kHeadDim>
__device__ __forceinline__ void load_packed(const PrepareArgs& a, int token, int head, int which,
                                            uint32_t (&w)[kHeadDim / 2]) {
  if (token < 0) {
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) w[i] = 0;
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(a.qkv + int64_t(token) * a.qkv_token_stride +
                                                    (int64_t(which) * a.heads + head) * kHeadDim);
#pragma unroll
  for (int i = 0; i < kHeadDim / 8; ++i) {
    const uint4 v = src[i];
    w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
  }
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// Q or K of one head-row into its padded output row: RoPE'd and rounded four columns of each half at
// a time, straight from the packed bf16 row, so the row never lives as kHeadDim floats (the FP8
// hd 72 instance went from 133 registers, 3 CTAs an SM, to fewer; the arithmetic is load_row's).
template <bool kFp8, int kHeadDim, int kHdPad>
__device__ __forceinline__ void rope_row_out(const PrepareArgs& a, int token, int head, int which, float scale,
                                             void* dst) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kOutWords = kHdPad * (kFp8 ? 1 : 2) / 4;
  uint32_t in[kHeadDim / 2], out[kOutWords];
  load_packed<kHeadDim>(a, token, head, which, in);
#pragma unroll
  for (int i = 0; i < kOutWords; ++i) out[i] = 0;
  const bool rope = token >= 0 && a.rope_cos;
#pragma unroll
  for (int g = 0; g < kHalf / 4; ++g) {
    float x1[4], x2[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 p = unpack_bf16x2(in[2 * g + j]), q = unpack_bf16x2(in[kHalf / 2 + 2 * g + j]);
      x1[2 * j] = p.x, x1[2 * j + 1] = p.y, x2[2 * j] = q.x, x2[2 * j + 1] = q.y;
    }
    if (rope) {
      const float4 cv = reinterpret_cast<const float4*>(a.rope_cos + int64_t(token) * kHalf)[g];
      const float4 sv = reinterpret_cast<const float4*>(a.rope_sin + int64_t(token) * kHalf)[g];
      const float c[4] = {cv.x, cv.y, cv.z, cv.w}, sn[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // as load_row: unfused, rounded like the CPU reference
        const float y1 = __fsub_rn(__fmul_rn(x1[j], c[j]), __fmul_rn(x2[j], sn[j]));
        const float y2 = __fadd_rn(__fmul_rn(x2[j], c[j]), __fmul_rn(x1[j], sn[j]));
        x1[j] = y1, x2[j] = y2;
      }
    }
    if constexpr (kFp8) {
      out[g] = quantize4(x1[0], x1[1], x1[2], x1[3], scale);
      out[kHalf / 4 + g] = quantize4(x2[0], x2[1], x2[2], x2[3], scale);
    } else {
      out[2 * g] = ptx::pack_bf16x2(x1[0], x1[1]), out[2 * g + 1] = ptx::pack_bf16x2(x1[2], x1[3]);
      out[kHalf / 2 + 2 * g] = ptx::pack_bf16x2(x2[0], x2[1]), out[kHalf / 2 + 2 * g + 1] = ptx::pack_bf16x2(x2[2], x2[3]);
    }
  }
  uint4* o = static_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < kOutWords / 4; ++i) o[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

// ---- amax (dynamic FP8 only) ----------------------------------------------------------------------

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) qkv_amax_kernel(PrepareArgs a) {
  __shared__ unsigned int block_max[3];
  __shared__ bool last;
  if (threadIdx.x < 3) block_max[threadIdx.x] = 0;
  __syncthreads();
  const int head = blockIdx.y;
  const int64_t n = a.total_tokens;
  unsigned int m[3] = {0, 0, 0};  // |x| as float bits: non-negative floats order like unsigned ints,
                                  // and inf / NaN bits sort above every finite value
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < n; t += int64_t(gridDim.x) * kThreads) {
#pragma unroll
    for (int w = 0; w < 3; ++w) {
      float x[kHeadDim];
      load_row<kHeadDim>(a, int(t), head, w, w < 2, x);
#pragma unroll
      for (int d = 0; d < kHeadDim; ++d) m[w] = max(m[w], __float_as_uint(fabsf(x[d])));
    }
  }
#pragma unroll
  for (int w = 0; w < 3; ++w) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m[w] = max(m[w], __shfl_xor_sync(0xffffffffu, m[w], o));
    if ((threadIdx.x & 31) == 0) atomicMax(&block_max[w], m[w]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < 3; ++w) atomicMax(&a.amax_scratch[w], block_max[w]);
    __threadfence();
    const unsigned int blocks = gridDim.x * gridDim.y;
    last = atomicAdd(a.amax_done, 1u) == blocks - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    for (int w = 0; w < 3; ++w) {
      const unsigned int bits = atomicExch(&a.amax_scratch[w], 0u);
      amax_history_record(a.dynamic->t[w], __uint_as_float(bits));
    }
    *a.amax_done = 0;
    __threadfence();
  }
}

// ---- quantize / round into the kernel layouts -----------------------------------------------------

// One row a thread, straight from and to global memory. Measured (3 x 4K, FP8 hd 72, ncu): 680 us,
// 39% of the copy bandwidth for the bytes it must move; issue-latency bound (25% occupancy at 109
// registers, 28% of issue slots busy), with 48% of its global sectors and 80% of its shared
// wavefronts excess. Tried and rejected (2026-12-02, same measurement): Q, K and V staged tile by
// tile in shared memory with 16-byte loads and stores on consecutive addresses and V^T transposed
// there, 721 us (3 x 3520: 0.127 against 0.107 ms): coalescing is not what holds it back.
template <bool kFp8, int kHeadDim>
__global__ void __launch_bounds__(kThreads) prepare_kernel(PrepareArgs a) {
  using Elem = std::conditional_t<kFp8, uint8_t, __nv_bfloat16>;
  constexpr int kHdPad = layout::head_dim_pad(kHeadDim, kFp8);
  __shared__ __align__(16) Elem sv[kThreads][kHeadDim];
  // Heads are the fast grid dimension: the CTAs of one row block run side by side, so a token's
  // RoPE row and the 32-byte sectors two heads' slices share come from DRAM once (with rows fastest,
  // every head streamed the whole cos / sin table again: 1.36 GB read for 0.7 GB of inputs at 3 x 4K).
  const int head = blockIdx.x;
  const int row = blockIdx.y * kThreads + threadIdx.x;  // padded row
  const int token = padded_row_token(a, row);
  float scale[3] = {1.f, 1.f, 1.f};  // FP8 dequantization scales of q, k, v
  if constexpr (kFp8) {
    for (int w = 0; w < 3; ++w) scale[w] = a.dynamic ? a.dynamic->t[w].scale : a.fixed[w];
  }

  // Q and K: one row each, RoPE'd, padded to kHdPad with zeros.
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    Elem* dst = (w == 0 ? static_cast<Elem*>(a.q) : static_cast<Elem*>(a.k)) +
                (int64_t(head) * a.n_pad + row) * kHdPad;
    rope_row_out<kFp8, kHeadDim, kHdPad>(a, token, head, w, scale[w], dst);
  }

  // V: into shared memory, then out transposed, 128 keys per V^T row.
  {
    uint32_t in[kHeadDim / 2];
    load_packed<kHeadDim>(a, token, head, 2, in);
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) {
      const float2 f = unpack_bf16x2(in[i]);
      if constexpr (kFp8) {
        sv[threadIdx.x][2 * i] = uint8_t(quantize4(f.x, 0.f, 0.f, 0.f, scale[2]));
        sv[threadIdx.x][2 * i + 1] = uint8_t(quantize4(f.y, 0.f, 0.f, 0.f, scale[2]));
      } else {
        sv[threadIdx.x][2 * i] = __float2bfloat16_rn(f.x);
        sv[threadIdx.x][2 * i + 1] = __float2bfloat16_rn(f.y);
      }
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int row0 = blockIdx.y * kThreads;
  for (int d = warp; d < kHeadDim; d += kThreads / 32) {
    Elem* dst = static_cast<Elem*>(a.vt) + (int64_t(head) * kHeadDim + d) * a.n_pad + row0;
    if constexpr (kFp8) {
      // Lane writes columns 4*lane .. 4*lane+3: keys kv_perm() of its 16-key group.
      const int base = 16 * (lane / 4);
      uint32_t packed = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) packed |= uint32_t(sv[base + layout::kv_perm(4 * (lane % 4) + i)][d]) << (8 * i);
      reinterpret_cast<uint32_t*>(dst)[lane] = packed;
    } else {
      __align__(8) __nv_bfloat16 v4[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v4[i] = sv[4 * lane + i][d];
      reinterpret_cast<uint2*>(dst)[lane] = *reinterpret_cast<const uint2*>(v4);
    }
  }
}

template <int kHeadDim>
void launch_for_head_dim(const PrepareArgs& a, bool fp8, cudaStream_t stream) {
  if (fp8 && a.dynamic) {
    const int blocks_x = int(std::min<int64_t>((a.total_tokens + kThreads - 1) / kThreads, 1024 / std::max(1, a.heads) + 1));
    qkv_amax_kernel<kHeadDim><<<dim3(blocks_x, a.heads), kThreads, 0, stream>>>(a);
    FOVEA_CUDA_CHECK(cudaGetLastError());
  }
  if (a.n_pad / kThreads > 65535) fail_cat("attention: ", a.n_pad, " padded tokens in one batch; the prepare step takes up to ", 65535 * kThreads);
  const dim3 grid(unsigned(a.heads), unsigned(a.n_pad / kThreads));
  if (fp8) prepare_kernel<true, kHeadDim><<<grid, kThreads, 0, stream>>>(a);
  else prepare_kernel<false, kHeadDim><<<grid, kThreads, 0, stream>>>(a);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_prepare(const PrepareArgs& a, bool fp8, int head_dim, cudaStream_t stream) {
  dispatch_head_dim(head_dim, [&](auto hd) { launch_for_head_dim<decltype(hd)::value>(a, fp8, stream); });
}

}  // namespace fovea::cuda
