// The prepare step: 2D RoPE on q and k, E4M3 quantization or bf16 rounding, and the padded /
// transposed layouts of layout.cuh, straight from the fused qkv output; for FP8 with scales from
// the batch, first the statistics those scales need.
//
// Launches per layer: 1 (prepare) for BF16 and for static FP8 scales used as given; 2 when the
// scales come from the batch or static ones are guarded (docs/fp8.md §Static guard): per tensor,
// amax then prepare; the robust scheme, fine statistics then prepare. Each statistics kernel's last
// CTA writes the scales (and the layer's device ring, or the guarded copy of the static scales and
// the guard's counters, with the scale book's own functions) and clears its scratch, so repeated
// launches need no host work and replay in a CUDA graph.
#include <cuda_bf16.h>

#include "attention/cuda/head-dims.cuh"
#include "attention/cuda/kernels.cuh"
#include "attention/cuda/layout.cuh"
#include "attention/cuda/ptx.cuh"
#include "attention/cuda/rope.cuh"
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
    if (a.cu_padded[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int off = row - a.cu_padded[lo];
  const int len = a.cu_seqlens[lo + 1] - a.cu_seqlens[lo];
  return off < len ? a.cu_seqlens[lo] + off : -1;
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

// Visits one head-row of q, k or v as fp32, four columns of each half at a time, straight from the
// packed bf16 row (the row never lives as kHeadDim floats; the amax kernel at hd 128 took 255
// registers and spilled when it did): f(g, x1, x2) gets columns 4g..4g+3 in x1 and
// kHalf+4g..kHalf+4g+3 in x2, RoPE'd when `rope` and the tables exist. A padding row (token < 0)
// is zeros.
template <int kHeadDim, class F>
__device__ __forceinline__ void for_row_groups(const PrepareArgs& a, int token, int head, int which, bool rope, F&& f) {
  constexpr int kHalf = kHeadDim / 2;
  uint32_t in[kHeadDim / 2];
  load_packed<kHeadDim>(a, token, head, which, in);
  rope = rope && token >= 0 && a.rope_cos;
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
      for (int j = 0; j < 4; ++j) rope_pair(x1[j], x2[j], c[j], sn[j]);
    }
    f(g, x1, x2);
  }
}

// The four bytes of a split pair's padding slots (fovea/scales.h §split pairs), from its two
// channels x1 (channel p) and x2 (p + hd/2): y = x / s as quantize4 divides, hi its E4M3 code, lo
// the remainder's, all with the hardware conversions (equal to fovea's codec: test-fp8-device); Q's
// slots hold (lo, hi) per channel, K's (hi, lo).
__device__ __forceinline__ uint32_t split_slots(float x1, float x2, float s, bool q) {
  const float y1 = __fdiv_rn(x1, s), y2 = __fdiv_rn(x2, s);
  const uint16_t hi = ptx::e4m3x2_of_f32(y1, y2);
  const float2 h = ptx::f32x2_of_e4m3x2(hi);
  const uint16_t lo = ptx::e4m3x2_of_f32(__fsub_rn(y1, h.x), __fsub_rn(y2, h.y));
  const uint32_t l = lo, u = hi;  // byte 0: channel p's, byte 1: channel p + hd/2's
  const uint32_t c1 = q ? (l & 0xFFu) | (u & 0xFFu) << 8 : (u & 0xFFu) | (l & 0xFFu) << 8;
  const uint32_t c2 = q ? (l >> 8) | (u >> 8) << 8 : (u >> 8) | (l >> 8) << 8;
  return c1 | c2 << 16;
}

// A head's split pairs, for the group loop: bit p set for each split rotary pair p. A split pair's
// channels are staged in shared memory as the loop passes them, at the pair's rank among the set bits.
template <int kHeadDim>
__device__ __forceinline__ uint64_t split_mask(const int* split) {
  static_assert(kHeadDim / 2 <= 64);
  uint64_t m = 0;
#pragma unroll
  for (int i = 0; i < fp8_split_pairs(kHeadDim); ++i)
    if (split[i] >= 0) m |= uint64_t(1) << split[i];
  return m;
}

