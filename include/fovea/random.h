// fovea/random.h: random test and benchmark inputs.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fovea {

enum class Dist {
  NORMAL,    // N(0, 1)
  OUTLIERS,  // N(0, 1) + N(0, 100) * Bernoulli(0.001): the FlashAttention-3 paper's outlier test
             // (N(0, 100) has variance 100, i.e. standard deviation 10)
};
const char* dist_name(Dist d);
std::optional<Dist> parse_dist(const std::string& s);

// n values from dist, deterministic for a given seed, rounded to bf16 when round_bf16 is set (as a
// bf16 qkv GEMM would produce them).
std::vector<float> random_values(int64_t n, Dist dist, uint64_t seed, bool round_bf16 = true);

}  // namespace fovea
