// The CPU reference attention: exact mode against closed-form cases, the varlen packing (segments are
// independent, strided views), and the BF16/FP8 emulations (rounding, scales, P scheme, error size).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "fovea/attention.h"
#include "fovea/attention-ref.h"
#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/flash-p.h"
#include "fovea/fp8.h"
#include "fovea/random.h"
#include "fovea/rope.h"
#include "attention/cuda/tile-plan.h"
#include "test-util.h"

using namespace fovea;
using cpu::RefMode;
using fovea::test::fresh_seed;
using test::error_of;

namespace {

// Q, K, V in one fused [N, 3, H, hd] buffer, as the encoder's qkv GEMM writes them.
struct Qkv {
  VarlenShape shape;
  std::vector<float> data;
  ThdView<const float> view(int i) const {
    const int64_t H = shape.heads, hd = shape.head_dim;
    return {data.data() + i * H * hd, 3 * H * hd, hd};
  }
  float& at(int i, int64_t t, int h, int d) {
    return data[size_t(((t * 3 + i) * shape.heads + h) * shape.head_dim + d)];
  }
  std::vector<double> run(const cpu::RefOptions& o) const {
    std::vector<double> out(size_t(shape.total_tokens() * shape.heads * shape.head_dim), -12345.0);  // poison
    cpu::attention(shape, view(0), view(1), view(2), o, out.data());
    return out;
  }
};

Qkv random_qkv(const std::vector<int>& seqlens, int heads, int hd, uint64_t seed, Dist dist = Dist::NORMAL) {
  Qkv x;
  x.shape = varlen_from_seqlens(seqlens, heads, hd);
  x.data = fovea::random_qkv(x.shape.total_tokens(), heads, hd, dist, seed);
  return x;
}

cpu::RefOptions mode(RefMode m, const Qkv& x = {}) {
  cpu::RefOptions o;
  o.mode = m;
  if (m == RefMode::FP8) {
    o.fp8_scales = {amax(x.shape, x.view(0)) / kE4M3Max, amax(x.shape, x.view(1)) / kE4M3Max,
                    amax(x.shape, x.view(2)) / kE4M3Max};
  }
  return o;
}

}  // namespace

TEST(AttentionRef, SingleTokenSegmentReturnsV) {
  Qkv x = random_qkv({1, 5, 1}, 3, 8, fresh_seed());
  for (RefMode m : {RefMode::EXACT, RefMode::BF16, RefMode::FP8}) {
    const auto out = x.run(mode(m, x));
    for (int64_t t : {0, 6})
      for (int h = 0; h < 3; ++h)
        for (int d = 0; d < 8; ++d) {
          const float v = x.at(2, t, h, d);
          const cpu::RefOptions o = mode(m, x);
          const double want = m == RefMode::EXACT ? v
                              : m == RefMode::BF16
                                  ? bf16_round(v)
                                  : bf16_round(e4m3_to_float(e4m3_quantize(v, o.fp8_scales.v)) * o.fp8_scales.v);
          EXPECT_EQ(out[size_t((t * 3 + h) * 8 + d)], want) << cpu::ref_mode_name(m) << " token " << t;
        }
  }
}

TEST(AttentionRef, ExactMatchesClosedForms) {
  // One segment of 3 keys, hd 2, one head: weights are softmax(q.k / sqrt(2)).
  Qkv x;
  x.shape = varlen_from_seqlens({3}, 1, 2);
  x.data.assign(3 * 3 * 2, 0.0f);
  const float qv[2] = {1.0f, 2.0f}, ks[3][2] = {{1, 0}, {0, 1}, {-1, 1}}, vs[3][2] = {{1, 2}, {3, -4}, {0.5f, 8}};
  for (int t = 0; t < 3; ++t)
    for (int d = 0; d < 2; ++d) {
      x.at(0, t, 0, d) = qv[d];
      x.at(1, t, 0, d) = ks[t][d];
      x.at(2, t, 0, d) = vs[t][d];
    }
  const auto out = x.run(mode(RefMode::EXACT));
  double w[3], sum = 0;
  for (int j = 0; j < 3; ++j) sum += w[j] = std::exp((qv[0] * ks[j][0] + qv[1] * ks[j][1]) / std::sqrt(2.0));
  for (int t = 0; t < 3; ++t)
    for (int d = 0; d < 2; ++d) {
      double want = 0;
      for (int j = 0; j < 3; ++j) want += w[j] / sum * vs[j][d];
      EXPECT_NEAR(out[size_t(t * 2 + d)], want, 1e-12);
    }

  // Identical keys: uniform weights, the output is the mean of V, whatever q is.
  Qkv y = random_qkv({300}, 2, 16, fresh_seed());
  for (int t = 0; t < 300; ++t)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 16; ++d) y.at(1, t, h, d) = y.at(1, 0, h, d);
  const auto out2 = y.run(mode(RefMode::EXACT));
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < 16; ++d) {
      double mean = 0;
      for (int t = 0; t < 300; ++t) mean += y.at(2, t, h, d);
      mean /= 300;
      for (int t : {0, 151, 299}) EXPECT_NEAR(out2[size_t((t * 2 + h) * 16 + d)], mean, 1e-12);
    }
}

TEST(AttentionRef, SegmentsAreIndependentAndMatchSeparateRuns) {
  const std::vector<int> lens = {1, 7, 64, 127, 128, 129, 300};
  Qkv x = random_qkv(lens, 2, 24, fresh_seed());
  for (RefMode m : {RefMode::EXACT, RefMode::BF16, RefMode::FP8}) {
    const cpu::RefOptions o = mode(m, x);
    const auto packed = x.run(o);
    // Each segment alone, with the same scales, gives bit-identical rows.
    for (size_t s = 0; s < lens.size(); ++s) {
      Qkv one;
      one.shape = varlen_from_seqlens({lens[s]}, 2, 24);
      const int64_t row = 3 * 2 * 24, b = x.shape.cu_seqlens[s];
      one.data.assign(x.data.begin() + b * row, x.data.begin() + (b + lens[s]) * row);
      const auto alone = one.run(o);
      for (size_t i = 0; i < alone.size(); ++i)
        ASSERT_EQ(alone[i], packed[size_t(b * 2 * 24) + i]) << cpu::ref_mode_name(m) << " segment " << s;
    }
  }
}

