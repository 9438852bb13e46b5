// Tests of the FP8 scale book (docs/fp8.md §Scale book, §Dynamic scaling, §Calibration): the amax ring of dynamic
// scaling, static scales, and calibration (16 complete forwards, then s x margin written atomically).
#include <algorithm>
#include <array>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include "test-util.h"
#include "fovea/io.h"
#include "fovea/fp8-plan.h"
#include "fovea/scales.h"

namespace fs = std::filesystem;
using namespace fovea;
using namespace fovea::test;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

AmaxHistory fresh() {
  AmaxHistory h;
  amax_history_reset(h);
  return h;
}

// The spec's scale of a set of amax values: max |finite x| / 448, floored at FLT_MIN.
float spec_scale(const std::vector<float>& amaxes) {
  float m = 0.0f;
  for (float a : amaxes)
    if (std::isfinite(a)) m = std::max(m, std::fabs(a));
  return std::max(m / 448.0f, FLT_MIN);
}

// Records one complete forward: amax[l][t] for every layer.
void forward(ScaleBook& book, const std::vector<std::array<float, 3>>& amax) {
  for (int l = 0; l < int(amax.size()); ++l) book.record(l, amax[l][0], amax[l][1], amax[l][2]);
}

}  // namespace

// ---- the amax ring -------------------------------------------------------------------------------

TEST(AmaxHistory, EmptyRingGivesTheFloor) {
  const AmaxHistory h = fresh();
  EXPECT_EQ(h.filled, 0);
  EXPECT_EQ(h.updates, 0u);
  EXPECT_EQ(amax_history_scale(h), FLT_MIN);
  EXPECT_EQ(h.scale, FLT_MIN);
  const ScaleBook book = ScaleBook::dynamic(2);
  EXPECT_EQ(book.scales(1), (QkvScales{FLT_MIN, FLT_MIN, FLT_MIN}));
}

TEST(AmaxHistory, ScaleIncludesTheCurrentValue) {
  AmaxHistory h = fresh();
  EXPECT_EQ(amax_history_record(h, 10.0f), 10.0f / 448.0f);
  EXPECT_EQ(amax_history_record(h, 1344.0f), 3.0f);  // the current call's amax is in at once
  EXPECT_EQ(h.scale, 3.0f);
  EXPECT_EQ(amax_history_record(h, 1.0f), 3.0f);  // a smaller one does not lower the max
  EXPECT_EQ(h.filled, 3);
}

// The function a device-resident state is updated with never writes outside the ring, whatever the
// state says (the C ABI refuses such a state on the host; on the device it is not read back).
TEST(AmaxHistory, CorruptPositionOrFillRestartsTheRing) {
  for (const auto& [pos, filled] : std::vector<std::pair<int32_t, int32_t>>{
           {1 << 30, 0}, {-1, 0}, {16, 3}, {0, 17}, {5, -2}, {INT32_MIN, INT32_MAX}}) {
    struct {
      float before[4];
      AmaxHistory h;
      float after[4];
    } guarded;
    for (float& f : guarded.before) f = -7.0f;
    for (float& f : guarded.after) f = -7.0f;
    guarded.h = fresh();
    guarded.h.ring[0] = 99.0f;  // stale data a bad fill would count
    guarded.h.pos = pos;
    guarded.h.filled = filled;
    EXPECT_EQ(amax_history_record(guarded.h, 448.0f), 1.0f) << pos << " " << filled;
    EXPECT_EQ(guarded.h.pos, 1);
    EXPECT_EQ(guarded.h.filled, 1);
    for (const float f : guarded.before) EXPECT_EQ(f, -7.0f);
    for (const float f : guarded.after) EXPECT_EQ(f, -7.0f);
  }
}

TEST(AmaxHistory, RingKeepsExactlyTheLast16) {
  AmaxHistory h = fresh();
  std::vector<float> fed;
  for (int i = 0; i < 20; ++i) {
    const float v = i == 2 ? 1000.0f : 1.0f + 0.25f * float(i);
    fed.push_back(v);
    const float s = amax_history_record(h, v);
    const std::vector<float> last16(fed.end() - std::min<ptrdiff_t>(ptrdiff_t(fed.size()), 16), fed.end());
    EXPECT_EQ(s, spec_scale(last16)) << "after value " << i;
    EXPECT_EQ(h.filled, std::min(i + 1, kAmaxHistoryLen));
    EXPECT_EQ(h.updates, uint32_t(i + 1));
    // The big value (index 2) is in the ring for itself and the next 15 values, gone after 16 more.
    if (i >= 2 && i <= 17) {
      EXPECT_EQ(s, 1000.0f / 448.0f) << i;
    } else if (i >= 18) {
      EXPECT_EQ(s, v / 448.0f) << i;  // the rest increase: the newest is the max
    }
  }
}

TEST(AmaxHistory, FloorAppliesToZeroAndTinyAmax) {
  AmaxHistory h = fresh();
  EXPECT_EQ(amax_history_record(h, 0.0f), FLT_MIN);
  EXPECT_EQ(amax_history_record(h, 1e-40f), FLT_MIN);  // 1e-40 / 448 is below the smallest normal
  EXPECT_EQ(h.filled, 2);
  EXPECT_EQ(amax_history_record(h, 896.0f * FLT_MIN), 2.0f * FLT_MIN);  // above the floor: no floor
}