// Q or K of one head-row into its padded output row: RoPE'd, minus `shift` when kShift (the robust
// scheme's K: its mean per channel; padding rows stay zero) and rounded. FP8 with kSplit (the robust
// scheme): each of the head's split pairs (`split`, -1 none; `mask` its bits) gets its remainder in
// its padding slots. The pair's two values are staged in `stage` ([kSplit][2][kThreads] floats, this
// thread's column) as the group loop passes them: the same values the main slots were rounded from.
template <bool kFp8, int kHeadDim, int kHdPad, bool kShift = false, bool kSplit = false>
__device__ __forceinline__ void rope_row_out(const PrepareArgs& a, int token, int head, int which, float scale,
                                             const float* shift, void* dst, const int* split = nullptr,
                                             uint64_t mask = 0, float* stage = nullptr) {
  constexpr int kPairs = kSplit ? fp8_split_pairs(kHeadDim) : 0;
  static_assert(kFp8 || !kSplit);
  static_assert(kPairs == 0 || (kHeadDim % 4 == 0 && kHeadDim + 4 * kPairs <= kHdPad),
                "split slots: whole words of the padding");
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kOutWords = kHdPad * (kFp8 ? 1 : 2) / 4;
  uint32_t out[kOutWords];
#pragma unroll
  for (int i = 0; i < kOutWords; ++i) out[i] = 0;
  for_row_groups<kHeadDim>(a, token, head, which, true, [&](int g, float(&x1)[4], float(&x2)[4]) {
    if (kShift && token >= 0) {  // the means, four channels a load (kHalf is a multiple of 4)
      const float4 m1 = reinterpret_cast<const float4*>(shift)[g],
                   m2 = reinterpret_cast<const float4*>(shift + kHalf)[g];
      x1[0] = __fsub_rn(x1[0], m1.x), x1[1] = __fsub_rn(x1[1], m1.y), x1[2] = __fsub_rn(x1[2], m1.z),
      x1[3] = __fsub_rn(x1[3], m1.w);
      x2[0] = __fsub_rn(x2[0], m2.x), x2[1] = __fsub_rn(x2[1], m2.y), x2[2] = __fsub_rn(x2[2], m2.z),
      x2[3] = __fsub_rn(x2[3], m2.w);
    }
    if constexpr (kSplit) {  // a bit test per pair, the same for the whole CTA (one head)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * g + j;
        if ((mask >> c) & 1) {
          const int k = __popcll(mask & ((uint64_t(1) << c) - 1));
          stage[(2 * k) * kThreads + threadIdx.x] = x1[j];
          stage[(2 * k + 1) * kThreads + threadIdx.x] = x2[j];
        }
      }
    }
    if constexpr (kFp8) {
      out[g] = quantize4(x1[0], x1[1], x1[2], x1[3], scale);
      out[kHalf / 4 + g] = quantize4(x2[0], x2[1], x2[2], x2[3], scale);
    } else {
      out[2 * g] = ptx::pack_bf16x2(x1[0], x1[1]), out[2 * g + 1] = ptx::pack_bf16x2(x1[2], x1[3]);
      out[kHalf / 2 + 2 * g] = ptx::pack_bf16x2(x2[0], x2[1]),
                          out[kHalf / 2 + 2 * g + 1] = ptx::pack_bf16x2(x2[2], x2[3]);
    }
  });
  if constexpr (kSplit) {
    // Split i's slots: bytes 0-1 (channel p) and 2-3 (p + hd/2) of one word. (Reading the pairs again
    // from the input row instead, a second pass of scattered loads, took 0.14 against 0.075 ms of the
    // per-tensor prepare at S 8192, hd 72; splitting inside the group loop, a test per group and split
    // unrolled to 54 copies of the arithmetic, 0.185.)
    if (token >= 0) {
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int p = split[i];
        if (p < 0) continue;
        const int k = __popcll(mask & ((uint64_t(1) << p) - 1));
        out[kHeadDim / 4 + i] = split_slots(stage[(2 * k) * kThreads + threadIdx.x],
                                            stage[(2 * k + 1) * kThreads + threadIdx.x], scale, which == 0);
      }
    }
  }
  uint4* o = static_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < kOutWords / 4; ++i) o[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

// ---- amax (dynamic FP8, and the static guard per tensor) -------------------------------------------

// One forward's switches into a layer's guard counters: bit t of `raised` for tensor t (q, k, v).
__device__ __forceinline__ void count_guard(GuardCounts* c, unsigned int raised) {
  c->q += raised & 1u, c->k += (raised >> 1) & 1u, c->v += (raised >> 2) & 1u;
}

// The batch's amax of q (RoPE'd), k (RoPE'd) and v; the last CTA records them in the layer's ring,
// or with the guard (g.counts) writes guarded_scale(file's, amax) per tensor as ScaleBook::record
// does for a static book, and counts the tensors it switched.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) qkv_amax_kernel(PrepareArgs a, GuardLaunch g) {
  __shared__ unsigned int block_max[3];
  __shared__ bool last;
  if (threadIdx.x < 3) block_max[threadIdx.x] = 0;
  __syncthreads();
  const int head = blockIdx.y;
  const int64_t n = a.cu_seqlens[a.num_segments];  // this launch's tokens (a.total_tokens: the capacity)
  unsigned int m[3] = {0, 0, 0};                   // |x| as float bits: non-negative floats order like unsigned ints,
                                                   // and inf / NaN bits sort above every finite value
  // q, k and v one after the other: one row in registers at a time (all three at once spilled at hd 128)
#pragma unroll
  for (int w = 0; w < 3; ++w)
    for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < n; t += int64_t(gridDim.x) * kThreads)
      for_row_groups<kHeadDim>(a, int(t), head, w, w < 2, [&](int, const float(&x1)[4], const float(&x2)[4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) m[w] = max(m[w], max(__float_as_uint(fabsf(x1[j])), __float_as_uint(fabsf(x2[j]))));
      });
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
    unsigned int raised = 0;
    for (int w = 0; w < 3; ++w) {
      const float amax = __uint_as_float(atomicExch(&a.amax_scratch[w], 0u));  // NaN bits: a NaN amax
      if (g.counts) {
        const float s = guarded_scale(g.fixed[w], amax);
        g.scales[w] = s;
        raised |= unsigned(s != g.fixed[w]) << w;
      } else {
        amax_history_record(a.dynamic->t[w], amax);
      }
    }
    if (g.counts) count_guard(g.counts, raised);
    *a.amax_done = 0;
    __threadfence();
  }
}