TEST(AttentionRef, KeyOrderDoesNotMatterForExact) {
  Qkv x = random_qkv({257}, 1, 32, fresh_seed());
  const auto out = x.run(mode(RefMode::EXACT));
  Qkv y = x;  // reverse the keys and values (queries stay)
  for (int t = 0; t < 257; ++t)
    for (int d = 0; d < 32; ++d) {
      y.at(1, t, 0, d) = x.at(1, 256 - t, 0, d);
      y.at(2, t, 0, d) = x.at(2, 256 - t, 0, d);
    }
  const auto out2 = y.run(mode(RefMode::EXACT));
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], out2[i], 1e-12);
}

TEST(AttentionRef, StridedViewsEqualContiguousCopies) {
  Qkv x = random_qkv({33, 70}, 3, 40, fresh_seed());
  const int64_t N = x.shape.total_tokens(), H = 3, hd = 40;
  std::vector<float> planes[3];
  for (int i = 0; i < 3; ++i) {
    planes[i].resize(size_t(N * H * hd));
    for (int64_t t = 0; t < N; ++t)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < hd; ++d) planes[i][size_t((t * H + h) * hd + d)] = x.at(i, t, h, d);
  }
  for (RefMode m : {RefMode::EXACT, RefMode::FP8}) {
    const cpu::RefOptions o = mode(m, x);
    const auto fused = x.run(o);
    std::vector<double> out(fused.size());
    auto v = [&](int i) { return ThdView<const float>{planes[i].data(), H * hd, hd}; };
    cpu::attention(x.shape, v(0), v(1), v(2), o, out.data());
    EXPECT_EQ(out, fused) << cpu::ref_mode_name(m);
  }
}

// The measured error of the emulations against fp64 sits where bf16 and E4M3 rounding put it; these
// bounds fail if rounding were skipped (error ~0) or misapplied (error >> the format's precision).
TEST(AttentionRef, EmulationErrorsHaveTheFormatsSize) {
  for (Dist dist : {Dist::NORMAL, Dist::OUTLIERS}) {
    Qkv x = random_qkv({1, 7, 64, 127, 128, 129, 1000}, 2, 72, fresh_seed(), dist);
    const auto ref = x.run(mode(RefMode::EXACT));
    const auto bf = x.run(mode(RefMode::BF16));
    const auto f8 = x.run(mode(RefMode::FP8, x));
    const ErrorStats eb = compare(bf.data(), ref.data(), int64_t(ref.size()));
    const ErrorStats e8 = compare(f8.data(), ref.data(), int64_t(ref.size()));
    std::printf("%s: bf16 rel_l2 %.3e max %.3e | fp8 rel_l2 %.3e max %.3e\n", dist_name(dist), eb.rel_l2, eb.max_abs,
                e8.rel_l2, e8.max_abs);
    EXPECT_EQ(eb.nonfinite, 0);
    EXPECT_EQ(e8.nonfinite, 0);
    EXPECT_GT(eb.rel_l2, 2e-4);  // bf16 output rounding alone is ~1e-3 relative
    EXPECT_LT(eb.rel_l2, 8e-3);
    EXPECT_GT(e8.rel_l2, 4 * eb.rel_l2);  // E4M3 keeps 3 mantissa bits to bf16's 7
    // Per-tensor E4M3: ~5e-2 on N(0,1); outliers move the logits they enter (measured 0.08-0.10
    // over random seeds, bench/RESULTS.md), so their bound is looser.
    EXPECT_LT(e8.rel_l2, dist == Dist::NORMAL ? 0.08 : 0.2);
    for (double v : bf) EXPECT_EQ(v, double(bf16_round(float(v))));  // outputs are bf16 values
    for (double v : f8) ASSERT_EQ(v, double(bf16_round(float(v))));
  }
}

// FP8 mode against a hand computation of the scheme documented in attention.h on one block.
TEST(AttentionRef, Fp8FollowsTheDocumentedScheme) {
  Qkv x = random_qkv({5}, 1, 4, fresh_seed());
  cpu::RefOptions o = mode(RefMode::FP8, x);
  o.fp8_scales = {o.fp8_scales.q * 1.3f, o.fp8_scales.k * 0.9f, o.fp8_scales.v * 1.1f};  // arbitrary, some saturate
  const auto out = x.run(o);
  auto deq = [&](int i, int t, int d) { return e4m3_to_float(e4m3_quantize(x.at(i, t, 0, d), o.fp8_scales[i])); };
  const float c = float(0.5 * M_LOG2E * double(o.fp8_scales.q) * double(o.fp8_scales.k));  // 1/sqrt(4) = 0.5
  // fovea/flash-p.h: which keys take the polynomial (all 5 are in column pair 0), which P l sums.
  const bool poly = fp8_poly_exp_pairs(4) & 1u;
  for (int i = 0; i < 5; ++i) {
    float s[5], m = -INFINITY, l = 0, acc[4] = {0, 0, 0, 0};
    for (int j = 0; j < 5; ++j) {
      s[j] = 0;
      for (int d = 0; d < 4; ++d) s[j] += deq(0, i, d) * deq(1, j, d);
      m = std::max(m, s[j]);
    }
    m *= c;  // the row max of the raw scores, then scaled
    for (int j = 0; j < 5; ++j) {
      const float arg = std::fma(s[j], c, -(m - 8.0f));  // P = 2^8 exp2(s c - m): one FMA
      const float p = poly ? exp2_poly3(arg) : std::exp2(arg);
      const float p8 = e4m3_to_float(e4m3_from_float(p));
      l += fp8_tensor_row_sum(4) ? p8 : p;
      for (int d = 0; d < 4; ++d) acc[d] += p8 * deq(2, j, d);
    }
    for (int d = 0; d < 4; ++d)
      EXPECT_EQ(out[size_t(i * 4 + d)], bf16_round(acc[d] * (o.fp8_scales.v / l))) << i << "," << d;
  }
}