TEST(AmaxHistory, NonFiniteAmaxIsIgnoredAndCounted) {
  AmaxHistory h = fresh();
  amax_history_record(h, 7.0f);
  const AmaxHistory before = h;
  int n = 0;
  for (float bad : {kInf, -kInf, kNaN, -kNaN}) {
    ++n;
    EXPECT_EQ(amax_history_record(h, bad), 7.0f / 448.0f) << bad;
    EXPECT_EQ(h.filled, 1);
    EXPECT_EQ(h.pos, before.pos);
    EXPECT_EQ(std::memcmp(h.ring, before.ring, sizeof h.ring), 0) << "the ring changed on " << bad;
    EXPECT_EQ(h.nonfinite, uint32_t(n));
    EXPECT_EQ(h.updates, uint32_t(1 + n));  // still an update
  }

  ScaleBook book = ScaleBook::dynamic(3);
  book.record(0, 1.0f, 1.0f, 1.0f);
  const QkvScales s = book.record(1, kInf, 2.0f, kNaN);
  book.record(2, -kInf, -kInf, -kInf);
  EXPECT_EQ(s, (QkvScales{FLT_MIN, 2.0f / 448.0f, FLT_MIN}));
  EXPECT_EQ(book.nonfinite_count(0), 0u);
  EXPECT_EQ(book.nonfinite_count(1), 2u);
  EXPECT_EQ(book.nonfinite_count(2), 3u);
  EXPECT_EQ(book.complete_forwards(), 1u);  // the non-finite records count as updates
}

TEST(AmaxHistory, NegativeAmaxCountsAsItsMagnitude) {
  AmaxHistory h = fresh();
  EXPECT_EQ(amax_history_record(h, -5.0f), 5.0f / 448.0f);
  EXPECT_EQ(amax_history_record(h, 3.0f), 5.0f / 448.0f);  // |-5| stays the max
  EXPECT_EQ(amax_history_record(h, -1000.0f), 1000.0f / 448.0f);
  EXPECT_EQ(h.ring[2], 1000.0f);
}

// ---- the scale book ------------------------------------------------------------------------------

TEST(ScaleBook, CompleteForwardsIsTheMinimumOverLayers) {
  ScaleBook book = ScaleBook::dynamic(3);
  EXPECT_EQ(book.mode(), ScaleMode::DYNAMIC);
  EXPECT_EQ(book.complete_forwards(), 0u);
  for (int i = 0; i < 3; ++i) book.record(0, 1, 1, 1);
  book.record(2, 1, 1, 1);
  EXPECT_EQ(book.complete_forwards(), 0u);  // layer 1 has recorded nothing
  book.record(1, 1, 1, 1);
  EXPECT_EQ(book.complete_forwards(), 1u);
  book.record(1, 1, 1, 1);
  book.record(2, 1, 1, 1);
  EXPECT_EQ(book.complete_forwards(), 2u);
  EXPECT_EQ(book.scales(2), (QkvScales{1.0f / 448.0f, 1.0f / 448.0f, 1.0f / 448.0f}));
}

TEST(ScaleBook, StaticModeReturnsTheFixedScales) {
  const std::vector<QkvScales> fixed = {{0.125f, 0.25f, 0.5f}, {1.0f, 2.0f, 3.0f}};
  ScaleBook book = ScaleBook::fixed(fixed);
  EXPECT_EQ(book.mode(), ScaleMode::STATIC);
  EXPECT_EQ(book.num_layers(), 2);
  EXPECT_EQ(book.scales(0), fixed[0]);
  EXPECT_EQ(book.record(1, 448.0f, 896.0f, 1344.0f), fixed[1]);  // amax at the range: the fixed scales
  EXPECT_EQ(book.scales(1), fixed[1]);
  EXPECT_EQ(book.guarded(), GuardCounts{});
  EXPECT_FALSE(book.after_forward());
}

// The static guard: a tensor whose amax passes 448 x s gets amax / 448 for that forward, counted;
// the book's scales stay the file's; a non-finite amax keeps s uncounted.
TEST(ScaleBook, StaticGuardSwitchesOnlyATensorPastItsRange) {
  ScaleBook book = ScaleBook::fixed({{0.125f, 0.25f, 0.5f}, {1.0f, 1.0f, 1.0f}});
  EXPECT_EQ(book.record(0, 56.0f, 112.0f, 224.0f), (QkvScales{0.125f, 0.25f, 0.5f}));
  EXPECT_EQ(book.record(0, std::nextafter(56.0f, 1e9f), 1.0f, 1e6f),
            (QkvScales{std::nextafter(56.0f, 1e9f) / 448.0f, 0.25f, 1e6f / 448.0f}));
  EXPECT_EQ(book.record(0, 1000.0f, kNaN, kInf), (QkvScales{1000.0f / 448.0f, 0.25f, 0.5f}));
  EXPECT_EQ(book.record(1, 1e3f, 1e3f, 1e3f), (QkvScales{1e3f / 448.0f, 1e3f / 448.0f, 1e3f / 448.0f}));
  EXPECT_EQ(book.scales(0), (QkvScales{0.125f, 0.25f, 0.5f})) << "the file's scales stay";
  EXPECT_EQ(book.guarded(0), (GuardCounts{2, 0, 1}));
  EXPECT_EQ(book.guarded(1), (GuardCounts{1, 1, 1}));
  EXPECT_EQ(book.guarded(), (GuardCounts{3, 1, 2}));
  EXPECT_EQ(book.guarded().total(), 6u);
  book.set_guarded(1, {0, 4, 0});  // the device's running counts
  EXPECT_EQ(book.guarded(1), (GuardCounts{0, 4, 0}));
  ScaleBook dyn = ScaleBook::dynamic(1);
  dyn.record(0, 1e6f, 1e6f, 1e6f);
  EXPECT_EQ(dyn.guarded(), GuardCounts{});
  EXPECT_HAS(error_of([&] { dyn.set_guarded(0, {1, 0, 0}); }), "dynamic");
}

