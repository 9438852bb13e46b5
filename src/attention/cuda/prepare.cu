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

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t w) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// Q or K of one head-row, given as its kHeadDim / 2 packed bf16 pairs, into its padded output row
// (kHdPad elements, zeros past kHeadDim) as packed words: RoPE'd and rounded four columns of each
// half at a time, so the row never lives as kHeadDim floats; the arithmetic is load_row's.
template <bool kFp8, int kHeadDim, int kHdPad>
__device__ __forceinline__ void rope_quantize(const PrepareArgs& a, int token, const uint32_t (&in)[kHeadDim / 2],
                                              float scale, uint32_t (&out)[kHdPad * (kFp8 ? 1 : 2) / 4]) {
  constexpr int kHalf = kHeadDim / 2;
#pragma unroll
  for (int i = 0; i < kHdPad * (kFp8 ? 1 : 2) / 4; ++i) out[i] = 0;
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
}

// Shared-memory row stride, in 4-byte words, of a staged tile row: room for the bf16 input row and
// for the output row written back in its place, rounded to 4 (mod 8) words so that the eight threads
// of a 16-byte shared access (thread t on row t) fall on distinct bank quads.
template <bool kFp8, int kHeadDim>
constexpr int stage_words() {
  constexpr int in = kHeadDim / 2, out = layout::head_dim_pad(kHeadDim, kFp8) * (kFp8 ? 1 : 2) / 4;
  constexpr int w = in > out ? in : out;
  return w + (12 - w % 8) % 8;
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

// One CTA: 128 padded rows of one head. Q, then K, then V: the tile's rows are staged in shared
// memory with 16-byte loads on consecutive addresses (a row of the qkv output is 2 x head_dim bytes
// inside a 6 x H x head_dim-byte token), each thread turns its row into the output row, and the
// tile goes out again with 16-byte stores on consecutive addresses (the 128 rows of Q or K are one
// contiguous block; V^T's are head_dim rows of 128 keys, transposed in shared memory). Measured
// before (one row a thread straight from and to global memory): 48% of the global sectors and 80%
// of the shared wavefronts were excess, 39% of the copy bandwidth at 3 x 4K.
template <bool kFp8, int kHeadDim>
__global__ void __launch_bounds__(kThreads) prepare_kernel(PrepareArgs a) {
  using Elem = std::conditional_t<kFp8, uint8_t, __nv_bfloat16>;
  constexpr int kHdPad = layout::head_dim_pad(kHeadDim, kFp8);
  constexpr int kWords = stage_words<kFp8, kHeadDim>();
  constexpr int kInChunks = kHeadDim / 8;                          // 16-byte chunks of an input row
  constexpr int kOutWords = kHdPad * int(sizeof(Elem)) / 4;        // of an output row
  constexpr int kKeyChunks = kThreads * int(sizeof(Elem)) / 16;    // of a V^T tile row
  static_assert(kHeadDim * kThreads * sizeof(Elem) <= kThreads * kWords * 4, "V^T's tile fits where V was staged");
  __shared__ __align__(16) uint32_t stage[kThreads * kWords];  // the staged rows; for V, then V^T [kHeadDim][kThreads]
  __shared__ int tokens[kThreads];
  Elem (*vt)[kThreads] = reinterpret_cast<Elem (*)[kThreads]>(stage);
  // Heads are the fast grid dimension: the CTAs of one row block run side by side, so a token's
  // RoPE row and the 32-byte sectors two heads' slices share come from DRAM once (with rows fastest,
  // every head streamed the whole cos / sin table again: 1.36 GB read for 0.7 GB of inputs at 3 x 4K).
  const int head = blockIdx.x;
  const int row0 = blockIdx.y * kThreads;
  const int t = threadIdx.x;
  tokens[t] = padded_row_token(a, row0 + t);
  __syncthreads();
#pragma unroll 1
  for (int w = 0; w < 3; ++w) {
    for (int i = t; i < kThreads * kInChunks; i += kThreads) {
      const int r = i / kInChunks, c = i % kInChunks, token = tokens[r];
      uint4 v = make_uint4(0, 0, 0, 0);
      if (token >= 0)
        v = reinterpret_cast<const uint4*>(a.qkv + int64_t(token) * a.qkv_token_stride + (int64_t(w) * a.heads + head) * kHeadDim)[c];
      *reinterpret_cast<uint4*>(&stage[r * kWords + 4 * c]) = v;
    }
    __syncthreads();
    uint32_t in[kHeadDim / 2];
#pragma unroll
    for (int c = 0; c < kInChunks; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(&stage[t * kWords + 4 * c]);
      in[4 * c] = v.x, in[4 * c + 1] = v.y, in[4 * c + 2] = v.z, in[4 * c + 3] = v.w;
    }
    // FP8 dequantization scale of this tensor (q, k, v)
    const float scale = !kFp8 ? 1.f : a.dynamic ? a.dynamic->t[w].scale : a.fixed[w];
    if (w < 2) {
      uint32_t out[kOutWords];
      rope_quantize<kFp8, kHeadDim, kHdPad>(a, tokens[t], in, scale, out);
#pragma unroll
      for (int c = 0; c < kOutWords / 4; ++c)  // in place: this thread alone reads and writes its row
        *reinterpret_cast<uint4*>(&stage[t * kWords + 4 * c]) = make_uint4(out[4 * c], out[4 * c + 1], out[4 * c + 2], out[4 * c + 3]);
    } else {
      // FP8: key t of its 16-key group goes to the column l with kv_perm(l) == t % 16.
      const int col = kFp8 ? (t & ~15) + layout::kv_inv_perm(t & 15) : t;
      __syncthreads();  // every row is in registers before V^T overwrites the staged rows
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) {
        const float2 f = unpack_bf16x2(in[i]);
        if constexpr (kFp8) {
          vt[2 * i][col] = uint8_t(quantize4(f.x, 0.f, 0.f, 0.f, scale));
          vt[2 * i + 1][col] = uint8_t(quantize4(f.y, 0.f, 0.f, 0.f, scale));
        } else {
          vt[2 * i][col] = __float2bfloat16_rn(f.x);
          vt[2 * i + 1][col] = __float2bfloat16_rn(f.y);
        }
      }
    }
    __syncthreads();
    if (w < 2) {
      uint4* dst = reinterpret_cast<uint4*>((w == 0 ? static_cast<Elem*>(a.q) : static_cast<Elem*>(a.k)) +
                                            (int64_t(head) * a.n_pad + row0) * kHdPad);
      for (int i = t; i < kThreads * (kOutWords / 4); i += kThreads) {
        const int r = i / (kOutWords / 4), c = i % (kOutWords / 4);
        dst[i] = *reinterpret_cast<const uint4*>(&stage[r * kWords + 4 * c]);
      }
      __syncthreads();  // the next tensor is staged over this one
    } else {
      for (int i = t; i < kHeadDim * kKeyChunks; i += kThreads) {
        const int d = i / kKeyChunks, c = i % kKeyChunks;
        Elem* dst = static_cast<Elem*>(a.vt) + (int64_t(head) * kHeadDim + d) * a.n_pad + row0;
        reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(&vt[d][0])[c];
      }
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
