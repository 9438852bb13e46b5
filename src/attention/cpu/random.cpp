// Random inputs for tests and benchmarks (normal, and the FA3 paper's outlier distribution).
#include "fovea/random.h"

#include <algorithm>
#include <random>

#include "fovea/bf16.h"
#include "fovea/error.h"

namespace fovea {

const char* dist_name(Dist d) {
  switch (d) {
    case Dist::NORMAL: return "normal";
    case Dist::OUTLIERS: return "outliers";
    case Dist::CHANNELS: return "channels";
    case Dist::KEY_CHANNELS: return "key-channels";
  }
  return "?";
}

std::optional<Dist> parse_dist(const std::string& s) {
  for (Dist d : {Dist::NORMAL, Dist::OUTLIERS, Dist::CHANNELS, Dist::KEY_CHANNELS})
    if (s == dist_name(d)) return d;
  return std::nullopt;
}

std::vector<float> random_values(int64_t n, Dist dist, uint64_t seed, bool round_bf16) {
  if (dist == Dist::CHANNELS || dist == Dist::KEY_CHANNELS)
    fail("random_values: the {} distribution needs random_qkv's layout", dist_name(dist));
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

namespace {

// Dist::KEY_CHANNELS: per head, 3 channels of K offset by 20-50, one other channel of Q by 10-20, 2 of
// V scaled by 20-50 (distinct channels where head_dim allows).
std::vector<float> key_channel_qkv(int64_t tokens, int heads, int head_dim, uint64_t seed) {
  const int64_t row = 3 * int64_t(heads) * head_dim, hd_all = int64_t(heads) * head_dim;
  std::vector<float> out = random_values(tokens * row, Dist::NORMAL, seed, false);
  std::mt19937_64 rng(seed ^ 0x6b65796368u);
  std::uniform_real_distribution<float> k_size(20.0f, 50.0f), q_size(10.0f, 20.0f);
  std::uniform_int_distribution<int> channel(0, head_dim - 1);
  auto sign = [&] { return rng() & 1 ? 1.0f : -1.0f; };
  struct Shift {
    int64_t offset;
    float by;
  };
  std::vector<Shift> k, q, v;
  for (int h = 0; h < heads; ++h) {
    std::vector<int> used;
    auto fresh = [&] {  // a channel of this head not drawn yet (any, once all are)
      int c = channel(rng);
      for (int tries = 0; tries < 64 && std::find(used.begin(), used.end(), c) != used.end(); ++tries) c = channel(rng);
      used.push_back(c);
      return int64_t(h) * head_dim + c;
    };
    for (int i = 0; i < 3; ++i) k.push_back({fresh(), sign() * k_size(rng)});
    q.push_back({fresh(), sign() * q_size(rng)});
    for (int i = 0; i < 2; ++i) v.push_back({int64_t(h) * head_dim + channel(rng), k_size(rng)});
  }
  for (int64_t t = 0; t < tokens; ++t) {
    float* r = out.data() + t * row;
    for (const Shift& s : k) r[hd_all + s.offset] = r[hd_all + s.offset] * 2.0f + s.by;
    for (const Shift& s : q) r[s.offset] += s.by;
    for (const Shift& s : v) r[2 * hd_all + s.offset] *= s.by;
  }
  for (auto& x : out) x = bf16_round(x);
  return out;
}

}  // namespace

std::vector<float> random_qkv(int64_t tokens, int heads, int head_dim, Dist dist, uint64_t seed) {
  const int64_t row = 3 * int64_t(heads) * head_dim;
  if (dist == Dist::KEY_CHANNELS) return key_channel_qkv(tokens, heads, head_dim, seed);
  if (dist != Dist::CHANNELS) return random_values(tokens * row, dist, seed);
  std::vector<float> out = random_values(tokens * row, Dist::NORMAL, seed, false);
  std::mt19937_64 rng(seed ^ 0x5eedc4a2u);
  std::uniform_real_distribution<float> size(20.0f, 50.0f);
  std::uniform_int_distribution<int> channel(0, head_dim - 1);
  struct Outlier {
    int64_t offset;  // in a token's row
    float q_offset, k_offset, v_factor;
  };
  std::vector<Outlier> qk, v;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < 2; ++i) {
      const int64_t base = int64_t(h) * head_dim;
      auto sign = [&] { return rng() & 1 ? 1.0f : -1.0f; };
      qk.push_back({base + channel(rng), sign() * size(rng), sign() * size(rng), 0.0f});
      v.push_back({base + channel(rng), 0.0f, 0.0f, size(rng)});
    }
  const int64_t hd_all = int64_t(heads) * head_dim;
  for (int64_t t = 0; t < tokens; ++t) {
    float* r = out.data() + t * row;
    for (const Outlier& o : qk) {
      r[o.offset] += o.q_offset;
      r[hd_all + o.offset] = r[hd_all + o.offset] * 2.0f + o.k_offset;  // N(0, 4) around the offset
    }
    for (const Outlier& o : v) r[2 * hd_all + o.offset] *= o.v_factor;
  }
  for (auto& x : out) x = bf16_round(x);
  return out;
}

}  // namespace fovea