TEST(ScaleBook, StaticModeRejectsNonPositiveOrNonFiniteScales) {
  EXPECT_HAS(error_of([] { ScaleBook::fixed({}); }), "zero layers");
  for (float bad : {0.0f, -0.0f, -1.0f, kInf, -kInf, kNaN}) {
    for (int t = 0; t < 3; ++t) {
      std::vector<QkvScales> s = {{1, 1, 1}, {1, 1, 1}};
      (t == 0 ? s[1].q : t == 1 ? s[1].k : s[1].v) = bad;
      const std::string msg = error_of([&] { ScaleBook::fixed(s); });
      EXPECT_HAS(msg, "layer 1");
      EXPECT_HAS(msg, kQkvNames[t]);
      EXPECT_HAS(msg, "> 0");
    }
  }
}

TEST(ScaleBook, LayerOutOfRangeThrows) {
  ScaleBook dyn = ScaleBook::dynamic(3);
  const ScaleBook fixed = ScaleBook::fixed({{1, 1, 1}});
  EXPECT_HAS(error_of([&] { dyn.record(3, 1, 1, 1); }), "out of range");
  EXPECT_HAS(error_of([&] { dyn.record(-1, 1, 1, 1); }), "out of range");
  EXPECT_HAS(error_of([&] { (void)dyn.scales(3); }), "layer 3");
  EXPECT_HAS(error_of([&] { (void)dyn.nonfinite_count(-1); }), "out of range");
  EXPECT_HAS(error_of([&] { (void)fixed.scales(1); }), "out of range");
  EXPECT_HAS(error_of([] { ScaleBook::dynamic(0); }), "> 0");
}

// ---- calibration ---------------------------------------------------------------------------------

TEST(Calibration, WritesScaleTimesMarginAfterExactly16CompleteForwards) {
  TempDir dir;
  const std::string path = dir.file("scales.json");
  constexpr int L = 4;
  const float margin = 1.5f;
  ScaleBook book = ScaleBook::calibrating(L, path, margin);
  EXPECT_EQ(book.mode(), ScaleMode::CALIBRATE);

  // amax[f][l][t]: random magnitudes with random signs; layer 3's V is always 0 (floor), and one
  // non-finite value in layer 1's K stays out of its ring.
  std::mt19937 rng(20240611);
  std::uniform_real_distribution<float> u(-40.0f, 40.0f);
  std::vector<std::vector<std::array<float, 3>>> amax(16, std::vector<std::array<float, 3>>(L));
  for (auto& f : amax)
    for (auto& l : f)
      for (float& x : l) x = u(rng);
  for (auto& f : amax) f[3][V] = 0.0f;
  amax[5][1][K] = kNaN;

  for (int f = 0; f < 16; ++f) {
    forward(book, amax[size_t(f)]);
    EXPECT_EQ(book.complete_forwards(), uint32_t(f + 1));
    if (f < 15) {
      EXPECT_FALSE(book.after_forward()) << "forward " << f + 1;
      EXPECT_FALSE(fs::exists(path)) << "written after forward " << f + 1;
      EXPECT_FALSE(book.calibration_written());
    }
  }
  EXPECT_TRUE(book.after_forward());
  EXPECT_TRUE(book.calibration_written());
  ASSERT_TRUE(fs::exists(path));
  EXPECT_EQ(dir.list(), std::vector<std::string>{"scales.json"});  // no temp file behind
  EXPECT_EQ(book.nonfinite_count(1), 1u);

  const ScaleFile file = read_scale_file(path);
  ASSERT_EQ(file.layers.size(), size_t(L));
  for (int l = 0; l < L; ++l) {
    for (int t = 0; t < 3; ++t) {
      std::vector<float> fed;
      for (int f = 0; f < 16; ++f) fed.push_back(amax[size_t(f)][size_t(l)][size_t(t)]);
      EXPECT_EQ(file.layers.at(l)[t], spec_scale(fed) * margin) << "layer " << l << " " << kQkvNames[t];
    }
  }
  EXPECT_EQ(file.layers.at(3).v, FLT_MIN * margin);

  // Once only: more forwards do not write again.
  const std::string written = read_file(path);
  EXPECT_FALSE(book.after_forward());
  forward(book, std::vector<std::array<float, 3>>(L, {1000.0f, 1000.0f, 1000.0f}));
  EXPECT_FALSE(book.after_forward());
  EXPECT_EQ(read_file(path), written);
}

TEST(Calibration, AnIncompleteForwardDoesNotCount) {
  TempDir dir;
  const std::string path = dir.file("s.json");
  ScaleBook book = ScaleBook::calibrating(3, path, 2.0f);
  for (int f = 0; f < 16; ++f) {
    for (int l = 0; l < 3; ++l)
      if (!(f == 7 && l == 1)) book.record(l, 1.0f, 1.0f, 1.0f);  // forward 8 misses layer 1
    EXPECT_FALSE(book.after_forward()) << "forward " << f + 1;
  }
  EXPECT_EQ(book.complete_forwards(), 15u);
  EXPECT_FALSE(fs::exists(path));
  book.record(1, 448.0f, 448.0f, 448.0f);  // layer 1 catches up
  EXPECT_EQ(book.complete_forwards(), 16u);
  EXPECT_TRUE(book.after_forward());
  const ScaleFile file = read_scale_file(path);
  EXPECT_EQ(file.layers.at(1), (QkvScales{2.0f, 2.0f, 2.0f}));  // 448 / 448 * 2
  EXPECT_EQ(file.layers.at(0).q, 1.0f / 448.0f * 2.0f);
}

