// fovea/bf16.h: bfloat16 rounding, host and device (the CPU reference's BF16 emulation, the GPU
// encoder's uploads): round-to-nearest-even, NaN -> canonical 0x7FFF as CUDA does. Agrees bit for bit with
// cuda_bf16.h's
// __float2bfloat16_rn on all 2^32 floats (tests/test-fp8-codec.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

#include "fovea/hd.h"
#include "fovea/threads.h"

namespace fovea {

FOVEA_HD uint16_t bf16_from_float(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;  // canonical NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
FOVEA_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }
FOVEA_HD float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

// Whole activations (tens of millions of values a batch) are converted on every core, in chunks of
// this many values: on one core the conversion costs more than the GPU forward.
inline constexpr int64_t kBf16ConvertGrain = 1 << 16;

// out[i] = bf16_from_float(v[i]) for i < count, on every core.
inline void to_bf16(const float* v, size_t count, uint16_t* out) {
  parallel_ranges(int64_t(count), kBf16ConvertGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = bf16_from_float(v[i]);
  });
}

}  // namespace fovea
