// fovea's Hopper flash-attention forward kernel (FP8 E4M3 and BF16), packed varlen, non-causal.
//
// Design. One CTA = one (segment, 64*W-row query tile, head), W consumer warpgroups + 1 producer:
//   - warpgroup 0 is the producer (24 registers after setmaxnreg): one thread issues TMA bulk tensor
//     loads, Q once, then K and V^T for each 128-key block into a 3-stage ring; each stage completes
//     on a "full" mbarrier (transaction bytes) and is handed back on an "empty" mbarrier.
//   - W consumer warpgroups, 64 query rows apiece: W = 2 (240 registers), or for FP8 at head_dim <= 80
//     W = 3 (160 registers, 192-row tiles) when the plan predicts it finishes the batch sooner
//     (tile-plan.h: 192-row tiles do ~17% more per SM but make fewer, longer CTAs, which leave SMs
//     idle on small batches, e.g. one 1024-token image).
//       S = Q K^T   wgmma m64n128k{16|32}, A and B K-major in shared memory with a 32-byte swizzle:
//                   one swizzle row = one wgmma K step, so head_dim 72 is padded only to 80 (bf16) or
//                   96 (fp8) inside the prepare step's layout, never by a copy.
//       softmax     online, fp32 registers: the exponent argument is one FFMA (raw score times the
//                   scale, minus the shifted row max), exp2 on the MUFU or, for the column pairs
//                   fovea/flash-p.h names, a degree-3 polynomial on the FMA pipe. FP8 P = 2^8 *
//                   exp2(s - m) cast to E4M3 (attention.h's PScheme: 128-key blocks visited last to
//                   first, so the only partial block, the segment's last, is masked in the prologue
//                   and a leading sink key does not flush the other blocks' P).
//       O += P V    wgmma m64n{N}k{16|32}, P straight from registers (the FP8 k32 A fragment matches
//                   the accumulator because V^T's keys are permuted by the prepare step: layout.cuh),
//                   V^T K-major in shared memory with a 128-byte swizzle. N = head_dim, plus 8 for
//                   FP8 where flash-p.h's fp8_tensor_row_sum holds: V^T's stages carry 8 rows of
//                   E4M3 ones (written once), so P V's last 8 columns are the row sum l of the E4M3
//                   P, folded with O; otherwise l adds the fp32 P on the FMA pipe.
//                   FP8 accumulates two-level: each block's PV in a fresh accumulator, folded into O
//                   in fp32 with one FFMA per element, O lagging one rescale behind (kTwoLevel below:
//                   the FP8 wgmma's own accumulation is not fp32).
//     Overlap: BF16 and 2-warpgroup FP8: inside a warpgroup, softmax of block i runs while PV of
//     block i-1 is on the tensor cores (O is folded after that PV lands); BF16 GEMM issue also goes
//     round-robin between warpgroups through named barriers (FlashAttention-3's ping-pong). FP8 with
//     3 warpgroups runs PV, fold, S, softmax in series inside each warpgroup (S, P and both
//     accumulators then fit in 160 registers) and leaves the interleaving of the three warpgroups to
//     the warp schedulers: measured faster than either overlap (docs/kernels.md).
//   - epilogue: O / l (times the V descale for FP8: one division a row with per-tensor scales) to
//     bf16, stored straight into out [N, H, hd] rows that belong to the segment.
// Scales are read from device memory at run time, so a dynamic-scaling forward replays in a graph.
// Measured rates, profiles and what limits the kernel: docs/kernels.md; every instance compiles
// without spills (tools/ptxas-report.sh).

#include <atomic>

#include "attention/cuda/head-dims.cuh"
#include "attention/cuda/kernels.cuh"
#include "attention/cuda/layout.cuh"
#include "attention/cuda/ptx.cuh"
#include "attention/cuda/wgmma-ops.cuh"
#include "fovea/flash-p.h"