TEST(Calibration, ALayerWithOnlyNonFiniteAmaxIsAnErrorNamingIt) {
  TempDir dir;
  const std::string path = dir.file("s.json");
  ScaleBook book = ScaleBook::calibrating(3, path, 1.5f);
  const float bad[3] = {kNaN, kInf, -kInf};
  for (int f = 0; f < 16; ++f) {
    book.record(0, 1, 1, 1);
    book.record(1, 1, 1, 1);
    book.record(2, bad[f % 3], 1, 1);
  }
  EXPECT_EQ(book.complete_forwards(), 16u);
  const std::string msg = error_of([&] { book.after_forward(); });
  EXPECT_HAS(msg, "visual.blocks.2.attn.attn");
  EXPECT_HAS(msg, "non-finite");
  EXPECT_FALSE(book.calibration_written());
  EXPECT_TRUE(dir.list().empty()) << "left behind: " << ::testing::PrintToString(dir.list());
}

TEST(Calibration, MarginMustBePositiveAndFinite) {
  TempDir dir;
  for (float m : {0.0f, -1.0f, kNaN, kInf})
    EXPECT_HAS(error_of([&] { ScaleBook::calibrating(2, dir.file("s.json"), m); }), "margin");
  EXPECT_HAS(error_of([] { ScaleBook::calibrating(2, "", 1.5f); }), "save path");
}

TEST(Calibration, SavePathInAMissingFolderIsAnErrorAndWritesNothing) {
  TempDir dir;
  const std::string path = dir.file("missing/s.json");
  ScaleBook book = ScaleBook::calibrating(2, path, 1.5f);
  for (int f = 0; f < 16; ++f) forward(book, {{1, 1, 1}, {2, 2, 2}});
  const std::string msg = error_of([&] { book.after_forward(); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "does not exist");
  EXPECT_FALSE(book.calibration_written());
  EXPECT_TRUE(dir.list().empty()) << "left behind: " << ::testing::PrintToString(dir.list());
}

TEST(Calibration, SavePathThatIsAFolderIsAnErrorAndLeavesNoTempFile) {
  TempDir dir;
  fs::create_directory(dir.path / "sub");
  ScaleBook book = ScaleBook::calibrating(1, dir.file("sub"), 1.5f);
  for (int f = 0; f < 16; ++f) book.record(0, 1, 1, 1);
  EXPECT_HAS(error_of([&] { book.after_forward(); }), "folder");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"sub"});
  EXPECT_TRUE(fs::is_empty(dir.path / "sub"));
}

// ---- the robust scheme's history (ScaleBook::record_fine) -----------------------------------------

namespace {

// A random batch's statistics for H heads of hd channels: K values about an offset of its own per
// channel, Q and V amax of any magnitude.
FineBatch random_batch(std::mt19937& rng, int H, int hd) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(0.01f, 50.0f);
  std::uniform_int_distribution<int> tokens(1, 5000);
  FineBatch b;
  b.tokens = tokens(rng);
  const size_t cells = size_t(H) * hd;
  for (size_t i = 0; i < cells; ++i) {
    const float center = 20.0f * u(rng), spread = mag(rng);
    const float lo = center - spread * std::fabs(u(rng)), hi = center + spread * std::fabs(u(rng));
    b.k_lo.push_back(lo);
    b.k_hi.push_back(hi);
    b.k_sum.push_back(double(b.tokens) * double(0.5f * (lo + hi)));
    b.v_amax.push_back(mag(rng));
  }
  for (size_t i = 0; i < cells; ++i) b.q_amax.push_back(mag(rng));
  return b;
}

// The split pairs from the definition, by repeated argmax: per head, fp8_split_pairs(hd) times the
// untaken pair of largest max(q) * max(k) over its two channels (the first on a tie), -1 once none > 0.
std::vector<int32_t> split_by_argmax(int H, int hd, const std::vector<float>& q, const std::vector<float>& k) {
  std::vector<int32_t> out;
  const int half = hd / 2;
  for (int h = 0; h < H; ++h) {
    std::vector<bool> taken(size_t(half), false);
    for (int i = 0; i < fp8_split_pairs(hd); ++i) {
      int best = -1;
      float best_share = 0.0f;
      for (int p = 0; p < half; ++p) {
        const size_t a = size_t(h) * hd + p, b = a + half;
        const float share = std::max(q[a], q[b]) * std::max(k[a], k[b]);
        if (!taken[size_t(p)] && share > best_share) best = p, best_share = share;
      }
      if (best >= 0) taken[size_t(best)] = true;
      out.push_back(best);
    }
  }
  return out;
}

// What a forward should quantize with, written out from the definition (docs/fp8.md): its own K
// mean; per head the largest Q amax, and the largest amax of K minus that forward's mean, over the
// last 16 finite forwards (this one included when finite); per channel V's likewise; / 448, floored.
FineScales expected_fine(const std::vector<FineBatch>& finite_so_far, const FineBatch& now, int H, int hd) {
  const size_t cells = size_t(H) * hd;
  FineScales e;
  std::vector<float> q(size_t(H), 0.0f), k(size_t(H), 0.0f), v(cells, 0.0f);
  const size_t first = finite_so_far.size() > 16 ? finite_so_far.size() - 16 : 0;
  for (size_t f = first; f < finite_so_far.size(); ++f) {
    const FineBatch& b = finite_so_far[f];
    for (size_t i = 0; i < cells; ++i) {
      const float mean = float(b.k_sum[i] / double(b.tokens));
      k[i / hd] = std::max({k[i / hd], b.k_hi[i] - mean, mean - b.k_lo[i]});
      v[i] = std::max(v[i], b.v_amax[i]);
    }
    for (size_t i = 0; i < cells; ++i) q[i / hd] = std::max(q[i / hd], b.q_amax[i]);
  }
  const auto to_scale = [](float a) { return std::max(a / 448.0f, FLT_MIN); };
  std::vector<float> k_now;  // the split pairs are this forward's own
  for (size_t i = 0; i < cells; ++i) {
    e.k_mean.push_back(float(now.k_sum[i] / double(now.tokens)));
    e.v_channel.push_back(to_scale(v[i]));
    k_now.push_back(std::max(now.k_hi[i] - e.k_mean[i], e.k_mean[i] - now.k_lo[i]));
  }
  e.qk_split = split_by_argmax(H, hd, now.q_amax, k_now);
  for (int h = 0; h < H; ++h) e.q_head.push_back(to_scale(q[size_t(h)])), e.k_head.push_back(to_scale(k[size_t(h)]));
  return e;
}

}  // namespace