// ---- fine statistics (robust scheme, current scaling) ----------------------------------------------

// Signed floats as unsigned ints in the same order, so atomicMax finds the largest (0 is below all).
__device__ __forceinline__ unsigned int ordered_bits(float x) {
  const unsigned int b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float from_ordered_bits(unsigned int u) {
  return __uint_as_float((u & 0x80000000u) ? u & 0x7FFFFFFFu : ~u);
}

constexpr int kStatThreads = 256;

// One warp picks a head's split pairs as pick_split_pairs (scales.h) does, from the head's Q and
// K - mean amax per channel (shared): fp8_split_pairs(hd) rounds of a warp argmax over the pairs'
// split_share (ties: the lower pair), a pair taken once; -1 once no share > 0 is left.
template <int kHeadDim>
__device__ __forceinline__ void pick_split_pairs_warp(const float* qa, const float* ka, int32_t* out) {
  constexpr int kHalf = kHeadDim / 2, kSplit = fp8_split_pairs(kHeadDim);
  static_assert(kHalf <= 64, "two pairs a lane");
  __syncwarp();
  const int lane = threadIdx.x % 32;
  float share[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int p = lane + 32 * e;
    const float x = p < kHalf ? split_share(qa[p], qa[p + kHalf], ka[p], ka[p + kHalf]) : -1.f;
    share[e] = x > 0.f ? x : -1.f;  // NaN too
  }
#pragma unroll 1
  for (int i = 0; i < kSplit; ++i) {
    const bool second = share[1] > share[0];
    float best = second ? share[1] : share[0];
    int idx = second ? lane + 32 : lane;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
    }
    if (lane == 0) out[i] = best > 0.f ? idx : -1;
    if (idx % 32 == lane) share[idx / 32] = -1.f;
  }
  __syncwarp();
}