namespace fovea::cuda {

namespace {

// Compile-time switches of the kernel's schedule, for A/B runs (tools/kernel-variants.sh); the
// defaults are the measured best (docs/kernels.md):
//   FOVEA_FLASH_PINGPONG_FP8  FlashAttention-3's ping-pong between consumer warpgroups in the FP8
//                             kernels (the BF16 kernels always take turns).
//   FOVEA_FLASH_SERIAL3       FP8 with 3 consumer warpgroups: PV, its fold, then S, with no overlap
//                             inside a warpgroup (the other two warpgroups hide its softmax), so S,
//                             P and both accumulators fit in 160 registers without spilling.
//   FOVEA_FLASH_ROWMAX_CHAINS independent max chains per row in the softmax (1, 2 or 4; 0: the
//                             measured best per dtype, 1 for FP8 and 2 for BF16): the same FMNMX
//                             count in shorter chains. Two chains: BF16 +2-3% at S >= 8192 and -2%
//                             at 1024 tokens, FP8 -1 to -10% (H100, docs/kernels.md).
#ifndef FOVEA_FLASH_ROWMAX_CHAINS
#define FOVEA_FLASH_ROWMAX_CHAINS 0
#endif
static_assert(FOVEA_FLASH_ROWMAX_CHAINS == 0 || FOVEA_FLASH_ROWMAX_CHAINS == 1 || FOVEA_FLASH_ROWMAX_CHAINS == 2 ||
              FOVEA_FLASH_ROWMAX_CHAINS == 4);
#ifndef FOVEA_FLASH_PINGPONG_FP8
#define FOVEA_FLASH_PINGPONG_FP8 0
#endif
#ifndef FOVEA_FLASH_SERIAL3
#define FOVEA_FLASH_SERIAL3 1
#endif

// kWide: the robust scheme's wider Q / K rows at head_dim 64 and 128 (layout::qk_pad), one more K
// step of Q K^T over the split pairs.
template <bool kFp8, int kHeadDim, int kConsumerWgs, bool kWide = false>
struct FlashCfg {
  static constexpr int kConsumers = kConsumerWgs;
  static constexpr uint32_t kPolyPairs = kFp8 ? fp8_poly_exp_pairs(kHeadDim) : 0u;  // flash-p.h
  static constexpr bool kTcSum = kFp8 && fp8_tensor_row_sum(kHeadDim);  // V^T's 8 rows of ones: l in P V's last columns
  static constexpr int kPvN = kHeadDim + (kTcSum ? 8 : 0);              // PV's N, the accumulator's columns
  static constexpr int kBlockM = 64 * kConsumers, kBlockN = layout::kBlockN;
  static constexpr int kKStep = layout::kstep(kFp8);
  static constexpr int kHdPad = layout::qk_pad(kHeadDim, kFp8, kWide);
  static constexpr int kChunks = kHdPad / kKStep;  // 32-byte K chunks of a Q / K row
  static constexpr int kQChunkBytes = kBlockM * 32;
  static constexpr int kKChunkBytes = kBlockN * 32;
  static constexpr int kQBytes = kChunks * kQChunkBytes;
  static constexpr int kKBytes = kChunks * kKChunkBytes;
  static constexpr int kVChunkKeys = kFp8 ? 128 : 64;  // keys in one 128-byte V^T row
  static constexpr int kVChunks = kBlockN / kVChunkKeys;
  static constexpr int kVChunkBytes = kPvN * 128;
  static constexpr int kVBytes = kVChunks * kVChunkBytes;
  static constexpr int kVLoadBytes = kVChunks * kHeadDim * 128;  // what TMA writes (not the ones)
  static constexpr int kSmemLimit = 227 * 1024;                  // per CTA on H100/H200
  static constexpr int smem_bytes(int stages) {
    return 1024 + kQBytes + stages * (kKBytes + kVBytes) + 8 * (2 * stages + 1);
  }
  static constexpr int kStages = smem_bytes(3) <= kSmemLimit ? 3 : 2;  // 3 fit up to bf16 hd 128 (225 KB)
  static constexpr int kSmemBytes = smem_bytes(kStages);
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : 240;  // 24 * 128 + regs * 128 * kConsumers <= 64K
  static_assert(24 * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file exceeded");
  static_assert(kHeadDim % 8 == 0, "wgmma N (= head_dim) must be a multiple of 8");
  static_assert(kVChunkBytes % 1024 == 0 && kQBytes % 1024 == 0 && kKBytes % 1024 == 0,
                "128-byte-swizzled V^T tiles must start on 1024-byte boundaries");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory budget of one H100/H200 CTA exceeded");
};

template <bool kFp8>
__device__ __forceinline__ void mma_qk(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kFp8)
    wgmma::wgmma_ss_e4m3_n128(d, da, db, scale_d);
  else
    wgmma::wgmma_ss_bf16_n128(d, da, db, scale_d);
}

template <bool kFp8, int N>
__device__ __forceinline__ void mma_pv(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  if constexpr (kFp8) {
    if constexpr (N == 64)
      wgmma::wgmma_rs_e4m3_n64(d, a, db, scale_d);
    else if constexpr (N == 72)
      wgmma::wgmma_rs_e4m3_n72(d, a, db, scale_d);
    else if constexpr (N == 80)
      wgmma::wgmma_rs_e4m3_n80(d, a, db, scale_d);
    else if constexpr (N == 88)
      wgmma::wgmma_rs_e4m3_n88(d, a, db, scale_d);
    else if constexpr (N == 128)
      wgmma::wgmma_rs_e4m3_n128(d, a, db, scale_d);
    else
      wgmma::wgmma_rs_e4m3_n136(d, a, db, scale_d);
  } else {
    if constexpr (N == 64)
      wgmma::wgmma_rs_bf16_n64(d, a, db, scale_d);
    else if constexpr (N == 72)
      wgmma::wgmma_rs_bf16_n72(d, a, db, scale_d);
    else if constexpr (N == 80)
      wgmma::wgmma_rs_bf16_n80(d, a, db, scale_d);
    else
      wgmma::wgmma_rs_bf16_n128(d, a, db, scale_d);
  }
}

template <bool kFp8, int kHeadDim, int kConsumerWgs, bool kWide>
__global__ void __launch_bounds__(FlashCfg<kFp8, kHeadDim, kConsumerWgs, kWide>::kThreads, 1)
    flash_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v, const FlashParams p) {
  using C = FlashCfg<kFp8, kHeadDim, kConsumerWgs, kWide>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + C::kQBytes;
  uint8_t* sV = sK + C::kStages * C::kKBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(sV + C::kStages * C::kVBytes);
  uint64_t* empty = full + C::kStages;
  uint64_t* q_full = empty + C::kStages;

  const int2 tile = p.tiles[blockIdx.x];  // within the capacity, listed or not
  if (int(blockIdx.x) >= *p.num_tiles) return;
  const int seg = tile.x, m_block = tile.y, head = blockIdx.y;
  const int seq_begin = p.cu_seqlens[seg];
  const int seqlen = p.cu_seqlens[seg + 1] - seq_begin;
  const int pad_begin = p.cu_padded[seg];
  const int n_blocks = (seqlen + C::kBlockN - 1) / C::kBlockN;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 128 * C::kConsumers);  // every consumer thread arrives
    }
    ptx::mbar_init(q_full, 1);
    ptx::fence_barrier_init();
  }
  if constexpr (C::kTcSum) {  // E4M3 1.0 in V^T's rows head_dim .. head_dim + 7 of every stage, once
    constexpr int kPieces = C::kStages * C::kVChunks * 8 * 128 / 16;
    for (int i = threadIdx.x; i < kPieces; i += C::kThreads) {
      const int chunk = i / 64;  // 1024 bytes a chunk's ones
      *reinterpret_cast<uint4*>(sV + chunk * C::kVChunkBytes + kHeadDim * 128 + (i % 64) * 16) =
          make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
    }
    ptx::fence_proxy_async();  // the wgmma reads them through the async proxy
  }
  __syncthreads();

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    ptx::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tensormap(&tm_q);
      ptx::prefetch_tensormap(&tm_k);
      ptx::prefetch_tensormap(&tm_v);
      ptx::mbar_arrive_expect_tx(q_full, C::kQBytes);
      for (int c = 0; c < C::kChunks; ++c)
        ptx::tma_load_3d(sQ + c * C::kQChunkBytes, &tm_q, q_full, c * C::kKStep, pad_begin + m_block * C::kBlockM,
                         head);
      for (int i = 0; i < n_blocks; ++i) {
        const int n = n_blocks - 1 - i, s = i % C::kStages;
        if (i >= C::kStages) ptx::mbar_wait(&empty[s], ((i / C::kStages) & 1) ^ 1);
        ptx::mbar_arrive_expect_tx(&full[s], C::kKBytes + C::kVLoadBytes);
        const int key0 = pad_begin + n * C::kBlockN;
        for (int c = 0; c < C::kChunks; ++c)
          ptx::tma_load_3d(sK + s * C::kKBytes + c * C::kKChunkBytes, &tm_k, &full[s], c * C::kKStep, key0, head);
        for (int c = 0; c < C::kVChunks; ++c)
          ptx::tma_load_3d(sV + s * C::kVBytes + c * C::kVChunkBytes, &tm_v, &full[s], key0 + c * C::kVChunkKeys, 0,
                           head);
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  ptx::setmaxnreg_inc<C::kConsumerRegs>();
  const int cw = wg - 1;  // consumer warpgroup: query rows cw*64 .. cw*64+63 of the tile
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  constexpr int kPvN = C::kPvN;
  float o[kPvN / 2];
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const int scale_head = p.fine ? head : 0;  // the robust scheme's Q and K scales are per head
  const float qk_scale =
      kFp8 ? p.softmax_scale_log2 * p.q_scale[scale_head] * p.k_scale[scale_head] : p.softmax_scale_log2;
  constexpr float kPShift = kFp8 ? 8.f : 0.f;  // FP8: P = 2^8 * exp2(s - m), E4M3's top binade

  // Software pipeline inside the warpgroup (FlashAttention-3's intra-warpgroup overlap): while the
  // tensor cores run O += P_{i-1} V_{i-1}, the warps compute softmax on S_i = Q K_i^T, which was
  // issued just before it. O is rescaled only after that PV has landed.
  constexpr int kPSteps = C::kBlockN / C::kKStep;
  float sacc[64];
  uint32_t pa[kPSteps][4];  // P of the previous block, as wgmma A fragments
  float corr[2], corr_prev[2];
  // FP8: Hopper's FP8 wgmma does not keep a full fp32 accumulator (SageAttention2 measured about 22
  // bits), so adding every block's small PV share into one large running O loses precision in
  // proportion to the number of blocks: with image-like V (alike neighbours) over 32768 keys the
  // error was 4x the emulation's (tests/gpu: CorrelatedValuesMatchTheEmulation). Each block's PV
  // therefore lands in a fresh accumulator (scale_d = 0 on its first k step) and is added to O in
  // fp32, folded into the rescale: two-level accumulation. BF16 wgmma accumulates in fp32.
  // The fold is one FFMA per element, o = o * corr_{i-1} + PV_{i-1}: O lags one rescale behind (it
  // holds blocks < i-1 relative to the row max of block i-2), so PV_{i-1}, made with block i-1's max,
  // is added exactly when O reaches that max. The epilogue applies the last factor.
  constexpr bool kTwoLevel = kFp8;
  float opv[kPvN / 2];
  constexpr bool kSerial = kTwoLevel && C::kConsumers == 3 && FOVEA_FLASH_SERIAL3;

  // Shared-memory descriptors, made once: a descriptor's low 14 bits are the address / 16, so a tile's
  // chunk or stage is the base descriptor plus its byte offset / 16 (smem < 256 KB: no carry out).
  const uint64_t q_desc = ptx::kmajor_desc(sQ + cw * 64 * 32, 256, ptx::kSwizzle32B);
  const uint64_t k_desc = ptx::kmajor_desc(sK, 256, ptx::kSwizzle32B);
  const uint64_t v_desc = ptx::kmajor_desc(sV, 1024, ptx::kSwizzle128B);
  auto issue_qk = [&](int s) {
#pragma unroll
    for (int c = 0; c < C::kChunks; ++c)
      mma_qk<kFp8>(sacc, q_desc + c * (C::kQChunkBytes >> 4), k_desc + ((s * C::kKBytes + c * C::kKChunkBytes) >> 4),
                   c > 0);
    ptx::wgmma_commit();
  };
  auto issue_pv = [&](int s) {
#pragma unroll
    for (int kc = 0; kc < kPSteps; ++kc) {
      const int v_off = kFp8 ? s * C::kVBytes + kc * 32 : s * C::kVBytes + (kc / 4) * C::kVChunkBytes + (kc % 4) * 32;
      mma_pv<kFp8, kPvN>(kTwoLevel ? opv : o, pa[kc], v_desc + (v_off >> 4), kTwoLevel ? int(kc > 0) : 1);
    }
    ptx::wgmma_commit();
  };
  // Online softmax of sacc in place (P = exp2(s * scale - m), times 256 for FP8); corr[r] is the
  // factor by which the row's previous O and l shrink. FP8: the column pairs whose kPolyPairs bit is
  // set take exp2_poly3 on the FMA pipe, the others the MUFU (the emulation does the same).
  auto softmax = [&] {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows g and g + 8 of this warp's 16
      constexpr int kChains = FOVEA_FLASH_ROWMAX_CHAINS ? FOVEA_FLASH_ROWMAX_CHAINS : kFp8 ? 1 : 2;
      float part[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[c] = -INFINITY;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        part[j % kChains] = fmaxf(part[j % kChains], fmaxf(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1]));
#pragma unroll
      for (int c = 1; c < kChains; ++c) part[0] = fmaxf(part[0], part[c]);
      float mx = part[0];
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[r], mx * qk_scale);
      corr[r] = ptx::exp2_approx(row_max[r] - m_new);
      row_max[r] = m_new;
      const float shift = m_new - kPShift;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sacc[4 * j + 2 * r + e];
          const float arg = fmaf(x, qk_scale, -shift);
          x = (C::kPolyPairs >> j) & 1 ? exp2_poly3(arg) : ptx::exp2_approx(arg);
          if (!C::kTcSum) sum += x;
        }
      if (!C::kTcSum) row_sum[r] = row_sum[r] * corr[r] + sum;
    }
  };
  // Plain chains: tree reductions for the row max / sum and a vote to skip this rescale were slower
  // (docs/kernels.md).
  auto rescale_o = [&] {
#pragma unroll
    for (int j = 0; j < kPvN / 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = o[4 * j + 2 * r + e];
          x = kTwoLevel ? fmaf(x, corr_prev[r], opv[4 * j + 2 * r + e]) : x * corr[r];
        }
  };
  // P as the A operand (see layout.cuh for why FP8 needs no shuffle).
  auto pack_p = [&] {
#pragma unroll
    for (int kc = 0; kc < kPSteps; ++kc) {
      if constexpr (kFp8) {
        // Register i of the k32 A fragment: row r = i % 2, column pairs j = 4 kc + 2 (i / 2) and j + 1.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float* x = sacc + 4 * (4 * kc + 2 * (i / 2)) + 2 * (i % 2);
          pa[kc][i] = ptx::pack_e4m3x4(x[0], x[1], x[4], x[5]);
        }
      } else {
        const float* q = sacc + 8 * kc;
        pa[kc][0] = ptx::pack_bf16x2(q[0], q[1]);
        pa[kc][1] = ptx::pack_bf16x2(q[2], q[3]);
        pa[kc][2] = ptx::pack_bf16x2(q[4], q[5]);
        pa[kc][3] = ptx::pack_bf16x2(q[6], q[7]);
      }
    }
  };

  // Round-robin GEMM issue between the consumer warpgroups (FlashAttention-3's ping-pong): a
  // warpgroup issues its GEMMs only on its turn and then hands the turn to the next, so the others'
  // softmax (MUFU, FMA pipes) runs while its GEMMs hold the tensor cores. Named barrier 1 + w is
  // warpgroup w's turn (256 threads: w waits, its predecessor arrives); warpgroup 0 starts.
  const int my_turn = 1 + cw, next_turn = 1 + (cw + 1) % C::kConsumers;
  const bool is_last_wg = cw == C::kConsumers - 1;
  constexpr bool kPingPong = !kFp8 || FOVEA_FLASH_PINGPONG_FP8;
  if (kPingPong && is_last_wg) ptx::named_bar_arrive(1, 256);
  auto take_turn = [&] {
    if (kPingPong) ptx::named_bar_sync(my_turn, 256);
  };
  auto pass_turn = [&](bool last) {
    if (kPingPong && !(last && is_last_wg)) ptx::named_bar_arrive(next_turn, 256);  // nobody waits after the end
  };

  ptx::mbar_wait(q_full, 0);
  // Block 0 of the walk is the segment's last KV block, the only one that can be partial.
  ptx::mbar_wait(&full[0], 0);
  take_turn();
  ptx::wgmma_fence();
  issue_qk(0);
  pass_turn(false);
  ptx::wgmma_wait<0>();
  ptx::fence_regs(sacc);
  const int valid = seqlen - (n_blocks - 1) * C::kBlockN;
  if (valid < C::kBlockN) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * j + 2 * t + e >= valid) sacc[4 * j + e] = sacc[4 * j + 2 + e] = -INFINITY;
  }
  softmax();
  pack_p();
  for (int i = 1; i < n_blocks; ++i) {
    const int s = i % C::kStages, s_prev = (i - 1) % C::kStages;
    if constexpr (kSerial) {
      // PV_{i-1}, its fold, then S_i: P, the PV accumulator and S are never live together.
      take_turn();
      ptx::wgmma_fence();
      issue_pv(s_prev);
      pass_turn(false);
      ptx::wgmma_wait<0>();
      ptx::fence_regs(o);
      ptx::fence_regs(opv);
      ptx::mbar_arrive(&empty[s_prev]);
      corr_prev[0] = corr[0];
      corr_prev[1] = corr[1];
      rescale_o();
      ptx::mbar_wait(&full[s], (i / C::kStages) & 1);
      take_turn();
      ptx::wgmma_fence();
      issue_qk(s);
      pass_turn(false);
      ptx::wgmma_wait<0>();
      ptx::fence_regs(sacc);
      softmax();
      pack_p();
      continue;
    }
    ptx::mbar_wait(&full[s], (i / C::kStages) & 1);
    take_turn();
    ptx::wgmma_fence();
    issue_qk(s);
    issue_pv(s_prev);
    pass_turn(false);
    ptx::wgmma_wait<1>();  // S_i is ready; PV_{i-1} may still run
    ptx::fence_regs(sacc);
    corr_prev[0] = corr[0];
    corr_prev[1] = corr[1];
    softmax();
    ptx::wgmma_wait<0>();
    ptx::fence_regs(o);
    if constexpr (kTwoLevel) ptx::fence_regs(opv);
    ptx::mbar_arrive(&empty[s_prev]);
    rescale_o();
    pack_p();
  }
  take_turn();
  ptx::wgmma_fence();
  issue_pv((n_blocks - 1) % C::kStages);
  pass_turn(true);
  ptx::wgmma_wait<0>();
  ptx::fence_regs(o);
  if constexpr (kTwoLevel) {
    ptx::fence_regs(opv);
    corr_prev[0] = corr[0];
    corr_prev[1] = corr[1];
    rescale_o();
  }

  // Epilogue: normalize, convert, store rows that belong to the segment. The tile's coordinates are
  // read again (the barriers above order memory), so none of them holds a register through the loop.
  // V's descale: one per tensor, or (robust scheme) one per output column of this head.
  const float* v_scale = kFp8 ? p.v_scale + (p.fine ? blockIdx.y * kHeadDim : 0) : nullptr;
  const int2 tile_e = p.tiles[blockIdx.x];
  const int seg_begin_e = p.cu_seqlens[tile_e.x], seg_len_e = p.cu_seqlens[tile_e.x + 1] - seg_begin_e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    if constexpr (C::kTcSum) {
      sum = o[4 * (kHeadDim / 8) + 2 * r];  // every one of the last 8 columns holds the row's l
    } else {
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    }
    const int row = tile_e.y * C::kBlockM + cw * 64 + warp * 16 + g + 8 * r;
    if (row < seg_len_e) {
      __nv_bfloat16* dst = p.out + (int64_t(seg_begin_e + row) * p.heads + blockIdx.y) * kHeadDim;
      // One division a row with per-tensor scales (the same bits as one per column: s / l);
      // per-channel V scales divide per column, as the emulation does: o * (s_c / l).
      const float inv = kFp8 ? v_scale[0] / sum : 1.f / sum;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const float inv0 = kFp8 && p.fine ? v_scale[col] / sum : inv;
        const float inv1 = kFp8 && p.fine ? v_scale[col + 1] / sum : inv;
        *reinterpret_cast<uint32_t*>(dst + col) =
            ptx::pack_bf16x2(o[4 * j + 2 * r] * inv0, o[4 * j + 2 * r + 1] * inv1);
      }
    }
  }
}