// The FMA-pipe exponential: within its stated error of exp2 over the kernel's argument range, the
// same E4M3 P almost everywhere, -inf (a masked key) to a positive value E4M3 rounds to zero.
TEST(FlashP, PolynomialExp2IsAccurateAndClamped) {
  double worst = 0;
  int64_t n = 0, cast_differs = 0;
  for (float x = -40.0f; x <= 8.5f; x += 1.0f / 4096 + 1e-7f) {
    const float p = exp2_poly3(x);
    const double ref = std::exp2(double(x));
    worst = std::max(worst, std::fabs(double(p) - ref) / ref);
    cast_differs += e4m3_from_float(p) != e4m3_from_float(float(ref));
    ++n;
  }
  EXPECT_LT(worst, 7.6e-5);
  EXPECT_GT(worst, 7.0e-5);  // the minimax error is reached: the coefficients are the fitted ones
  EXPECT_LT(double(cast_differs) / double(n), 2e-3) << cast_differs << " of " << n;
  EXPECT_EQ(exp2_poly3(0.0f), 0.999928057f);
  EXPECT_EQ(exp2_poly3(3.0f), 8 * 0.999928057f);  // integers: 2^j c0 exactly
  for (float x : {-INFINITY, -1000.0f, -120.0f}) {
    EXPECT_GT(exp2_poly3(x), 0.0f);
    EXPECT_LT(exp2_poly3(x), std::ldexp(1.0f, -119));
    EXPECT_EQ(e4m3_from_float(exp2_poly3(x)), 0);
  }
}

TEST(AttentionRef, BlockOrderAndSizeChangeOnlyRounding) {
  Qkv x = random_qkv({1000}, 1, 64, fresh_seed());
  const auto ref = x.run(mode(RefMode::EXACT));
  cpu::RefOptions a = mode(RefMode::FP8, x), b = a;
  b.p.reverse_kv = false;
  b.p.block_n = 64;
  const auto oa = x.run(a), ob = x.run(b);
  EXPECT_NE(oa, ob);  // the walk is really per block
  const double ea = compare(oa.data(), ref.data(), int64_t(ref.size())).rel_l2;
  const double eb = compare(ob.data(), ref.data(), int64_t(ref.size())).rel_l2;
  EXPECT_LT(std::fabs(ea - eb), 0.25 * ea);
}

TEST(AttentionRef, ScalesAreApplied) {
  Qkv x = random_qkv({200}, 1, 32, fresh_seed());
  const auto ref = x.run(mode(RefMode::EXACT));
  cpu::RefOptions good = mode(RefMode::FP8, x), saturating = good, coarse = good;
  for (float* s : {&saturating.fp8_scales.q, &saturating.fp8_scales.k, &saturating.fp8_scales.v}) *s /= 20;
  for (float* s : {&coarse.fp8_scales.q, &coarse.fp8_scales.k, &coarse.fp8_scales.v})
    *s *= 1e5f;  // amax maps to 0.0045: all subnormal
  const double e_good = compare(x.run(good).data(), ref.data(), int64_t(ref.size())).rel_l2;
  const double e_sat = compare(x.run(saturating).data(), ref.data(), int64_t(ref.size())).rel_l2;
  const double e_coarse = compare(x.run(coarse).data(), ref.data(), int64_t(ref.size())).rel_l2;
  EXPECT_LT(e_good, 0.1);
  EXPECT_GT(e_sat, 3 * e_good);     // values clipped at 448 x s
  EXPECT_GT(e_coarse, 3 * e_good);  // values pushed into E4M3's subnormals
}

TEST(AttentionRef, NanStaysInItsSegment) {
  Qkv x = random_qkv({50, 60}, 2, 16, fresh_seed());
  x.at(1, 70, 1, 3) = NAN;  // a key of segment 1, head 1
  for (RefMode m : {RefMode::EXACT, RefMode::BF16}) {
    const auto out = x.run(mode(m, x));
    for (int64_t t = 0; t < 110; ++t)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 16; ++d) {
          const double v = out[size_t((t * 2 + h) * 16 + d)];
          if (t >= 50 && h == 1)
            EXPECT_TRUE(std::isnan(v));
          else
            ASSERT_TRUE(std::isfinite(v)) << t << "," << h;
        }
  }
  EXPECT_TRUE(std::isinf(amax(x.shape, x.view(1))));  // the scale book then ignores and counts it
}

TEST(AttentionRef, AmaxIsTheLargestAbsoluteValue) {
  Qkv x = random_qkv({10, 3}, 2, 8, fresh_seed());
  x.at(2, 11, 1, 5) = -1000.0f;  // negative: amax is |x|, unlike vLLM's signed max
  x.at(0, 11, 1, 5) = 999.0f;    // a Q value: must not leak into V's amax
  EXPECT_EQ(amax(x.shape, x.view(2)), 1000.0f);
}

