// fovea/bf16.h: bfloat16 rounding, host and device, for the CPU reference's BF16 emulation:
// round-to-nearest-even, NaN -> canonical 0x7FFF as CUDA does. Agrees bit for bit with cuda_bf16.h's
// __float2bfloat16_rn on all 2^32 floats (tests/test-fp8-codec.cpp).
#pragma once
#include <cstdint>

#include "fovea/hd.h"

namespace fovea {

FOVEA_HD uint16_t bf16_from_float(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;  // canonical NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
FOVEA_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }
FOVEA_HD float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

}  // namespace fovea