// The static guard's tail of fine_stats_kernel (robust scheme; ScaleBook::guard_fine on the device):
// into `out`, the file's q_head, k_head and v_channel, each scale raised to the batch's own where the
// batch passes its range (guarded_scale): a head's Q scale by the head's Q amax, its K scale by the
// amax of K minus the file's mean (from K's extremes, as the history does), a V channel's by its
// amax; a batch with a non-finite value keeps the file's arrays. Counts each tensor once, however
// many heads or channels it raised; clears the scratch. A warp a head, as the other tail.
template <int kHeadDim>
__device__ __forceinline__ void guard_fine_tail(const PrepareArgs& a, const FineArrays& out, const FineScratch& f,
                                                const GuardLaunch& g, bool keep) {
  unsigned int raised = 0;  // bit t: tensor t (q, k, v) raised in one of this thread's heads
  const int lane = threadIdx.x % 32;
  for (int h = threadIdx.x / 32; h < a.heads; h += kStatThreads / 32) {
    float q = 0.f, k = 0.f;
    bool v_up = false;
    for (int d = lane; d < kHeadDim; d += 32) {
      const int cell = h * kHeadDim + d;
      const float hi = from_ordered_bits(__ldcg(&f.k_max[cell])), lo = -from_ordered_bits(__ldcg(&f.k_neg_max[cell]));
      q = fmaxf(q, __uint_as_float(__ldcg(&f.q_amax[cell])));
      k = fmaxf(k, smoothed_amax(hi, lo, g.file.k_mean[cell]));
      const float file_v = g.file.v_channel[cell];
      const float v = keep ? guarded_scale(file_v, __uint_as_float(__ldcg(&f.v_amax[cell]))) : file_v;
      out.v_channel[cell] = v;
      v_up |= v != file_v;
      f.k_max[cell] = f.k_neg_max[cell] = f.v_amax[cell] = f.q_amax[cell] = 0u;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      q = fmaxf(q, __shfl_xor_sync(0xffffffffu, q, o));
      k = fmaxf(k, __shfl_xor_sync(0xffffffffu, k, o));
    }
    v_up = __any_sync(0xffffffffu, v_up);
    if (lane == 0) {
      const float file_q = g.file.q_head[h], file_k = g.file.k_head[h];
      const float sq = keep ? guarded_scale(file_q, q) : file_q, sk = keep ? guarded_scale(file_k, k) : file_k;
      out.q_head[h] = sq, out.k_head[h] = sk;
      raised |= unsigned(sq != file_q) | unsigned(sk != file_k) << 1 | unsigned(v_up) << 2;
    }
  }
  // The CTA's OR through the barrier: an atomicOr into a shared word instead took the hd 72 and 80
  // instances to 64 registers and 32 bytes of spills (ptxas).
  raised = unsigned(__syncthreads_or(raised & 1u) != 0) | unsigned(__syncthreads_or(raised & 2u) != 0) << 1 |
           unsigned(__syncthreads_or(raised & 4u) != 0) << 2;
  if (threadIdx.x == 0) {
    count_guard(g.counts, raised);
    *f.done = 0u;
    *f.bad = 0u;
    __threadfence();
  }
}