TEST(AttentionRef, ValidatesItsInputs) {
  Qkv x = random_qkv({4}, 1, 8, fresh_seed());
  std::vector<double> out(32);
  auto run = [&](VarlenShape s, cpu::RefOptions o) {
    cpu::attention(s, x.view(0), x.view(1), x.view(2), o, out.data());
  };
  auto msg = [&](VarlenShape s, cpu::RefOptions o) -> std::string {
    try {
      run(s, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  VarlenShape s = x.shape;
  s.cu_seqlens = {1, 4};
  EXPECT_NE(msg(s, {}).find("cu_seqlens[0] must be 0"), std::string::npos);
  s.cu_seqlens = {0, 2, 2, 4};
  EXPECT_NE(msg(s, {}).find("segment 1 is empty"), std::string::npos);
  s = x.shape;
  s.heads = 0;
  EXPECT_NE(msg(s, {}).find("heads must be > 0"), std::string::npos);
  cpu::RefOptions o = mode(RefMode::FP8, x);
  o.fp8_scales.k = 0;
  EXPECT_NE(msg(x.shape, o).find("FP8 k scale"), std::string::npos);
  EXPECT_THROW(varlen_from_seqlens({3, 0}, 1, 8), Error);
}

TEST(AttentionRef, CompareCountsNonFinite) {
  const double ref[4] = {1, 2, 3, 4};
  const double out[4] = {1, 2, 3, 5};
  const ErrorStats e = compare(out, ref, 4);
  EXPECT_DOUBLE_EQ(e.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(e.rel_l2, 1.0 / std::sqrt(30.0));
  const double bad[4] = {1, NAN, 3, 4};
  const ErrorStats n = compare(bad, ref, 4);
  EXPECT_EQ(n.nonfinite, 1);
  EXPECT_TRUE(std::isnan(n.rel_l2));  // NaN never passes a `rel_l2 < tol` check
}

TEST(Rope, TablesFollowTheSpecAndRotationKeepsPairNorms) {
  const VarlenShape sh = varlen_from_seqlens({10, 7}, 2, 8);  // segment 0: 3 columns; segment 1: 2
  std::vector<float> cos, sin;
  rope_tables_grid(sh, cos, sin);
  // Token 5 of segment 0 sits at row 1, column 2; hd 8 has inv_freq {1, 10000^-0.5}.
  const int t = 5, half = 4;
  EXPECT_FLOAT_EQ(cos[t * half + 0], std::cos(1.0f));                                  // row * 1
  EXPECT_FLOAT_EQ(sin[t * half + 1], float(std::sin(1.0 * std::pow(10000.0, -0.5))));  // row * f1
  EXPECT_FLOAT_EQ(cos[t * half + 2], std::cos(2.0f));                                  // col * 1
  EXPECT_FLOAT_EQ(cos[(10 + 3) * half + 2], std::cos(1.0f));  // segment 1, token 3: row 1, col 1
  std::vector<float> x = random_values(17 * 3 * 2 * 8, Dist::NORMAL, fresh_seed(), false), y = x;
  apply_rope_qk(sh, cos, sin, y);
  for (int64_t tok = 0; tok < 17; ++tok)
    for (int w = 0; w < 3; ++w)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 4; ++d) {
          const size_t i = size_t(((tok * 3 + w) * 2 + h) * 8 + d);
          if (w == 2) {
            ASSERT_EQ(y[i], x[i]);  // v is not rotated
            ASSERT_EQ(y[i + 4], x[i + 4]);
            continue;
          }
          const double before = double(x[i]) * x[i] + double(x[i + 4]) * x[i + 4];
          const double after = double(y[i]) * y[i] + double(y[i + 4]) * y[i + 4];
          ASSERT_NEAR(after, before, 1e-5 * (1 + before));
          if (tok == 0) {
            ASSERT_EQ(y[i], x[i]);  // position (0, 0): angle 0
          }
        }
}

// ---- finer FP8 scales, K smoothing and rotation (Fp8Fine) ---------------------------------------------

cpu::RefOptions fine_mode(const Qkv& x, cpu::Fp8FineParts parts) {
  cpu::RefOptions o = mode(RefMode::FP8, x);
  o.fp8_fine = cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), parts);
  return o;
}

TEST(Fp8Fine, CurrentScalesAreTheMeansAndAmaxesTheyName) {
  const Qkv x = random_qkv({40, 24}, 3, 8, fresh_seed(), Dist::CHANNELS);
  const cpu::Fp8Fine f = cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), {true, true, true, false});
  ASSERT_EQ(f.k_mean.size(), 24u);
  ASSERT_EQ(f.q_head.size(), 3u);
  ASSERT_EQ(f.k_head.size(), 3u);
  ASSERT_EQ(f.v_channel.size(), 24u);
  Qkv y = x;
  for (int h = 0; h < 3; ++h) {
    float qa = 0, ka = 0;
    for (int d = 0; d < 8; ++d) {
      double sum = 0;
      float va = 0;
      for (int64_t t = 0; t < 64; ++t) sum += y.at(1, t, h, d);
      const float mean = float(sum / 64);
      EXPECT_NEAR(f.k_mean[size_t(h * 8 + d)], mean, 1e-5f * (1 + std::fabs(mean)));
      for (int64_t t = 0; t < 64; ++t) {
        qa = std::max(qa, std::fabs(y.at(0, t, h, d)));
        ka = std::max(ka, std::fabs(y.at(1, t, h, d) - f.k_mean[size_t(h * 8 + d)]));
        va = std::max(va, std::fabs(y.at(2, t, h, d)));
      }
      EXPECT_FLOAT_EQ(f.v_channel[size_t(h * 8 + d)], va / kE4M3Max);
    }
    EXPECT_FLOAT_EQ(f.q_head[size_t(h)], qa / kE4M3Max);
    EXPECT_FLOAT_EQ(f.k_head[size_t(h)], ka / kE4M3Max);
  }
  // Non-finite inputs are named.
  y.at(2, 5, 1, 3) = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(error_of([&] {
              cpu::current_fine_scales(y.shape, y.view(0), y.view(1), y.view(2), {false, false, true});
            }).find("v holds a non-finite value"),
            std::string::npos);
}

// A fresh history's first forward is current scaling: record_fine of cpu::fine_batch gives exactly
// cpu::current_fine_scales' arrays; a non-finite value clears `finite`, wherever it is.
TEST(Fp8Fine, AFreshHistoryFirstForwardIsCurrentScaling) {
  const Qkv x = random_qkv({40, 24, 3}, 3, 8, fresh_seed(), Dist::CHANNELS);
  const cpu::Fp8Fine cur =
      cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), {true, true, true, false});
  const FineBatch b = cpu::fine_batch(x.shape, x.view(0), x.view(1), x.view(2));
  EXPECT_TRUE(b.finite);
  EXPECT_EQ(b.tokens, 67);
  ScaleBook book = ScaleBook::dynamic(1);
  book.enable_fine(3, 8);
  const FineScales f = book.record_fine(0, b);
  EXPECT_EQ(f.k_mean, cur.k_mean);
  EXPECT_EQ(f.q_head, cur.q_head);
  EXPECT_EQ(f.k_head, cur.k_head);
  EXPECT_EQ(f.v_channel, cur.v_channel);
  for (int w = 0; w < 3; ++w) {
    Qkv y = x;
    y.at(w, 66, 2, 7) = w == 1 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(cpu::fine_batch(y.shape, y.view(0), y.view(1), y.view(2)).finite) << "tensor " << w;
  }
}

TEST(Fp8Fine, TheDctIsOrthonormal) {
  for (int n : {8, 64, 72, 80, 128}) {
    const std::vector<float> m = cpu::dct_matrix(n);
    double worst = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        double dot = 0;
        for (int d = 0; d < n; ++d) dot += double(m[size_t(i * n + d)]) * m[size_t(j * n + d)];
        worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
      }
    EXPECT_LT(worst, 1e-5) << "n = " << n;
  }
}

