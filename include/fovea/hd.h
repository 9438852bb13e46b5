// fovea/hd.h: host/device qualifiers and bit casts shared by code that runs on both sides.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FOVEA_HD __host__ __device__ __forceinline__
#else
#define FOVEA_HD inline
#endif

namespace fovea {

FOVEA_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
FOVEA_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Round-to-nearest-even right shift of an unsigned integer by s bits (1 <= s <= 31).
FOVEA_HD uint32_t rne_shift_right(uint32_t x, int s) {
  const uint32_t q = x >> s;
  const uint32_t rem = x & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

}  // namespace fovea
