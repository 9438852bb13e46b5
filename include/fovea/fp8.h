// fovea/fp8.h: the OCP FP8 E4M3 ("e4m3fn") codec, host and device (docs/fp8.md §E4M3 codec).
//
// E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa bits. Max finite 448 (0x7E), no infinities,
// NaN = 0x7F / 0xFF. Smallest normal 2^-6, smallest subnormal 2^-9.
// Encoding is round-to-nearest-even with saturation to ±448 (CUDA's __NV_SATFINITE): every finite
// float above 448 in magnitude, and ±inf, become ±448; NaN becomes 0x7F (canonical, sign dropped),
// exactly as cuda_fp8.h's host conversion. tests/test-fp8-codec.cpp proves bit-exact agreement on
// all 2^32 floats; tests/gpu/test-fp8-device.cu does the same against the hardware cvt on the GPU.
#pragma once
#include <cstdint>

#include "fovea/hd.h"

namespace fovea {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;

FOVEA_HD uint8_t e4m3_from_float(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;                // NaN
  if (a >= 0x43E00000u) return uint8_t(sign | 0x7Eu);  // |x| >= 448 (incl. inf): saturate
  const int e = int(a >> 23) - 127;                    // unbiased exponent (-127 for float denormals)
  uint32_t code;
  if (e >= -6) {
    // Normal range of E4M3: rebias the exponent (127 -> 7) and round the mantissa 23 -> 3 bits.
    // A mantissa carry rolls into the exponent, which is the right result; it cannot pass 448
    // because everything >= 448 was saturated above.
    code = rne_shift_right(a - ((127u - 7u) << 23), 20);
  } else if (e >= -11) {
    // Subnormal range: the value in units of 2^-9 is mant * 2^(e - 23 + 9); rounding can give 8,
    // which is the code of the smallest normal (2^-6), so the carry is again right.
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    code = rne_shift_right(mant, 14 - e);
  } else {
    code = 0;  // below 2^-11 (a quarter of the smallest subnormal): rounds to zero
  }
  return uint8_t(sign | code);
}

FOVEA_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t mant = c & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return bits_float(sign | 0x7FC00000u);  // NaN
  if (exp == 0) {
    const float v = float(mant) * (1.0f / 512.0f);  // subnormal: mant * 2^-9, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 127u - 7u) << 23) | (mant << 20));
}

// Quantize with a per-tensor dequantization scale s (docs/fp8.md §Quantization): x8 = sat(rne(x / s)).
// Division, not multiplication by a reciprocal, so the result is the correctly rounded x / s.
FOVEA_HD uint8_t e4m3_quantize(float x, float s) { return e4m3_from_float(x / s); }

// x / s, correctly rounded like the division, from r = 1 / s (correctly rounded) with two FMAs
// (Markstein's correction): a divisor that changes per element (the robust scheme's per-channel V
// scales) then costs one reciprocal per channel instead of a division per element. Where the
// correction's residual could leave the normal range (x or the quotient below 2^-100 in magnitude,
// the quotient from 2^100) it divides. Checked against the division on random and edge operands
// (test-fp8-codec; 115 million random pairs in that range agreed).
FOVEA_HD float div_by_reciprocal(float x, float s, float r) {
#ifdef __CUDA_ARCH__
  const float q0 = __fmul_rn(x, r), aq = fabsf(q0);
  if (aq < 0x1p100f && aq >= 0x1p-100f && fabsf(x) >= 0x1p-100f) return __fmaf_rn(__fmaf_rn(-q0, s, x), r, q0);
  return __fdiv_rn(x, s);
#else
  const float q0 = x * r, aq = q0 < 0 ? -q0 : q0, ax = x < 0 ? -x : x;
  if (aq < 0x1p100f && aq >= 0x1p-100f && ax >= 0x1p-100f) return __builtin_fmaf(__builtin_fmaf(-q0, s, x), r, q0);
  return x / s;
#endif
}

// The dequantization scale of one row (a token's activations, or one output channel's weights) in
// the FP8 linears (docs/fp8.md §FP8 linears): amax / 448, so the row's largest value maps to 448;
// 1 for an all-zero row. A NaN amax gives 1 (the NaN itself quantizes to NaN and propagates), an
// infinite one inf (every finite value then quantizes to 0, the infinity to NaN).
FOVEA_HD float e4m3_row_scale(float amax) { return amax > 0.f ? amax / kE4M3Max : 1.f; }

}  // namespace fovea