// The robust scheme's static guard (ScaleBook::guard_fine) against its definition: per head, Q's
// amax and the amax of K about the file's mean; per channel, V's amax; a scale changes only where
// that amax passes 448 x the file's scale, to amax / 448; the mean and split pairs stay.
TEST(StaticGuard, FineScalesFollowTheDefinition) {
  constexpr int H = 3, hd = 8;
  std::mt19937 rng(fresh_seed());
  ScaleBook book = ScaleBook::fixed({QkvScales{}, QkvScales{}});
  GuardCounts expected_counts;
  for (int trial = 0; trial < 30; ++trial) {
    const FineBatch batch = random_batch(rng, H, hd);
    // The file's arrays: each a random factor of what this batch needs, below 1 (a range the batch
    // passes) or above; every third trial's all above (the batch fits the file).
    std::uniform_real_distribution<float> f(trial % 3 == 0 ? 1.01f : 0.2f, 1.6f), mean(-10.0f, 10.0f);
    FineScales file;
    std::vector<float> q_need(size_t(H), 0.0f), k_need(size_t(H), 0.0f);
    for (int i = 0; i < H * hd; ++i) {
      file.k_mean.push_back(mean(rng));
      file.v_channel.push_back(batch.v_amax[size_t(i)] / 448.0f * f(rng));
      const size_t h = size_t(i / hd);
      q_need[h] = std::max(q_need[h], batch.q_amax[size_t(i)]);
      k_need[h] =
          std::max({k_need[h], batch.k_hi[size_t(i)] - file.k_mean.back(), file.k_mean.back() - batch.k_lo[size_t(i)]});
    }
    for (int h = 0; h < H; ++h)
      file.q_head.push_back(q_need[size_t(h)] / 448.0f * f(rng)),
          file.k_head.push_back(k_need[size_t(h)] / 448.0f * f(rng));
    file.qk_split = {1, -1, 0, 2, -1, -1};
    FineScales want = file;
    bool raised[3] = {false, false, false};
    for (int h = 0; h < H; ++h) {
      float q = 0.0f, k = 0.0f;
      for (int c = 0; c < hd; ++c) {
        const size_t i = size_t(h) * hd + size_t(c);
        q = std::max(q, batch.q_amax[i]);
        k = std::max({k, batch.k_hi[i] - file.k_mean[i], file.k_mean[i] - batch.k_lo[i]});
      }
      if (q > 448.0f * file.q_head[size_t(h)]) want.q_head[size_t(h)] = q / 448.0f, raised[0] = true;
      if (k > 448.0f * file.k_head[size_t(h)]) want.k_head[size_t(h)] = k / 448.0f, raised[1] = true;
    }
    for (size_t i = 0; i < want.v_channel.size(); ++i)
      if (batch.v_amax[i] > 448.0f * file.v_channel[i]) want.v_channel[i] = batch.v_amax[i] / 448.0f, raised[2] = true;
    if (trial % 3 == 0) EXPECT_EQ(want, file) << "trial " << trial << ": the file covers the batch";
    expected_counts += GuardCounts{raised[0], raised[1], raised[2]};
    ASSERT_EQ(book.guard_fine(1, file, batch), want) << "trial " << trial;
  }
  EXPECT_EQ(book.guarded(1), expected_counts);
  EXPECT_GT(expected_counts.q + expected_counts.k + expected_counts.v, 0u) << "the trials raised some scale";
  EXPECT_LE(expected_counts.v, 20u) << "and every third left the file's";
  EXPECT_EQ(book.guarded(0), GuardCounts{});

  // A batch with a non-finite value keeps the file's arrays; a shape mismatch and a dynamic book are errors.
  FineBatch bad = random_batch(rng, H, hd);
  bad.finite = false;
  FineScales tiny;
  tiny.k_mean.assign(H * hd, 0.0f), tiny.v_channel.assign(H * hd, 1e-9f);
  tiny.q_head.assign(H, 1e-9f), tiny.k_head.assign(H, 1e-9f);
  EXPECT_EQ(book.guard_fine(0, tiny, bad), tiny);
  EXPECT_EQ(book.guarded(0), GuardCounts{});
  EXPECT_HAS(error_of([&] { book.guard_fine(0, tiny, random_batch(rng, H, hd + 2)); }), "differ in shape");
  ScaleBook dyn = ScaleBook::dynamic(1);
  EXPECT_HAS(error_of([&] { dyn.guard_fine(0, tiny, bad); }), "static guard in a dynamic book");
}

