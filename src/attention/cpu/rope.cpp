// Host 2D vision RoPE: tables for tests/benchmarks and the rotation the GPU prepare step mirrors.
#include "fovea/rope.h"

#include <cmath>

#include "fovea/error.h"

namespace fovea {

void rope_tables_grid(const VarlenShape& shape, std::vector<float>& cos, std::vector<float>& sin) {
  const int hd = shape.head_dim, half = hd / 2, quarter = hd / 4;
  if (hd % 4 != 0) fail("rope: head_dim {} is not a multiple of 4", hd);
  cos.assign(size_t(shape.total_tokens()) * half, 0.f);
  sin.assign(cos.size(), 0.f);
  for (int s = 0; s < shape.num_segments(); ++s) {
    const int begin = shape.cu_seqlens[size_t(s)], len = shape.cu_seqlens[size_t(s) + 1] - begin;
    const int cols = std::max(1, int(std::sqrt(double(len))));
    for (int i = 0; i < len; ++i)
      for (int d = 0; d < half; ++d) {
        const double inv_freq = std::pow(10000.0, -2.0 * (d % quarter) / double(half));
        const float angle = float((d < quarter ? i / cols : i % cols) * inv_freq);
        cos[size_t(begin + i) * half + d] = std::cos(angle);
        sin[size_t(begin + i) * half + d] = std::sin(angle);
      }
  }
}

void apply_rope_qk(const VarlenShape& shape, const std::vector<float>& cos, const std::vector<float>& sin,
                   std::vector<float>& qkv) {
  const int64_t H = shape.heads, hd = shape.head_dim, half = hd / 2;
  for (int64_t t = 0; t < shape.total_tokens(); ++t)
    for (int w = 0; w < 2; ++w)
      for (int64_t h = 0; h < H; ++h) {
        float* x = qkv.data() + ((t * 3 + w) * H + h) * hd;
        const float* c = cos.data() + t * half;
        const float* s = sin.data() + t * half;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = x[d], x2 = x[d + half];
          const float a = x1 * c[d], b = x2 * s[d], e = x2 * c[d], f = x1 * s[d];  // separate roundings
          x[d] = a - b;
          x[d + half] = e + f;
        }
      }
}

}  // namespace fovea