// Smoothing by any vector and rotating Q and K leave the exact attention unchanged; in FP8 they only
// move the rounding: on well-spread inputs the error stays where per-tensor scales put it.
TEST(Fp8Fine, ExactTransformsKeepWellSpreadInputsAsAccurate) {
  const Qkv x = random_qkv({200, 57}, 4, 72, fresh_seed());
  const std::vector<double> ref = x.run(mode(RefMode::EXACT));
  const double tensor = compare(x.run(mode(RefMode::FP8, x)).data(), ref.data(), int64_t(ref.size())).rel_l2;
  for (cpu::Fp8FineParts parts :
       {cpu::Fp8FineParts{true, true, true, false}, cpu::Fp8FineParts{true, true, true, true}}) {
    const std::vector<double> out = x.run(fine_mode(x, parts));
    const ErrorStats e = compare(out.data(), ref.data(), int64_t(ref.size()));
    EXPECT_EQ(e.nonfinite, 0);
    EXPECT_LT(e.rel_l2, 1.15 * tensor) << "rotate " << parts.rotate_qk;
    EXPECT_GT(e.rel_l2, 0.85 * tensor) << "rotate " << parts.rotate_qk;  // still FP8, not something else
  }
  // A k_mean far from K's own mean is still exact in fp64 terms (the scores move by a constant per
  // row): only the quantization of the larger K - k_mean costs accuracy, and it stays finite.
  cpu::RefOptions o = fine_mode(x, {true, false, false});
  for (float& m : o.fp8_fine.k_mean) m += 3.0f;
  o.fp8_fine.k_head.assign(4, (amax(x.shape, x.view(1)) + 3.0f) / kE4M3Max);
  const std::vector<double> shifted = x.run(o);
  EXPECT_LT(compare(shifted.data(), ref.data(), int64_t(ref.size())).rel_l2, 2 * tensor);
}

// Outlier channels (Dist::CHANNELS): per-tensor scales fail; smoothing K and per-head / per-channel
// scales recover much of it (numbers: docs/fp8.md, Outlier channels). How much varies widely with
// the draw (the outlier channels' sizes decide how peaked each head's softmax is), so the bounds are
// set below what every fresh seed measured gave: 16 heads, 350 seeds (2026-12-02): tensor / spread
// 2.07-48.9 (median 16), tensor / robust-without-the-split 1.50-40.7 (median 5.1), tensor / rotated
// 2.31-80.5, robust / rotated 0.33-11.5 (with 4 heads and 300 seeds, tensor / robust fell to 1.30: the
// rotation is not better on every input, so no bound says it is). Without the split no bound holds
// either: seed 3017067371 gives tensor 0.591, robust-without-the-split 0.912 (per-head scales alone
// 1.02: in rows this peaked, which scores a rounding moves is luck), the robust scheme as it runs (split
// pairs) 0.0325. So the robust scheme is asserted as it runs: over 400 fresh seeds (2026-12-05) tensor /
// robust was 3.58-119 (median 30), tensor / robust-without-the-split 0.53-45 (median 5.2; below 1 for 2).
constexpr int kOutlierHeads = 16;

// Per-tensor FP8's error on well-spread inputs of the outlier tests' shape: the floor they compare to.
double fp8_error_on_spread_inputs(uint64_t seed) {
  const Qkv spread = random_qkv({300, 100}, kOutlierHeads, 72, seed);
  const std::vector<double> ref = spread.run(mode(RefMode::EXACT));
  return compare(spread.run(mode(RefMode::FP8, spread)).data(), ref.data(), int64_t(ref.size())).rel_l2;
}

TEST(Fp8Fine, OutlierChannelsNeedTheRobustScheme) {
  const uint64_t seed = fresh_seed();
  const double fp8_spread = fp8_error_on_spread_inputs(seed);
  const Qkv x = random_qkv({300, 100}, kOutlierHeads, 72, seed, Dist::CHANNELS);
  const std::vector<double> ref = x.run(mode(RefMode::EXACT));
  auto err = [&](const cpu::RefOptions& o) { return compare(x.run(o).data(), ref.data(), int64_t(ref.size())).rel_l2; };
  const double bf16 = err(mode(RefMode::BF16));
  const double tensor = err(mode(RefMode::FP8, x));
  const double nosplit = err(fine_mode(x, {true, true, true, false}));
  const double rotated = err(fine_mode(x, {true, true, true, true}));
  const double robust = err(fine_mode(x, cpu::kRobustParts));
  std::printf(
      "channels: bf16 %.3e fp8 tensor %.3e robust %.3e (without the split %.3e, rotated %.3e) | spread fp8 %.3e\n",
      bf16, tensor, robust, nosplit, rotated, fp8_spread);
  EXPECT_LT(bf16, 0.01);
  EXPECT_GT(tensor, 1.5 * fp8_spread);  // the failure the scheme is for
  EXPECT_LT(robust, tensor / 2);
  EXPECT_LT(rotated, tensor / 1.5);
}

// Fp8Exact (measurement only): each operand left unquantized takes its share of FP8's error away, and
// with all three the emulation is far below FP8 (what remains is fp32 arithmetic and the exp).
TEST(Fp8Exact, EachOperandCarriesPartOfTheError) {
  const uint64_t seed = fresh_seed();
  const Qkv x = random_qkv({300, 100}, 8, 72, seed);
  const std::vector<double> ref = x.run(mode(RefMode::EXACT));
  auto err = [&](cpu::Fp8Exact e) {
    cpu::RefOptions o = fine_mode(x, cpu::kRobustParts);
    o.fp8_exact = e;
    return compare(x.run(o).data(), ref.data(), int64_t(ref.size())).rel_l2;
  };
  const double fp8 = err({}), qk = err({true, false, false}), v = err({false, true, false}),
               p = err({false, false, true});
  const double none = err({true, true, true});
  std::printf("fp8 %.3e; exact qk %.3e, v %.3e, p %.3e, all %.3e\n", fp8, qk, v, p, none);
  EXPECT_LT(qk, fp8);
  EXPECT_LT(v, fp8);
  EXPECT_LT(p, fp8);
  EXPECT_GT(std::min({qk, v, p}), fp8 / 3);  // each is one share of three, not all of it
  EXPECT_LT(none, fp8 / 5);
}

