// The layouts the prepare step writes and the flash kernel reads (one definition for both).
//
// Tokens are padded per segment to whole 128-token tiles: segment s occupies padded rows
// [cu_padded[s], cu_padded[s] + round_up(len_s, 128)), and the padding rows are written as zeros, so
// every Q, K and V tile a CTA loads starts on a tile boundary and never mixes segments.
//   Q, K: [H][n_pad][hd_pad]  (hd_pad = head_dim rounded up to one wgmma K step: 16 bf16 / 32 fp8;
//                              the extra dims are zeros, so QK^T over hd_pad equals QK^T over hd;
//                              the robust scheme's: qk_pad, its split pairs in the padding)
//   V^T:  [H][head_dim][n_pad] (keys contiguous: the K-major B operand of O += P V)
// FP8 only: within every 16 keys, V^T stores key kv_perm(l) at column l. That is the order in which
// the QK^T accumulator already holds P in each thread's registers, so P feeds the second wgmma as its
// A operand with no shuffles (wgmma's k32 A fragment wants 4 consecutive k per register; the m64 f32
// accumulator gives each thread column pairs {2t, 2t+1} and {2t+8, 2t+9}).
#pragma once
#include <cstdint>

#include "fovea/scales.h"

namespace fovea::cuda::layout {

constexpr int kBlockN = 128;   // keys per KV block
constexpr int kTilePad = 128;  // segment padding granularity: KV tiles never straddle segments
                               // (a Q tile may read past its segment: those rows are not stored)

// Consumer warpgroups per CTA, 64 query rows each: 2, or 3 for FP8 at head_dim <= 80, where softmax
// rather than the tensor cores bounds the kernel, so a third warpgroup keeps the exponent units busy
// while two others hold the tensor cores (192-row tiles, as FlashAttention-3 uses there). The plan
// picks 2 or 3 per batch (flash-attention.cu: fewer, longer CTAs can leave SMs idle at the end).
__host__ __device__ constexpr int max_consumer_warpgroups(bool fp8, int head_dim) {
  return fp8 && head_dim <= 80 ? 3 : 2;
}

__host__ __device__ constexpr int kstep(bool fp8) { return fp8 ? 32 : 16; }
__host__ __device__ constexpr int head_dim_pad(int head_dim, bool fp8) {
  return (head_dim + kstep(fp8) - 1) / kstep(fp8) * kstep(fp8);
}
// A Q / K row's width: the robust scheme's FP8 rows hold its split pairs (fovea/scales.h), one K step
// wider than the others' at head_dim 64 and 128 ("wide" rows: their own kernel instances).
__host__ __device__ constexpr int qk_pad(int head_dim, bool fp8, bool robust) {
  return fp8 && robust ? fp8_robust_qk_width(head_dim) : head_dim_pad(head_dim, fp8);
}
__host__ __device__ constexpr bool has_wide_rows(bool fp8, int head_dim) {
  return qk_pad(head_dim, fp8, true) != qk_pad(head_dim, fp8, false);
}
__host__ __device__ constexpr int round_up_tile(int n) { return (n + kTilePad - 1) / kTilePad * kTilePad; }

// FP8 V^T column l (0..15 within a 16-key group) holds key kv_perm(l) of that group.
__host__ __device__ constexpr int kv_perm(int l) {
  const int t = l / 4, i = l % 4;
  return 2 * t + (i & 1) + 8 * (i >> 1);
}

}  // namespace fovea::cuda::layout