// 40 forwards (the ring wraps twice), two of them non-finite: each forward's arrays are the
// definition's, the non-finite ones are counted and change no ring.
TEST(FineHistory, EachForwardUsesTheLast16FiniteOnes) {
  constexpr int H = 3, hd = 8;
  ScaleBook book = ScaleBook::dynamic(2);
  book.enable_fine(H, hd);
  std::mt19937 rng(fresh_seed());
  std::vector<FineBatch> finite;
  for (int f = 0; f < 40; ++f) {
    FineBatch b = random_batch(rng, H, hd);
    if (f == 7 || f == 23) {
      b.finite = false;
      b.v_amax[5] = kNaN, b.q_amax[1] = kInf;  // what would win every max were it recorded
    } else {
      finite.push_back(b);
    }
    const FineScales got = book.record_fine(0, b);
    EXPECT_EQ(got, expected_fine(finite, b, H, hd)) << "forward " << f;
  }
  EXPECT_EQ(book.fine_state()[0].counts.updates, 40u);
  EXPECT_EQ(book.fine_state()[0].counts.nonfinite, 2u);
  EXPECT_EQ(book.nonfinite_count(0), 2u);
  EXPECT_EQ(book.fine_state()[0].counts.filled, 16);
  EXPECT_EQ(book.complete_forwards(), 0u) << "layer 1 recorded nothing";
  book.enable_fine(H, hd);  // again, same shape: the history stays
  EXPECT_EQ(book.fine_state()[0].counts.updates, 40u);
  EXPECT_NE(error_of([&] { book.enable_fine(H, 2 * hd); }).find("fine history is for 3 heads of 8"), std::string::npos);
  FineBatch wrong = random_batch(rng, H + 1, hd);
  EXPECT_NE(error_of([&] { book.record_fine(1, wrong); }).find("not for 3 heads of 8"), std::string::npos);
  ScaleBook plain = ScaleBook::dynamic(1);
  EXPECT_NE(error_of([&] { plain.record_fine(0, wrong); }).find("history is not enabled"), std::string::npos);
  ScaleBook fixed = ScaleBook::fixed({QkvScales{}});
  EXPECT_NE(error_of([&] { fixed.enable_fine(H, hd); }).find("static scales keep no fine history"), std::string::npos);
}

// Calibration with the robust scheme: after exactly 16 forwards the file holds the fine scales (K's
// mean over all 16 forwards' tokens, K's scale from its range about that mean, Q's and V's the
// rings' max, all x margin) and per-tensor q/k/v equal to what per-tensor calibration of the same
// forwards writes; it reads back for the robust engine.
TEST(FineHistory, CalibrationWritesTheFineScalesAndMatchingPerTensorOnes) {
  constexpr int H = 2, hd = 6, L = 3;
  TempDir dir;
  const std::string path = dir.file("fine.json"), plain_path = dir.file("plain.json");
  const float margin = 1.5f;
  ScaleBook book = ScaleBook::calibrating(L, path, margin);
  book.enable_fine(H, hd);
  ScaleBook plain = ScaleBook::calibrating(L, plain_path, margin);
  std::mt19937 rng(fresh_seed());
  std::vector<std::vector<FineBatch>> fed(L);
  for (int f = 0; f < 16; ++f) {
    EXPECT_FALSE(book.after_forward());
    for (int l = 0; l < L; ++l) {
      const FineBatch b = random_batch(rng, H, hd);
      fed[size_t(l)].push_back(b);
      book.record_fine(l, b);
      float k = 0.0f;
      for (size_t i = 0; i < b.k_hi.size(); ++i) k = std::max({k, std::fabs(b.k_hi[i]), std::fabs(b.k_lo[i])});
      plain.record(l, *std::max_element(b.q_amax.begin(), b.q_amax.end()),
                   k,  // per channel: the largest is the tensor's
                   *std::max_element(b.v_amax.begin(), b.v_amax.end()));
    }
    EXPECT_EQ(book.complete_forwards(), uint32_t(f + 1));
    if (f < 15) EXPECT_FALSE(fs::exists(path)) << "written after forward " << f + 1;
  }
  ASSERT_TRUE(book.after_forward());
  ASSERT_TRUE(plain.after_forward());
  const ScaleFile file = read_scale_file(path), per_tensor = read_scale_file(plain_path);
  EXPECT_EQ(file.layers, per_tensor.layers) << "q/k/v as per-tensor calibration writes them";
  ASSERT_EQ(file.fine.size(), size_t(L));
  for (int l = 0; l < L; ++l) {
    const FineScales& got = file.fine.at(l);
    const auto& bs = fed[size_t(l)];
    for (size_t i = 0; i < size_t(H) * hd; ++i) {
      double sum = 0, tokens = 0;
      float v = 0.0f;
      for (const FineBatch& b : bs) sum += b.k_sum[i], tokens += double(b.tokens), v = std::max(v, b.v_amax[i]);
      EXPECT_EQ(got.k_mean[i], float(sum / tokens)) << "layer " << l << " channel " << i;
      EXPECT_EQ(got.v_channel[i], std::max(v / 448.0f, FLT_MIN) * margin) << "layer " << l << " channel " << i;
    }
    std::vector<float> q_chan(size_t(H) * hd, 0.0f), k_chan(size_t(H) * hd, 0.0f);
    for (int h = 0; h < H; ++h) {
      float q = 0.0f, k = 0.0f;
      for (int d = 0; d < hd; ++d) {
        const size_t i = size_t(h) * hd + d;
        float hi = -kInf, lo = kInf;
        for (const FineBatch& b : bs)
          hi = std::max(hi, b.k_hi[i]), lo = std::min(lo, b.k_lo[i]), q_chan[i] = std::max(q_chan[i], b.q_amax[i]);
        k_chan[i] = std::max(hi - got.k_mean[i], got.k_mean[i] - lo);
        k = std::max(k, k_chan[i]);
        q = std::max(q, q_chan[i]);
      }
      EXPECT_EQ(got.q_head[size_t(h)], std::max(q / 448.0f, FLT_MIN) * margin) << "layer " << l << " head " << h;
      EXPECT_EQ(got.k_head[size_t(h)], std::max(k / 448.0f, FLT_MIN) * margin) << "layer " << l << " head " << h;
    }
    EXPECT_EQ(got.qk_split, split_by_argmax(H, hd, q_chan, k_chan)) << "layer " << l;
    EXPECT_EQ(got.qk_split.size(), size_t(H) * 3) << "head_dim 6: room for all 3 pairs";
    std::vector<float> k_abs(size_t(H) * hd, 0.0f);
    for (const FineBatch& b : bs)
      for (size_t i = 0; i < k_abs.size(); ++i)
        k_abs[i] = std::max({k_abs[i], std::fabs(b.k_hi[i]), std::fabs(b.k_lo[i])});
    EXPECT_EQ(got.robust_gain, robust_gain(H, hd, q_chan.data(), k_abs.data(), k_chan.data(), got.qk_split))
        << "layer " << l;
    EXPECT_GT(got.robust_gain, 0.0f);
  }
}