template <bool kFp8, int kHeadDim, int kConsumerWgs, bool kWide = false>
void launch(const FlashParams& p, const FlashMaps& m, int num_tiles, cudaStream_t stream) {
  using C = FlashCfg<kFp8, kHeadDim, kConsumerWgs, kWide>;
  auto* kernel = flash_fwd_kernel<kFp8, kHeadDim, kConsumerWgs, kWide>;
  // One attribute call per instantiation and GPU: the attribute belongs to the device's copy of the
  // kernel, and encoder replicas on several GPUs (fovea serve --devices) launch from several threads.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  FOVEA_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load() & bit)) {
    FOVEA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
    configured.fetch_or(bit);
  }
  kernel<<<dim3(unsigned(num_tiles), unsigned(p.heads)), C::kThreads, C::kSmemBytes, stream>>>(m.q, m.k, m.v, p);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

// The FP8 instances of head_dim D: 2 or 3 consumer warpgroups, and with kHasWide the wide rows too.
template <int D, bool kHasWide>
void launch_fp8(const FlashParams& p, const FlashMaps& maps, int num_tiles, int consumers, bool wide,
                cudaStream_t stream) {
  constexpr bool kThree = layout::max_consumer_warpgroups(true, D) == 3;
  if constexpr (kHasWide) {
    if (wide) {
      if constexpr (kThree)
        if (consumers == 3) return launch<true, D, 3, true>(p, maps, num_tiles, stream);
      return launch<true, D, 2, true>(p, maps, num_tiles, stream);
    }
  }
  if constexpr (kThree)
    if (consumers == 3) return launch<true, D, 3>(p, maps, num_tiles, stream);
  launch<true, D, 2>(p, maps, num_tiles, stream);
}

}  // namespace

void launch_flash(const FlashParams& p, const FlashMaps& maps, int max_tiles, bool fp8, int head_dim, int consumers,
                  bool wide, cudaStream_t stream) {
  const int num_tiles = max_tiles;  // the grid: CTAs past the listed tiles return at once
  if (num_tiles == 0) return;
  if (consumers < 2 || consumers > layout::max_consumer_warpgroups(fp8, head_dim))
    fail_cat("FOVEA attention: ", consumers, " consumer warpgroups for ", fp8 ? "fp8" : "bf16", " head_dim ", head_dim);
  if (wide && !layout::has_wide_rows(fp8, head_dim))
    fail_cat("FOVEA attention: no wide rows for ", fp8 ? "fp8" : "bf16", " head_dim ", head_dim);
  dispatch_head_dim(head_dim, [&](auto hd) {
    constexpr int D = decltype(hd)::value;
    if (!fp8)
      launch<false, D, 2>(p, maps, num_tiles, stream);
    else if constexpr (layout::has_wide_rows(true, D))
      launch_fp8<D, true>(p, maps, num_tiles, consumers, wide, stream);
    else
      launch_fp8<D, false>(p, maps, num_tiles, consumers, false, stream);
  });
}

}  // namespace fovea::cuda