TEST(Fp8Fine, MalformedFineScalesAreRefusedByName) {
  const Qkv x = random_qkv({16}, 2, 8, 7);
  auto why = [&](auto edit, RefMode m = RefMode::FP8) {
    cpu::RefOptions o = fine_mode(x, {true, true, true, false});
    if (m != RefMode::FP8) o.mode = m;
    edit(o.fp8_fine);
    return error_of([&] { x.run(o); });
  };
  EXPECT_NE(why([](cpu::Fp8Fine& f) { f.q_head.push_back(1.0f); }).find("q holds 3 scales, not 2"), std::string::npos);
  EXPECT_NE(why([](cpu::Fp8Fine& f) { f.v_channel.resize(3); }).find("v holds 3 scales, not 16"), std::string::npos);
  EXPECT_NE(why([](cpu::Fp8Fine& f) { f.k_head[1] = 0.0f; }).find("k scale must be a finite number > 0"),
            std::string::npos);
  EXPECT_NE(why([](cpu::Fp8Fine& f) { f.k_mean.pop_back(); }).find("k_mean holds 15 values"), std::string::npos);
  EXPECT_NE(why([](cpu::Fp8Fine& f) { f.k_mean[0] = INFINITY; }).find("k_mean must be finite"), std::string::npos);
  EXPECT_NE(why([](cpu::Fp8Fine&) {}, RefMode::BF16).find("fine FP8 scales given for bf16 mode"), std::string::npos);
}

// ---- per rotary pair Q <-> K smoothing (Fp8Fine::qk_pair) ------------------------------------------

TEST(Fp8Pairs, TheFactorIsThePowerOfTwoNearestTheBalance) {
  EXPECT_EQ(cpu::qk_pair_factor(1.0f, 64.0f), 8.0f);    // both sides end at 8
  EXPECT_EQ(cpu::qk_pair_factor(1.0f, 48.0f), 8.0f);    // sqrt(48) = 6.9: 2^2.79 rounds to 2^3
  EXPECT_EQ(cpu::qk_pair_factor(64.0f, 1.0f), 0.125f);  // Q the larger: Q shrinks
  EXPECT_EQ(cpu::qk_pair_factor(3.0f, 3.5f), 1.0f);
  EXPECT_EQ(cpu::qk_pair_factor(1.0f, 0x1p40f), std::ldexp(1.0f, cpu::kQkPairMaxLog2));  // clamped
  EXPECT_EQ(cpu::qk_pair_factor(0x1p40f, 1.0f), std::ldexp(1.0f, -cpu::kQkPairMaxLog2));
  EXPECT_EQ(cpu::qk_pair_factor(0.0f, 5.0f), 1.0f);  // a pair that is zero on one side stays as it is
  EXPECT_EQ(cpu::qk_pair_factor(5.0f, 0.0f), 1.0f);
}

// A power-of-two factor moves Q's and K's values and their scales by the same power: the E4M3 codes,
// the descale product and so the output are bit for bit those without it.
TEST(Fp8Pairs, PowerOfTwoFactorsWithMatchingScalesChangeNoBit) {
  const Qkv x = random_qkv({70, 33}, 2, 8, fresh_seed());
  const cpu::RefOptions plain = fine_mode(x, {false, true, false});
  cpu::RefOptions paired = plain;
  const float f[2] = {4.0f, 0.25f};
  for (int h = 0; h < 2; ++h) {
    for (int p = 0; p < 4; ++p) paired.fp8_fine.qk_pair.push_back(f[h]);
    paired.fp8_fine.q_head[size_t(h)] *= f[h];
    paired.fp8_fine.k_head[size_t(h)] /= f[h];
  }
  EXPECT_EQ(x.run(paired), x.run(plain));
  // current_fine_scales picks the factors from the pairs' amaxes and scales the smoothed tensors.
  const cpu::Fp8Fine c =
      cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), {false, true, false, false, true});
  ASSERT_EQ(c.qk_pair.size(), 8u);
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 4; ++p) {
      float qa = 0, ka = 0;
      for (int64_t t = 0; t < 103; ++t)
        for (int d : {p, p + 4}) {
          qa = std::max(qa, std::fabs(x.view(0).row(t, h)[d]));
          ka = std::max(ka, std::fabs(x.view(1).row(t, h)[d]));
        }
      EXPECT_EQ(c.qk_pair[size_t(h * 4 + p)], cpu::qk_pair_factor(qa, ka)) << h << "," << p;
    }
}

// Outlier channels through RoPE (rotated, a constant offset depends on the position, so K's mean no
// longer removes it). A factor per rotary pair is exact whatever the rotation, yet as a rule it moves
// no error: E4M3 is floating point, every value keeps its relative precision whatever the scale (over
// 15 binades), and the score error is set by the outlier pairs' products q_p k_p, which the factor
// leaves as they are. Splitting those pairs into two E4M3 terms (qk_split, in the robust scheme) is
// what takes the error down, to about the FP8 error of well-spread inputs.
// Bounds, from 400 fresh seeds of this test: split / robust-nosplit at most 0.67, split /
// robust+pairs at most 0.59, split / FP8 on spread inputs at most 1.34; robust+pairs / robust-nosplit
// had median 1.00 and fell below 0.85 on 1.5% of draws (least 0.37: now and then a factor does help,
// most likely by lifting a head's small channels out of E4M3's subnormals once its outlier pair
// shrinks). So the factors' claim is checked on the median of five draws.
TEST(Fp8Pairs, RopedOutlierChannelsNeedSplitPairsNotFactors) {
  const uint64_t seed = fresh_seed();
  const double fp8_spread = fp8_error_on_spread_inputs(seed);
  for (Dist dist : {Dist::KEY_CHANNELS, Dist::CHANNELS}) {
    std::vector<double> gain;  // robust+pairs / robust-nosplit, one a draw
    for (uint64_t draw = 0; draw < 5; ++draw) {
      Qkv x = random_qkv({300, 100}, kOutlierHeads, 72, seed + draw, dist);
      std::vector<float> cos, sin;
      rope_tables_grid(x.shape, cos, sin);
      apply_rope_qk(x.shape, cos, sin, x.data);
      const std::vector<double> ref = x.run(mode(RefMode::EXACT));
      auto err = [&](const cpu::RefOptions& o) {
        return compare(x.run(o).data(), ref.data(), int64_t(ref.size())).rel_l2;
      };
      const double nosplit = err(fine_mode(x, {true, true, true, false}));
      const double paired = err(fine_mode(x, {true, true, true, false, true}));
      gain.push_back(paired / nosplit);
      if (draw > 0) continue;
      const double split = err(fine_mode(x, cpu::kRobustParts));
      std::printf("roped %s: fp8 robust-nosplit %.3e robust+pairs %.3e robust (split) %.3e | spread fp8 %.3e\n",
                  dist_name(dist), nosplit, paired, split, fp8_spread);
      EXPECT_LT(split, 0.8 * nosplit) << dist_name(dist);
      EXPECT_LT(split, 0.8 * paired) << dist_name(dist);
      EXPECT_LT(split, 1.5 * fp8_spread) << dist_name(dist);
    }
    std::sort(gain.begin(), gain.end());
    std::printf("roped %s: robust+pairs / robust-nosplit over five draws %.3f .. %.3f, median %.3f\n", dist_name(dist),
                gain.front(), gain.back(), gain[2]);
    EXPECT_GT(gain[2], 0.85) << dist_name(dist);  // no gain worth the name
  }
}