// robust_gain: exact on a hand-worked head, the largest head's, about 1 on well-spread magnitudes and
// far above kAutoRobustGain when a few channels carry the scores (whether K's mean removes them or a
// split pair takes them).
TEST(RobustGain, HandWorkedWellSpreadAndOutliers) {
  // head_dim 8, pair 0 = channels 0 and 4. All magnitudes 1: no gain without a split; splitting pair
  // 0 takes channels 0 and 4's products to 2^-4 of themselves.
  const std::vector<float> one(8, 1.0f);
  EXPECT_FLOAT_EQ(robust_gain(1, 8, one.data(), one.data(), one.data(), {}), 1.0f);
  EXPECT_FLOAT_EQ(robust_gain(1, 8, one.data(), one.data(), one.data(), {0, -1, -1, -1}),
                  float(std::sqrt(8.0 / (6.0 + 2.0 / 256.0))));
  // Two heads: the second's K has a shared offset on channel 3 that its mean removes; the gain is its.
  std::vector<float> q(16, 1.0f), k(16, 1.0f), ks(16, 1.0f);
  k[8 + 3] = 41.0f;
  const double tensor = 7.0 + 41.0 * 41.0;
  EXPECT_FLOAT_EQ(robust_gain(2, 8, q.data(), k.data(), ks.data(), {}), float(std::sqrt(tensor / 8.0)));
  // A head with no signal gains nothing; a non-finite statistic counts as an outlier.
  const std::vector<float> zero(8, 0.0f);
  EXPECT_FLOAT_EQ(robust_gain(1, 8, zero.data(), zero.data(), zero.data(), {}), 1.0f);
  std::vector<float> nan_q = one;
  nan_q[2] = kNaN;
  EXPECT_EQ(robust_gain(1, 8, nan_q.data(), one.data(), one.data(), {}), FLT_MAX);

  // 16 heads at head_dim 72, fresh magnitudes: well spread (and the split pairs picked as calibration
  // picks them) stays below the threshold; K channels +40 through RoPE (K's range about its mean
  // stays large) with Q +15 elsewhere goes far above it, through the split pairs alone.
  constexpr int H = 16, hd = 72;
  std::mt19937 rng(fresh_seed());
  std::uniform_real_distribution<float> mag(2.5f, 4.5f);
  std::vector<float> qa(H * hd), ka(H * hd), kc(H * hd);
  for (size_t i = 0; i < qa.size(); ++i) qa[i] = mag(rng), ka[i] = mag(rng), kc[i] = ka[i] * 0.9f;
  const float plain =
      robust_gain(H, hd, qa.data(), ka.data(), kc.data(), pick_split_pairs(H, hd, qa.data(), kc.data()));
  EXPECT_GE(plain, 1.0f);
  EXPECT_LT(plain, kAutoRobustGain);
  for (int h = 0; h < H; ++h) {
    for (int c : {2, 13, hd / 2 - 6}) ka[size_t(h * hd + c)] += 40.0f, kc[size_t(h * hd + c)] += 40.0f;
    for (int c : {2, 13, hd / 2 - 6}) qa[size_t(h * hd + c)] += 15.0f;
  }
  const float outliers =
      robust_gain(H, hd, qa.data(), ka.data(), kc.data(), pick_split_pairs(H, hd, qa.data(), kc.data()));
  EXPECT_GT(outliers, 3.0f * kAutoRobustGain) << "plain " << plain;
  EXPECT_NEAR(robust_gain(H, hd, qa.data(), ka.data(), kc.data(), {}), 1.0f, 0.2f) << "without the split nothing moves";
}