// The robust scheme's arrays for this batch. A thread holds one column pair (d, d + hd/2) of one
// token row at a time (RoPE pairs those), so its per-channel state is a few registers; the CTA reduces
// in shared memory, then into `f` with atomics (K's sum in double: its order then leaves the float
// mean as the host's), and the last CTA writes the arrays and clears the scratch. K's mean is this
// batch's, over every token; the amax of K - mean per head comes from K's extremes (exact:
// x -> fl(x - mean) is monotonic). Without a history (`ring` null) the scales are this batch's
// amax / 448 (cpu::current_fine_scales); with one, each head's first CTA takes the rings' maxima
// before this batch, and the last CTA records the batch and takes its scales as
// ScaleBook::record_fine does, with the same helpers (scales.h). kGuard: the static guard instead
// (guard_fine_tail; K's sum is not taken, the file's mean is used).
template <int kHeadDim, bool kGuard = false>
__global__ void __launch_bounds__(kStatThreads)
    fine_stats_kernel(PrepareArgs a, FineArrays out, FineScratch f, FineRing ring, GuardLaunch g) {
  constexpr int kHalf = kHeadDim / 2, kRows = kStatThreads / kHalf;
  __shared__ double s_sum[kRows][kHeadDim];
  __shared__ float s_max[kRows][kHeadDim], s_min[kRows][kHeadDim], s_v[kRows][kHeadDim], s_q[kRows][kHeadDim];
  __shared__ bool last;
  const int head = blockIdx.y, r = threadIdx.x / kHalf, c = threadIdx.x % kHalf;
  if (ring.counts && blockIdx.x == 0) {
    // The rings' maxima before this batch (for this head), here rather than in the last CTA,
    // whose serial tail they would lengthen: with it there the step took 0.187 against 0.151 ms at
    // S 8192, hd 72 (H200).
    const int pos = ring.counts->pos, filled = ring.counts->filled, cells = a.heads * kHeadDim;
    const auto prev = [&](const float* r, int stride, float* const out[2], int i) {
      out[0][i] = fine_ring_prev(r, stride, filled, pos, true);
      out[1][i] = fine_ring_prev(r, stride, filled, pos, false);
    };
    for (int d = threadIdx.x; d < kHeadDim; d += kStatThreads)
      prev(ring.v + head * kHeadDim + d, cells, f.v_prev, head * kHeadDim + d);
    if (threadIdx.x == kStatThreads - 1)
      prev(ring.q + head, a.heads, f.q_prev, head), prev(ring.k + head, a.heads, f.k_prev, head);
  }
  __syncthreads();
  bool bad = false;                                // a non-finite input (fmaxf would drop a NaN)
  const int64_t n = a.cu_seqlens[a.num_segments];  // this launch's tokens (a.total_tokens: the capacity)
  if (r < kRows) {
    float q_amax[2] = {0.f, 0.f}, k_max[2] = {-INFINITY, -INFINITY}, k_min[2] = {INFINITY, INFINITY},
          v_amax[2] = {0.f, 0.f};
    double k_sum[2] = {0.0, 0.0};
    for (int64_t t = int64_t(blockIdx.x) * kRows + r; t < n; t += int64_t(gridDim.x) * kRows) {
      const __nv_bfloat16* row = a.qkv + t * a.qkv_token_stride + int64_t(head) * kHeadDim;
      const int64_t which = int64_t(a.heads) * kHeadDim;
      float x[3][2];
#pragma unroll
      for (int w = 0; w < 3; ++w)
        x[w][0] = __bfloat162float(row[w * which + c]), x[w][1] = __bfloat162float(row[w * which + c + kHalf]);
      if (a.rope_cos) {
        const float cs = a.rope_cos[t * kHalf + c], sn = a.rope_sin[t * kHalf + c];
#pragma unroll
        for (int w = 0; w < 2; ++w) rope_pair(x[w][0], x[w][1], cs, sn);  // q and k
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int w = 0; w < 3; ++w) bad |= (__float_as_uint(x[w][e]) & 0x7F800000u) == 0x7F800000u;
        q_amax[e] = fmaxf(q_amax[e], fabsf(x[0][e]));
        if constexpr (!kGuard) k_sum[e] += double(x[1][e]);
        k_max[e] = fmaxf(k_max[e], x[1][e]);
        k_min[e] = fminf(k_min[e], x[1][e]);
        v_amax[e] = fmaxf(v_amax[e], fabsf(x[2][e]));
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s_sum[r][c + e * kHalf] = k_sum[e];
      s_max[r][c + e * kHalf] = k_max[e];
      s_min[r][c + e * kHalf] = k_min[e];
      s_v[r][c + e * kHalf] = v_amax[e];
      s_q[r][c + e * kHalf] = q_amax[e];
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(f.bad, 1u);
  for (int d = threadIdx.x; d < kHeadDim; d += kStatThreads) {
    double sum = 0.0;
    float mx = -INFINITY, mn = INFINITY, va = 0.f, qa = 0.f;
    for (int i = 0; i < kRows; ++i) {
      sum += s_sum[i][d], mx = fmaxf(mx, s_max[i][d]), mn = fminf(mn, s_min[i][d]);
      va = fmaxf(va, s_v[i][d]), qa = fmaxf(qa, s_q[i][d]);
    }
    const int cell = head * kHeadDim + d;
    if constexpr (!kGuard) atomicAdd(&f.k_sum[cell], sum);
    atomicMax(&f.k_max[cell], ordered_bits(mx));
    atomicMax(&f.k_neg_max[cell], ordered_bits(-mn));
    atomicMax(&f.v_amax[cell], __float_as_uint(va));
    atomicMax(&f.q_amax[cell], __float_as_uint(qa));
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(f.done, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const bool keep = __ldcg(f.bad) == 0u;  // a non-finite batch is not recorded (counted instead)
  if constexpr (kGuard) return guard_fine_tail<kHeadDim>(a, out, f, g, keep);
  const bool hist = ring.counts != nullptr;
  const int cells = a.heads * kHeadDim, slot = hist ? ring.counts->pos : 0, pick = keep ? 0 : 1;
  // A warp a head, its lanes over the channels (H x hd cells in all; a thread a head was bound by
  // the latency of its hd dependent loads: 0.09 against 0.05 ms for the whole step at S 1024).
  // Each step loads all it needs before it stores anything.
  const int lane = threadIdx.x % 32;
  constexpr int kSplit = fp8_split_pairs(kHeadDim);
  __shared__ float s_pick[kSplit > 0 ? kStatThreads / 32 : 1][2][kHeadDim];  // a warp's head: Q's, K - mean's amax
  for (int h = threadIdx.x / 32; h < a.heads; h += kStatThreads / 32) {
    float dev = 0.f, q_head = 0.f;
    for (int d = lane; d < kHeadDim; d += 32) {
      const int cell = h * kHeadDim + d;
      const double sum = __ldcg(&f.k_sum[cell]);
      const float hi = from_ordered_bits(__ldcg(&f.k_max[cell])), lo = -from_ordered_bits(__ldcg(&f.k_neg_max[cell]));
      const float va = __uint_as_float(__ldcg(&f.v_amax[cell]));
      const float v_prev = hist ? __ldcg(&(pick ? f.v_prev[1] : f.v_prev[0])[cell])
                                : 0.f;  // no indexing of a parameter array (it would copy to the stack)
      const bool total = hist && keep;
      const double t_sum = total ? ring.k_sum[cell] : 0.0;
      const float t_hi = total ? ring.k_hi[cell] : 0.f, t_lo = total ? ring.k_lo[cell] : 0.f;
      const float qa = __uint_as_float(__ldcg(&f.q_amax[cell])), t_q = total ? ring.q_hi[cell] : 0.f;
      const float mean = n > 0 ? float(sum / double(n)) : 0.f, ka = smoothed_amax(hi, lo, mean);
      dev = fmaxf(dev, ka);
      q_head = fmaxf(q_head, qa);
      if constexpr (kSplit > 0) s_pick[threadIdx.x / 32][0][d] = qa, s_pick[threadIdx.x / 32][1][d] = ka;
      out.k_mean[cell] = mean;
      out.v_channel[cell] = fine_ring_scale(v_prev, keep, va);
      if (total) {
        ring.v[slot * cells + cell] = va;
        ring.k_sum[cell] = t_sum + sum;
        ring.k_hi[cell] = fmaxf(t_hi, hi);
        ring.k_lo[cell] = fminf(t_lo, lo);
        ring.q_hi[cell] = fmaxf(t_q, qa);
      }
      f.k_sum[cell] = 0.0, f.k_max[cell] = f.k_neg_max[cell] = f.v_amax[cell] = f.q_amax[cell] = 0u;
    }
    if constexpr (kSplit > 0)
      pick_split_pairs_warp<kHeadDim>(s_pick[threadIdx.x / 32][0], s_pick[threadIdx.x / 32][1],
                                      out.qk_split + h * kSplit);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      dev = fmaxf(dev, __shfl_xor_sync(0xffffffffu, dev, o));
      q_head = fmaxf(q_head, __shfl_xor_sync(0xffffffffu, q_head, o));
    }
    if (lane == 0) {
      const float qa = q_head;
      const float q_prev = hist ? __ldcg(&(pick ? f.q_prev[1] : f.q_prev[0])[h]) : 0.f;
      const float k_prev = hist ? __ldcg(&(pick ? f.k_prev[1] : f.k_prev[0])[h]) : 0.f;
      out.k_head[h] = fine_ring_scale(k_prev, keep, dev);
      out.q_head[h] = fine_ring_scale(q_prev, keep, qa);
      if (hist && keep) ring.k[slot * a.heads + h] = dev, ring.q[slot * a.heads + h] = qa;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (FineCounts* cnt = ring.counts) {
      cnt->updates += 1;
      if (keep) {
        cnt->pos = (slot + 1) % kAmaxHistoryLen;
        cnt->filled = min(cnt->filled + 1, kAmaxHistoryLen);
        cnt->tokens += double(n);
      } else {
        cnt->nonfinite += 1;
      }
    }
    *f.done = 0u;
    *f.bad = 0u;
    __threadfence();
  }
}

// ---- quantize / round into the kernel layouts -----------------------------------------------------

// One row a thread, straight from and to global memory. Measured (3 x 4K, FP8 hd 72, ncu): 680 us,
// 39% of the copy bandwidth for the bytes it must move; issue-latency bound (25% occupancy at 109
// registers, 28% of issue slots busy), with 48% of its global sectors and 80% of its shared
// wavefronts excess, yet not bound by coalescing (docs/kernels.md: a coalesced version was slower).
// kFine: the robust scheme (FP8 only), its own instance so the per-tensor one keeps one divisor per
// tensor (a per-channel V divisor costs the hoisted reciprocal of every division: measured, the
// shared FP8 instance took 0.152 against 0.104 ms at 3 x 3520, hd 72).
template <bool kFp8, int kHeadDim, bool kFine = false>
__global__ void __launch_bounds__(kThreads) prepare_kernel(PrepareArgs a, FineArrays fa) {
  using Elem = std::conditional_t<kFp8, uint8_t, __nv_bfloat16>;
  constexpr int kHdPad = layout::qk_pad(kHeadDim, kFp8, kFine);  // the robust scheme's rows: its split pairs
  __shared__ __align__(16) Elem sv[kThreads][kHeadDim];
  // Heads are the fast grid dimension: the CTAs of one row block run side by side, so a token's
  // RoPE row and the 32-byte sectors two heads' slices share come from DRAM once (with rows fastest,
  // every head streamed the whole cos / sin table again: 1.36 GB read for 0.7 GB of inputs at 3 x 4K).
  if (int(blockIdx.y) * kThreads >= a.cu_padded[a.num_segments]) return;  // past this launch's rows (all of the CTA)
  const int head = blockIdx.x;
  const int row = blockIdx.y * kThreads + threadIdx.x;  // padded row
  const int token = padded_row_token(a, row);
  float scale[3] = {1.f, 1.f, 1.f};  // FP8 dequantization scales of q, k, v (v: unless per channel)
  // Robust scheme: the head's K mean and V scales, staged once per CTA.
  __shared__ __align__(16) float s_mean[kFine ? kHeadDim : 1], s_vscale[kFine ? kHeadDim : 1],
      s_vrcp[kFine ? kHeadDim : 1];
  constexpr int kSplit = kFine ? fp8_split_pairs(kHeadDim) : 0;
  __shared__ int s_split[kSplit > 0 ? kSplit : 1];
  __shared__ float s_stage[kSplit > 0 ? 2 * kSplit * kThreads : 1];  // the split pairs' values, a column a thread
  constexpr bool fine = kFine;
  if constexpr (kFp8) {
    if constexpr (fine) {
      scale[0] = fa.q_head[head];
      scale[1] = fa.k_head[head];
      for (int d = threadIdx.x; d < kHeadDim; d += kThreads) {
        s_mean[d] = fa.k_mean[head * kHeadDim + d];
        s_vscale[d] = fa.v_channel[head * kHeadDim + d];
        s_vrcp[d] = __frcp_rn(s_vscale[d]);
      }
      if constexpr (kSplit > 0)
        if (int(threadIdx.x) < kSplit) s_split[threadIdx.x] = fa.qk_split[head * kSplit + threadIdx.x];
      __syncthreads();
    } else {
      for (int w = 0; w < 3; ++w) scale[w] = a.dynamic ? a.dynamic->t[w].scale : a.fixed[w];
    }
  }

  // Q and K: one row each, RoPE'd (K minus its mean in the robust scheme), padded to kHdPad with zeros.
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    Elem* dst = (w == 0 ? static_cast<Elem*>(a.q) : static_cast<Elem*>(a.k)) + (int64_t(head) * a.n_pad + row) * kHdPad;
    if constexpr (kSplit > 0) {
      const uint64_t mask = split_mask<kHeadDim>(s_split);
      if (w == 1)
        rope_row_out<kFp8, kHeadDim, kHdPad, true, true>(a, token, head, w, scale[w], s_mean, dst, s_split, mask,
                                                         s_stage);
      else
        rope_row_out<kFp8, kHeadDim, kHdPad, false, true>(a, token, head, w, scale[w], nullptr, dst, s_split, mask,
                                                          s_stage);
    } else if (w == 1 && fine) {
      rope_row_out<kFp8, kHeadDim, kHdPad, true>(a, token, head, w, scale[w], s_mean, dst);
    } else {
      rope_row_out<kFp8, kHeadDim, kHdPad>(a, token, head, w, scale[w], nullptr, dst);
    }
  }

  // V: into shared memory, then out transposed, 128 keys per V^T row.
  {
    uint32_t in[kHeadDim / 2];
    load_packed<kHeadDim>(a, token, head, 2, in);
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) {
      const float2 f = unpack_bf16x2(in[i]);
      if constexpr (kFp8 && fine) {  // per-channel divisors: through their reciprocals, exactly as dividing
        const float2 sc = reinterpret_cast<const float2*>(s_vscale)[i], rc = reinterpret_cast<const float2*>(s_vrcp)[i];
        const float q0 = div_by_reciprocal(f.x, sc.x, rc.x);
        const float q1 = div_by_reciprocal(f.y, sc.y, rc.y);
        const uint16_t p = ptx::e4m3x2_of_f32(q0, q1);
        sv[threadIdx.x][2 * i] = uint8_t(p), sv[threadIdx.x][2 * i + 1] = uint8_t(p >> 8);
      } else if constexpr (kFp8) {  // one division and one conversion per value, two values a conversion
        const uint16_t p = ptx::e4m3x2_of_f32(__fdiv_rn(f.x, scale[2]), __fdiv_rn(f.y, scale[2]));
        sv[threadIdx.x][2 * i] = uint8_t(p), sv[threadIdx.x][2 * i + 1] = uint8_t(p >> 8);
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

// The statistics pass (robust: fine_stats_kernel, per tensor: qkv_amax_kernel) where the scales come
// from the batch or static ones are guarded, then the prepare kernel.
template <int kHeadDim>
void launch_for_head_dim(const PrepareArgs& a, bool fp8, cudaStream_t stream, const FineLaunch* fine,
                         const GuardLaunch* guard) {
  const GuardLaunch g = guard ? *guard : GuardLaunch{};
  if (fp8 && fine && (fine->current || g.counts)) {
    const int rows = kStatThreads / (kHeadDim / 2);
    const int blocks_x = int(std::min<int64_t>((a.total_tokens + rows - 1) / rows, 2048 / std::max(1, a.heads) + 1));
    const dim3 grid(blocks_x, a.heads);
    if (g.counts)
      fine_stats_kernel<kHeadDim, true>
          <<<grid, kStatThreads, 0, stream>>>(a, fine->arrays, fine->scratch, FineRing{}, g);
    else
      fine_stats_kernel<kHeadDim><<<grid, kStatThreads, 0, stream>>>(a, fine->arrays, fine->scratch, fine->ring, g);
    FOVEA_CUDA_CHECK(cudaGetLastError());
  } else if (fp8 && (a.dynamic || g.counts)) {
    const int blocks_x =
        int(std::min<int64_t>((a.total_tokens + kThreads - 1) / kThreads, 1024 / std::max(1, a.heads) + 1));
    qkv_amax_kernel<kHeadDim><<<dim3(blocks_x, a.heads), kThreads, 0, stream>>>(a, g);
    FOVEA_CUDA_CHECK(cudaGetLastError());
  }
  if (a.n_pad / kThreads > 65535)
    fail_cat("attention: ", a.n_pad, " padded tokens in one batch; the prepare step takes up to ", 65535 * kThreads);
  const dim3 grid(unsigned(a.heads), unsigned(a.n_pad / kThreads));
  if (fp8 && fine)
    prepare_kernel<true, kHeadDim, true><<<grid, kThreads, 0, stream>>>(a, fine->arrays);
  else if (fp8)
    prepare_kernel<true, kHeadDim><<<grid, kThreads, 0, stream>>>(a, {});
  else
    prepare_kernel<false, kHeadDim><<<grid, kThreads, 0, stream>>>(a, {});
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_prepare(const PrepareArgs& a, bool fp8, int head_dim, cudaStream_t stream, const FineLaunch* fine,
                    const GuardLaunch* guard) {
  dispatch_head_dim(head_dim, [&](auto hd) { launch_for_head_dim<decltype(hd)::value>(a, fp8, stream, fine, guard); });
}

}  // namespace fovea::cuda