// Each head's split pairs: the fp8_split_pairs(hd) pairs of largest amax_q * amax_k (K's after its
// mean), the largest first; the per-head scales still cover every channel (a split never clips).
// Every head size: 6 pairs at 72, 8 at 64 and 128 (the robust rows one K step wider).
static void split_pairs_are_the_largest_products(int hd) {
  SCOPED_TRACE(hd);
  const int H = 2, half = hd / 2, T = 60;
  Qkv x = random_qkv({T}, H, hd, fresh_seed());
  for (int64_t t = 0; t < T; ++t) {
    const float sign = t % 2 ? 1.0f : -1.0f;  // K's outliers swing: K's mean does not take them away
    x.at(1, t, 0, 6) += 60.0f * sign;         // head 0: pair 6 by K, pair 1 by Q
    x.at(0, t, 0, 1) += 10.0f;
    x.at(0, t, 1, 3) += 9.0f;  // head 1: pair 3 in both
    x.at(1, t, 1, 3 + half) += 9.0f * sign;
  }
  const cpu::Fp8Fine f = cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), cpu::kRobustParts);
  const int n = fp8_split_pairs(hd);
  ASSERT_EQ(n, hd == 72 ? 6 : 8);
  ASSERT_EQ(f.qk_split.size(), size_t(H * n));
  for (int h = 0; h < H; ++h) {
    std::vector<std::pair<double, int>> share;  // -share, pair: sorted, the largest first, ties to the lower pair
    for (int p = 0; p < half; ++p) {
      float qa = 0, ka = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int d : {p, p + half}) {
          qa = std::max(qa, std::fabs(x.at(0, t, h, d)));
          ka = std::max(ka, std::fabs(x.at(1, t, h, d) - f.k_mean[size_t(h) * hd + d]));
        }
      share.emplace_back(-double(qa * ka), p);
    }
    std::sort(share.begin(), share.end());
    std::vector<int32_t> want;
    for (int i = 0; i < n; ++i) want.push_back(share[size_t(i)].second);
    EXPECT_EQ(std::vector<int32_t>(f.qk_split.begin() + h * n, f.qk_split.begin() + (h + 1) * n), want) << "head " << h;
    EXPECT_EQ(want[0], h == 0 ? 6 : 3);
    float qa = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < hd; ++d) qa = std::max(qa, std::fabs(x.at(0, t, h, d)));
    EXPECT_FLOAT_EQ(f.q_head[size_t(h)], qa / kE4M3Max);
  }
}

TEST(Fp8Pairs, SplitPairsAreTheLargestProducts) {
  for (int hd : {64, 72, 128}) split_pairs_are_the_largest_products(hd);
}

TEST(Fp8Pairs, MalformedFactorsAndSplitsAreRefusedByName) {
  const Qkv x = random_qkv({16}, 2, 8, 7);
  auto why = [&](cpu::Fp8FineParts parts, auto edit) {
    cpu::RefOptions o = fine_mode(x, parts);
    edit(o.fp8_fine);
    return error_of([&] { x.run(o); });
  };
  const cpu::Fp8FineParts pairs = {true, true, true, false, true};
  EXPECT_NE(why(pairs, [](cpu::Fp8Fine& f) { f.qk_pair.pop_back(); }).find("qk_pair holds 7 values, not 8"),
            std::string::npos);
  EXPECT_NE(why(pairs, [](cpu::Fp8Fine& f) { f.qk_pair[3] = 0.0f; }).find("qk_pair must be finite and > 0"),
            std::string::npos);
  EXPECT_NE(why(pairs, [](cpu::Fp8Fine& f) { f.qk_pair[0] = NAN; }).find("qk_pair must be finite and > 0"),
            std::string::npos);
  EXPECT_NE(why(pairs, [](cpu::Fp8Fine& f) { f.rotate_qk = true; }).find("qk_pair and rotate_qk cannot be combined"),
            std::string::npos);
  const cpu::Fp8FineParts split = cpu::kRobustParts;
  EXPECT_NE(why(split, [](cpu::Fp8Fine& f) { f.qk_split.pop_back(); }).find("7 split pairs, not 8"), std::string::npos);
  EXPECT_NE(
      why(split, [](cpu::Fp8Fine& f) { f.qk_split[5] = 4; }).find("head 1: split pair 4 is not a rotary pair (0..3)"),
      std::string::npos);
  EXPECT_NE(why(split, [](cpu::Fp8Fine& f) { f.qk_split[2] = -2; }).find("split pair -2 is not"), std::string::npos);
  EXPECT_NE(why(split, [](cpu::Fp8Fine& f) { f.qk_split[1] = f.qk_split[0]; }).find("is given twice"),
            std::string::npos);
  EXPECT_NE(why(split, [](cpu::Fp8Fine& f) { f.rotate_qk = true; }).find("qk_split cannot be combined"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              cpu::current_fine_scales(x.shape, x.view(0), x.view(1), x.view(2), {false, true, false, true, true});
            }).find("cannot be combined"),
            std::string::npos);
}