// pick_split_pairs: ties go to the lower pair, a share of 0 or NaN is never split, and each head's
// list is fp8_split_pairs(hd) long (at head_dim 64 and 128 the robust rows are one K step wider).
TEST(SplitPairs, TiesZerosAndRoom) {
  EXPECT_EQ(fp8_split_pairs(72), 6);
  EXPECT_EQ(fp8_split_pairs(80), 4);
  EXPECT_EQ(fp8_split_pairs(64), 8);
  EXPECT_EQ(fp8_split_pairs(128), 8);
  EXPECT_EQ(fp8_split_pairs(8), 4);
  EXPECT_EQ(fp8_split_pairs(7), 0);  // odd: no rotary pairs
  // The robust rows: as wide as the per-tensor ones where the padding has room for 4 pairs or more.
  EXPECT_EQ(fp8_robust_qk_width(72), 96);
  EXPECT_EQ(fp8_robust_qk_width(80), 96);
  EXPECT_EQ(fp8_robust_qk_width(64), 96);
  EXPECT_EQ(fp8_robust_qk_width(128), 160);
  EXPECT_EQ(fp8_robust_qk_width(88), 128);
  for (int hd = 2; hd <= 256; hd += 2) EXPECT_LE(hd + 4 * fp8_split_pairs(hd), fp8_robust_qk_width(hd)) << hd;
  // head_dim 8 (pairs 0-3: channels p and p + 4), one head.
  const std::vector<float> q = {1, 2, 0, 1, 1, 2, 0, kNaN}, k = {3, 1.5f, 5, 1, 1, 1, 5, 1};
  // shares: pair 0 1*3 = 3, pair 1 2*1.5 = 3, pair 2 0*5 = 0, pair 3 NaN
  EXPECT_EQ(pick_split_pairs(1, 8, q.data(), k.data()), (std::vector<int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(pick_split_pairs(2, 64, std::vector<float>(128, 1.0f).data(), std::vector<float>(128, 1.0f).data()),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_HAS(error_of([] { check_split_pairs({0, 0, -1, -1}, 1, 8, "x"); }), "x: head 0: split pair 0 is given twice");
  EXPECT_HAS(error_of([] { check_split_pairs({0, 1}, 1, 8, "x"); }), "x: 2 split pairs, not 4");
  check_split_pairs({-1, -1, -1, -1}, 1, 8, "x");
  check_split_pairs({}, 3, 72, "x");
}

// A layer whose every forward was non-finite has nothing to write: an error naming it, no file.
TEST(FineHistory, CalibrationOfALayerWithOnlyNonFiniteForwardsIsAnError) {
  TempDir dir;
  const std::string path = dir.file("fine.json");
  ScaleBook book = ScaleBook::calibrating(2, path, 1.5f);
  book.enable_fine(1, 4);
  std::mt19937 rng(fresh_seed());
  for (int f = 0; f < 16; ++f) {
    book.record_fine(0, random_batch(rng, 1, 4));
    FineBatch bad = random_batch(rng, 1, 4);
    bad.finite = false;
    book.record_fine(1, bad);
  }
  const std::string err = error_of([&] { book.after_forward(); });
  EXPECT_NE(err.find("layer 1 (visual.blocks.1.attn.attn)"), std::string::npos) << err;
  EXPECT_NE(err.find("non-finite value (16 of 16)"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(path));
}

// ---- the FP8 plan (docs/fp8.md §The plan) ------------------------------------------------------------

// One robust layer's fine scales for `heads` heads of `hd` channels (values arbitrary but valid).
FineScales fine_for(int heads, int hd) {
  FineScales f;
  f.q_head.assign(size_t(heads), 0.01f), f.k_head.assign(size_t(heads), 0.02f);
  f.v_channel.assign(size_t(heads) * hd, 0.03f), f.k_mean.assign(size_t(heads) * hd, 0.5f);
  return f;
}

TEST(Fp8Plan, EachConstructorSaysWhatEveryLayerRuns) {
  const Fp8Plan t = Fp8Plan::tensor(ScaleMode::STATIC, 3), d = Fp8Plan::tensor(ScaleMode::CALIBRATE, 3);
  EXPECT_EQ(t.describe(), "tensor static on every layer");
  EXPECT_EQ(d.describe(), "tensor dynamic on every layer");
  EXPECT_FALSE(t.any_robust());
  const Fp8Plan r = Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, 2);
  EXPECT_EQ(r.at(1), LayerScheme::ROBUST_DYNAMIC);
  EXPECT_TRUE(r.fine(1).empty());
  EXPECT_HAS(error_of([] { Fp8Plan::robust_dynamic(ScaleMode::STATIC, 2); }), "robust_static");

  // Static robust: an empty layer runs per tensor, the others their own arrays, as given.
  std::vector<FineScales> fine = {FineScales{}, fine_for(2, 8), fine_for(2, 8)};
  fine[2].qk_split.assign(size_t(2 * fp8_split_pairs(8)), -1);  // 4 slots a head at head_dim 8
  fine[2].qk_split[0] = 3;
  const Fp8Plan s = Fp8Plan::robust_static(fine, 2, 8);
  EXPECT_EQ(s.describe(), "robust static on layers 1,2; tensor static on layer 0");
  EXPECT_EQ(s.at(0), LayerScheme::TENSOR_STATIC);
  EXPECT_EQ(s.fine(2), fine[2]);
  EXPECT_TRUE(s.any_robust());
  EXPECT_EQ(Fp8Plan().describe(), "no layers");
}

TEST(Fp8Plan, FineScalesOfAnotherShapeAndABookThatDisagreesAreRefused) {
  std::vector<FineScales> fine = {fine_for(2, 8), fine_for(2, 8)};
  fine[1].k_mean.pop_back();
  EXPECT_HAS(error_of([&] { Fp8Plan::robust_static(fine, 2, 8); }),
             "layer 1's fine scales are for 2 heads (fovea_q_head; fovea_k_head 2) and 16 V channels (15 K means); "
             "the model has 2 heads of 8");
  fine[1] = fine_for(3, 8);
  EXPECT_HAS(error_of([&] { Fp8Plan::robust_static(fine, 2, 8); }), "layer 1's fine scales are for 3 heads");
  fine[1] = fine_for(2, 8);
  fine[1].qk_split = {9, 9, 9, 9, 9, 9, 9, 9};  // pair 9 of 4
  EXPECT_HAS(error_of([&] { Fp8Plan::robust_static(fine, 2, 8); }), "layer 1's fovea_qk_split");
  fine[1].qk_split.clear();
  const Fp8Plan plan = Fp8Plan::robust_static(fine, 2, 8);
  EXPECT_NO_THROW(plan.check_book(ScaleBook::fixed(std::vector<QkvScales>(2)), "forward"));
  EXPECT_HAS(error_of([&] { plan.check_book(ScaleBook::dynamic(2), "forward"); }),
             "forward: a dynamic scale book for an FP8 plan of static scales");
  EXPECT_HAS(error_of([&] { plan.check_book(ScaleBook::fixed(std::vector<QkvScales>(3)), "encoder"); }),
             "encoder: a scale book of 3 layers for an FP8 plan of 2");
  EXPECT_HAS(error_of([&] {
               Fp8Plan::tensor(ScaleMode::DYNAMIC, 2).check_book(ScaleBook::fixed({{}, {}}), "x");
             }),
             "x: a static scale book for an FP8 plan of dynamic scales");
}
