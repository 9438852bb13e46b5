// Random inputs for tests and benchmarks (normal, and the FA3 paper's outlier distribution).
#include "fovea/random.h"

#include <random>

#include "fovea/bf16.h"

namespace fovea {

const char* dist_name(Dist d) { return d == Dist::NORMAL ? "normal" : "outliers"; }

std::optional<Dist> parse_dist(const std::string& s) {
  if (s == "normal") return Dist::NORMAL;
  if (s == "outliers") return Dist::OUTLIERS;
  return std::nullopt;
}

std::vector<float> random_values(int64_t n, Dist dist, uint64_t seed, bool round_bf16) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::normal_distribution<float> outlier(0.0f, 10.0f);
  std::bernoulli_distribution rare(0.001);
  std::vector<float> out(size_t(n > 0 ? n : 0));
  for (auto& x : out) {
    x = normal(rng);
    if (dist == Dist::OUTLIERS && rare(rng)) x += outlier(rng);
    if (round_bf16) x = bf16_round(x);
  }
  return out;
}

}  // namespace fovea
