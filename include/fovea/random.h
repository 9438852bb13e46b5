// fovea/random.h: random test and benchmark inputs.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fovea {

enum class Dist {
  NORMAL,        // N(0, 1)
  OUTLIERS,      // N(0, 1) + N(0, 100) * Bernoulli(0.001): the FlashAttention-3 paper's outlier test
                 // (N(0, 100) has variance 100, i.e. standard deviation 10)
  CHANNELS,      // N(0, 1) with outlier channels, as trained vision transformers have them ("massive
                 // activations"): per head, 2 channels of Q and K carry a large offset (20-50, either
                 // sign; K's also varies, N(0, 4)) and 2 channels of V are scaled by 20-50. Needs the
                 // [tokens, 3, heads, head_dim] structure: random_qkv.
  KEY_CHANNELS,  // as CHANNELS, but Q's and K's outliers apart, as in trained ViTs where K carries the
                 // larger ones: per head, 3 channels of K offset by 20-50 (N(0, 4) around it), one
                 // other channel of Q offset by 10-20, 2 channels of V scaled by 20-50. random_qkv.
};
const char* dist_name(Dist d);
std::optional<Dist> parse_dist(const std::string& s);

// n values from dist, deterministic for a given seed, rounded to bf16 when round_bf16 is set (as a
// bf16 qkv GEMM would produce them).
// NORMAL and OUTLIERS only (the channel kinds need random_qkv); throws fovea::Error for those.
std::vector<float> random_values(int64_t n, Dist dist, uint64_t seed, bool round_bf16 = true);

// A fused qkv [tokens, 3, heads, head_dim] tensor from dist (any of them), bf16-rounded.
std::vector<float> random_qkv(int64_t tokens, int heads, int head_dim, Dist dist, uint64_t seed);

}  // namespace fovea
