// fovea/attention-ref.h: the CPU reference of packed varlen attention, the oracle for every other
// backend (docs/fp8.md §Correctness): exact fp64, and bit-level emulations of what the BF16 and FP8
// kernels compute, with the FP8 schemes' scales. The research variants (rotate_qk, qk_pair,
// Fp8Exact: measured in docs/fp8.md, run by no kernel) are marked where they appear.
#pragma once
#include <cstdint>
#include <vector>

#include "fovea/attention.h"
#include "fovea/fp8-plan.h"
#include "fovea/scales.h"

namespace fovea {

namespace cpu {

// How the reference computes:
//   EXACT - fp64 throughout, two-pass softmax (the oracle).
//   BF16  - what a BF16 flash-attention kernel computes: Q, K, V rounded to bf16; S = QK^T in fp32;
//           online softmax over KV blocks in fp32; P rounded to bf16 for PV; fp32 accumulation;
//           output rounded to bf16.
//   FP8   - what fovea's FP8 kernel computes: Q, K, V quantized per tensor to E4M3 with the given
//           dequantization scales; S in fp32 times the descales; online softmax over KV blocks;
//           P quantized to E4M3 with the P scheme below; fp32 accumulation; bf16 output.
enum class RefMode { EXACT, BF16, FP8 };
const char* ref_mode_name(RefMode m);

// The P (softmax probabilities) quantization scheme of the FP8 kernel, emulated here.
// Choice (from FlashAttention-3's FP8 path; docs/fp8.md §P scheme):
//   - P is computed per KV block relative to the running row max, so p = exp(s - m) is in (0, 1];
//     it is multiplied by p_scale = 256 before the E4M3 cast (E4M3's top binade is [256, 448), so
//     p = 1 lands exactly on 256 and small p keep 3 mantissa bits down to 2^-6/256 = 2^-14 before
//     going subnormal). The 256 is divided out of the output once, at the end.
//   - The exponent argument is one FMA, s * scale - (m - log2 p_scale), s the raw score and m the
//     row max of the scaled scores; exp2 is the hardware's (the emulation's std::exp2 stands for it)
//     or, for the keys fovea/flash-p.h names, a degree-3 polynomial the emulation runs bit for bit.
//   - The row sum l is the sum of the E4M3 P the PV product multiplies by (fovea/flash-p.h: made by
//     the tensor cores), the normalizer consistent with the quantized P; at head_dim 80 it is the sum
//     of the fp32 p before the cast.
//   - KV blocks of block_n keys, aligned to the segment start, are visited last to first, so a large
//     early key (an attention sink, usually the first patch) sets the row max last and does not
//     flush the other blocks' P to zero in E4M3 before they are rescaled in fp32.
// The BF16 mode uses the same block walk with P rounded to bf16 and p_scale 1.
struct PScheme {
  float p_scale = 256.0f;
  int block_n = 128;
  bool reverse_kv = true;
};

// FP8 scales finer than one per tensor, and K smoothing (docs/fp8.md §Outlier channels). Each part
// is optional; an empty vector leaves RefOptions::fp8_scales' per-tensor value in force.
//   k_mean     [H * hd]: K is quantized as K - k_mean, per head and channel. Any vector shared by all
//              the keys a query sees moves that query's scores by one constant (q . k_mean), so the
//              softmax and the output are unchanged: exact, not an approximation.
//   q_head, k_head [H]: per-head dequantization scales of Q and of (smoothed) K; their product
//              multiplies the head's scores, so they commute with the kernel.
//   v_channel  [H * hd]: per-channel dequantization scales of V; scale c multiplies output column c.
//   rotate_qk  (research) Q and K are multiplied by one orthonormal hd x hd matrix (the DCT-II) before
//              quantization: q.k is unchanged, and a channel that dominates a head is spread over
//              all of them (the FlashAttention-3 paper's "incoherent processing").
//   qk_pair    (research) [H * hd/2]: per rotary pair p (channels p and p + hd/2, the two RoPE rotates
//              together), Q's pair is multiplied by qk_pair[p] and K's (after k_mean) by its
//              reciprocal before quantization. A rotation commutes with a scalar on its pair, so
//              every score is unchanged whatever the positions; powers of two keep it exact in fp32
//              too. Not with rotate_qk. (CPU emulation only: docs/fp8.md §Outlier channels measures
//              that it moves no error, E4M3 being floating point.)
//   qk_split   [H * fp8_split_pairs(hd)]: per head, the rotary pairs whose Q and K are split into two
//              E4M3 terms in the zero padding of the FP8 rows (fovea/scales.h §split pairs), -1 for
//              an unused slot; the kernels run it as it is (the padding is already in their QK^T).
//              Not with rotate_qk or qk_pair.
struct Fp8Fine {
  std::vector<float> k_mean, q_head, k_head, v_channel, qk_pair;
  std::vector<int32_t> qk_split;
  bool rotate_qk = false;
  bool empty() const {
    return k_mean.empty() && q_head.empty() && k_head.empty() && v_channel.empty() && qk_pair.empty() &&
           qk_split.empty() && !rotate_qk;
  }
};

// The robust scheme's arrays (a scale file's, or record_fine's for one batch) as the reference takes them.
inline Fp8Fine robust_fine(const FineScales& f) {
  Fp8Fine o;
  o.k_mean = f.k_mean, o.q_head = f.q_head, o.k_head = f.k_head, o.v_channel = f.v_channel, o.qk_split = f.qk_split;
  return o;
}

// Research: FP8 mode, for measurement only (`fovea bench attention --fp8-exact`): operands kept unquantized
// (x / scale in fp32, under the same scales and K smoothing; Q and K without their split pairs), to
// see what E4M3 costs in each of Q.K^T, V and P (docs/fp8.md §Outlier channels).
struct Fp8Exact {
  bool qk = false, v = false, p = false;
};

struct RefOptions {
  RefMode mode = RefMode::EXACT;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  QkvScales fp8_scales;        // FP8 mode: dequantization scales of Q, K, V
  Fp8Fine fp8_fine;            // FP8 mode: finer scales and K smoothing, where given
  Fp8Exact fp8_exact;          // FP8 mode: nothing by default
  PScheme p;
  int threads = 0;  // 0: all hardware threads
};

// Which parts of Fp8Fine a scheme uses.
struct Fp8FineParts {
  bool smooth_k = false, per_head_qk = false, per_channel_v = false, rotate_qk = false, smooth_qk_pairs = false;
  bool split_pairs = false;  // qk_split: pick_split_pairs from the batch's Q and K - k_mean
};
// The robust scheme as the kernels run it: K smoothing, per-head Q / K, per-channel V, split pairs.
constexpr Fp8FineParts kRobustParts = {true, true, true, false, false, true};
// One rotary pair's smoothing factor from the pair's amax in Q and in K: the power of two nearest
// sqrt(k_amax / q_amax) (SmoothQuant's migration strength 1/2: both sides end at sqrt(q_amax k_amax)),
// within [2^-kQkPairMaxLog2, 2^kQkPairMaxLog2]; 1 where either amax is 0.
constexpr int kQkPairMaxLog2 = 6;
float qk_pair_factor(float q_amax, float k_amax);
// The orthonormal DCT-II matrix of order n, row-major: row i is basis vector i.
std::vector<float> dct_matrix(int n);
// The fine scales dynamic scaling would use for this batch ("current scaling", like the per-tensor
// s = amax / 448 of a first forward): k_mean = K's mean over every token of the batch (one vector for
// all segments: exact, see Fp8Fine), then amax / 448 per head of Q and of K - k_mean, and per channel
// of V, each floored at kMinScale. With smooth_qk_pairs, qk_pair[p] = qk_pair_factor(amax of Q's
// pair p, amax of K's pair p after k_mean), and the per-head amaxes are those of the smoothed Q and
// K. With split_pairs (fp8_split_pairs(hd) a head), qk_split = pick_split_pairs of Q's amax
// and K - k_mean's per channel. Non-finite inputs throw, naming the tensor.
Fp8Fine current_fine_scales(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k,
                            ThdView<const float> v, Fp8FineParts parts);

// One forward's statistics for the robust scheme's history (ScaleBook::record_fine), as
// fine_stats_kernel computes them: K's sum (double), extremes and V's amax per (head, channel), Q's
// amax per channel. A non-finite value clears `finite` (its statistics are then not recorded).
FineBatch fine_batch(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v);

// out: contiguous [total_tokens, heads, head_dim]. In BF16/FP8 modes every value is a bf16 value.
void attention(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v,
               const RefOptions& opt, double* out);

}  // namespace cpu

// max |x| over a view (the per-tensor amax of dynamic scaling); non-finite values propagate (inf/NaN
// in -> non-finite out), so the scale book can ignore and count them.
float amax(const VarlenShape& shape, ThdView<const float> x);

}  // namespace fovea
