// fovea/flash-p.h: how the FP8 flash kernel forms P and its row sums where that differs from plain
// fp32 math, host and device, so that the CPU emulation (cpu::attention's FP8 mode) runs the same
// operations in the same order and rounds as the kernel does (docs/kernels.md §How P is formed).
#pragma once
#include <cmath>
#include <cstdint>

#include "fovea/hd.h"

namespace fovea {

// 2^x: j = round(x) (the 1.5 * 2^23 add leaves it in the sum's low mantissa bits), f = x - j in
// [-0.5, 0.5] exactly, 2^f by a degree-3 minimax polynomial (relative error 7.5e-5 in fp32, against
// E4M3's half step of 2^-4: P's cast rounds as if the exponential were exact except within 7.5e-5
// of a rounding boundary), times 2^j added into the exponent field. x is clamped at -120 first, so
// -inf (a masked key) gives 2^-120, which P's E4M3 cast rounds to zero; x above 127 is not handled
// (the kernel's arguments are at most log2(p_scale) = 8). 8 instructions: FMNMX, 3 FADD, 3 FFMA,
// one integer shift-add.
FOVEA_HD float exp2_poly3(float x) {
  x = fmaxf(x, -120.0f);
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float t = x + magic;
  const float j = t - magic;
  const float f = x - j;
  float p = fmaf(0.0551716685f, f, 0.242611125f);
  p = fmaf(p, f, 0.693260968f);
  p = fmaf(p, f, 0.999928057f);
  return bits_float(float_bits(p) + (float_bits(t) << 23));
}

// Which of the 16 column pairs of a 128-key block (keys 8j .. 8j+7 of the block for bit j; in the
// kernel a thread's pair j of a row is keys 8j + 2t and 8j + 2t + 1) take exp2_poly3 in the FP8
// kernels; the other keys use the MUFU's ex2.approx. The CPU emulation uses the same mask.
#ifndef FOVEA_FP8_POLY_EXP_PAIRS
#define FOVEA_FP8_POLY_EXP_PAIRS 0x0000u
#endif
constexpr uint32_t fp8_poly_exp_pairs(int head_dim) { return head_dim <= 80 ? FOVEA_FP8_POLY_EXP_PAIRS : 0u; }

// The FP8 row sum l: true: the sum of the E4M3 P the PV product uses, made by the tensor cores (V^T
// carries 8 rows of ones, so P V's last 8 columns are the row's sum) and folded into l as O is (one
// FMA a block); false: the sum of the fp32 P before the cast, on the FMA pipe. Not at head_dim 80:
// its 3-warpgroup kernel has no room in 160 registers for 8 more accumulator columns (it spills).
#ifndef FOVEA_FP8_TC_ROW_SUM
#define FOVEA_FP8_TC_ROW_SUM 1
#endif
constexpr bool fp8_tensor_row_sum(int head_dim) {
  return FOVEA_FP8_TC_ROW_SUM && (head_dim + 8 <= 80 || head_dim > 80);
}

}  // namespace fovea