// Dist::KEY_CHANNELS: per head 3 K channels with |mean| >= 19, one other Q channel with |mean| >= 9.
TEST(RandomInputs, KeyChannelOutliersAreApartAndReproducible) {
  const int H = 4, hd = 16, T = 60;
  const std::vector<float> a = fovea::random_qkv(T, H, hd, Dist::KEY_CHANNELS, 5);
  EXPECT_EQ(a, fovea::random_qkv(T, H, hd, Dist::KEY_CHANNELS, 5));
  for (int h = 0; h < H; ++h) {
    int k_big = 0, q_big = 0, both = 0;
    for (int d = 0; d < hd; ++d) {
      double q = 0, k = 0;
      for (int t = 0; t < T; ++t) {
        q += a[size_t(((t * 3 + 0) * H + h) * hd + d)];
        k += a[size_t(((t * 3 + 1) * H + h) * hd + d)];
      }
      const bool kb = std::fabs(k / T) >= 19, qb = std::fabs(q / T) >= 9;
      k_big += kb, q_big += qb, both += kb && qb;
    }
    EXPECT_EQ(k_big, 3) << h;
    EXPECT_EQ(q_big, 1) << h;
    EXPECT_EQ(both, 0) << h;
  }
}

TEST(RandomInputs, ChannelOutliersAreLargeAndReproducible) {
  const std::vector<float> a = fovea::random_qkv(50, 3, 16, Dist::CHANNELS, 11),
                           b = fovea::random_qkv(50, 3, 16, Dist::CHANNELS, 11);
  EXPECT_EQ(a, b);
  // Every head's Q and K have a channel whose mean over tokens is at least 20 in size; V a channel
  // whose values reach beyond 10 (a scale of 20-50 on N(0, 1)).
  for (int h = 0; h < 3; ++h) {
    float q_big = 0, k_big = 0, v_big = 0;
    for (int d = 0; d < 16; ++d) {
      double q = 0, k = 0;
      for (int t = 0; t < 50; ++t) {
        q += a[size_t(((t * 3 + 0) * 3 + h) * 16 + d)];
        k += a[size_t(((t * 3 + 1) * 3 + h) * 16 + d)];
        v_big = std::max(v_big, std::fabs(a[size_t(((t * 3 + 2) * 3 + h) * 16 + d)]));
      }
      q_big = std::max(q_big, float(std::fabs(q / 50)));
      k_big = std::max(k_big, float(std::fabs(k / 50)));
    }
    EXPECT_GT(q_big, 19.0f) << h;
    EXPECT_GT(k_big, 19.0f) << h;
    EXPECT_GT(v_big, 10.0f) << h;
  }
  EXPECT_NE(error_of([] { random_values(10, Dist::CHANNELS, 1); }).find("channels"), std::string::npos);
  EXPECT_EQ(parse_dist("channels"), Dist::CHANNELS);
  EXPECT_EQ(parse_dist("key-channels"), Dist::KEY_CHANNELS);
  EXPECT_NE(error_of([] { random_values(10, Dist::KEY_CHANNELS, 1); }).find("key-channels"), std::string::npos);
}

// ---- the flash kernel's tile-row choice (src/attention/cuda/tile-plan.h), plain C++ ----------------

namespace {

struct ScopedEnv {
  explicit ScopedEnv(const char* value) {
    if (value)
      setenv("FOVEA_FLASH_WARPGROUPS", value, 1);
    else
      unsetenv("FOVEA_FLASH_WARPGROUPS");
  }
  ~ScopedEnv() { unsetenv("FOVEA_FLASH_WARPGROUPS"); }
};

}  // namespace

TEST(TilePlan, SmallBatchesTake128RowTilesLargeOnes192) {
  using fovea::cuda::choose_consumer_warpgroups;
  ScopedEnv env(nullptr);
  // The H200's 132 SMs, 16 heads; each expectation is the faster choice measured on 2026-12-02
  // (forced 2 / 3 warpgroups: 227 / 198, 503 / 539, 429 / 534, 539 / 622 TFLOP/s).
  EXPECT_EQ(choose_consumer_warpgroups({1024}, 16, 3, 132), 2);  // 96 CTAs of 192 rows leave 36 SMs idle
  EXPECT_EQ(choose_consumer_warpgroups({8192}, 16, 3, 132), 3);
  EXPECT_EQ(choose_consumer_warpgroups({3520, 3520, 3520}, 16, 3, 132), 3);
  EXPECT_EQ(choose_consumer_warpgroups({32640}, 16, 3, 132), 3);
  EXPECT_EQ(choose_consumer_warpgroups({32640, 32640, 32640}, 16, 3, 132), 3);
  // Where 192-row tiles are not built (BF16, FP8 at head_dim > 80) the answer is always 2.
  EXPECT_EQ(choose_consumer_warpgroups({32640}, 16, 2, 132), 2);
  // Fewer SMs make the same batch "larger".
  EXPECT_EQ(choose_consumer_warpgroups({1024}, 16, 3, 24), 3);
}

TEST(TilePlan, PredictedTimeFollowsWavesAndTheEnvironmentForcesAChoice) {
  using fovea::cuda::choose_consumer_warpgroups;
  using fovea::cuda::predicted_flash_time;
  // One wave: the time of one CTA. 128 rows of 8 blocks (+1 overhead) = 9 * 128.
  EXPECT_DOUBLE_EQ(predicted_flash_time({1024}, 16, 128, 132), 9.0 * 128);
  // 133 equal CTAs on 132 SMs take two CTA times.
  EXPECT_DOUBLE_EQ(predicted_flash_time({128}, 133, 128, 132), 2 * 2.0 * 128);
  // Longest segments first: a long one and many short ones share the SMs.
  // 2 SMs: five 11-block CTAs each, then the three 2-block ones, two on one SM.
  EXPECT_DOUBLE_EQ(predicted_flash_time({128, 128, 128, 1280}, 1, 128, 2), 5 * 11.0 * 128 + 2 * 2.0 * 128);
  {
    ScopedEnv env("3");
    EXPECT_EQ(choose_consumer_warpgroups({1024}, 16, 3, 132), 3);
    EXPECT_EQ(choose_consumer_warpgroups({1024}, 16, 2, 132), 2);  // never more than are built
  }
  {
    ScopedEnv env("2");
    EXPECT_EQ(choose_consumer_warpgroups({32640}, 16, 3, 132), 2);
  }
  {
    ScopedEnv env("7");  // not a choice: the model decides
    EXPECT_EQ(choose_consumer_warpgroups({32640}, 16, 3, 132), 3);
  }
}
