// The Qwen3-VL vision encoder on the CPU: loading (checkpoint folder, synthetic presets, every error
// the loader names), conformance with transformers through golden files (tests/data, made by
// tools/make-golden.py), and FP8 scaling end to end (dynamic, calibration, static reuse).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <cstring>
#include <random>

#include "fovea/bf16.h"
#include "fovea/fp8.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::qwen3vl;
using namespace fovea::test;
namespace fs = std::filesystem;

namespace {

const std::string kTiny = std::string(FOVEA_TEST_DATA) + "/qwen3vl-tiny";

struct Golden {
  std::vector<float> pixels;
  std::vector<GridThw> grids;
  std::map<std::string, std::vector<float>> out;
};

Golden load_golden(const std::string& path = kTiny + "/golden.safetensors") {
  const Checkpoint ck = Checkpoint::open(path);
  Golden g;
  g.pixels = ck.find("pixel_values")->to_float();
  const auto grid = ck.find("grid_thw")->to_float();
  for (size_t i = 0; i + 2 < grid.size(); i += 3) g.grids.push_back({int(grid[i]), int(grid[i + 1]), int(grid[i + 2])});
  for (const auto& [name, t] : ck.tensors())
    if (name != "pixel_values" && name != "grid_thw") g.out[name] = t.to_float();
  return g;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return NAN;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

double mean_cosine(const std::vector<float>& a, const std::vector<float>& b, int width) {
  double sum = 0;
  const size_t rows = a.size() / size_t(width);
  for (size_t r = 0; r < rows; ++r) {
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < width; ++i) {
      const double x = a[r * width + i], y = b[r * width + i];
      ab += x * y;
      aa += x * x;
      bb += y * y;
    }
    sum += ab / std::sqrt(aa * bb);
  }
  return sum / double(rows);
}

}  // namespace

TEST(EncoderLoad, TinyCheckpointMatchesTheSpecShapes) {
  const Model m = load_model(kTiny);
  EXPECT_EQ(m.config.depth, 3);
  EXPECT_EQ(m.config.head_dim(), 16);
  EXPECT_EQ(m.config.deepstack, (std::vector<int>{0, 2}));
  EXPECT_EQ(m.weights.blocks.size(), 3u);
  EXPECT_EQ(m.weights.deepstack.size(), 2u);
  EXPECT_EQ(m.weights.merger.fc1.in, 256);
  EXPECT_EQ(m.weights.patch_embed.w.size(), size_t(64 * 1536));
}

TEST(EncoderLoad, SyntheticPresetsAreDeterministicAndReal) {
  const Model a = load_model("synthetic:tiny"), b = load_model("synthetic:tiny");
  EXPECT_EQ(a.weights.blocks[1].fc1.w, b.weights.blocks[1].fc1.w);
  EXPECT_NE(a.weights.blocks[1].fc1.w, a.weights.blocks[2].fc1.w);  // tensors differ from each other
  const auto c8 = synthetic_config("synthetic:qwen3-vl-8b");
  ASSERT_TRUE(c8);
  EXPECT_EQ(c8->depth, 27);
  EXPECT_EQ(c8->head_dim(), 72);
  EXPECT_EQ(c8->deepstack, (std::vector<int>{8, 16, 24}));
  size_t params = 0;
  for (const auto& [name, shape] : expected_tensors(*c8)) {
    size_t n = 1;
    for (auto d : shape) n *= size_t(d);
    params += n;
  }
  EXPECT_EQ(params, 576388336u) << "docs/encoder.md §Checkpoints: 8B ViT with final and 3 deepstack mergers is 576.4M";
  EXPECT_NE(error_of([] { load_model("synthetic:nope"); }).find("synthetic:tiny"), std::string::npos);
}

TEST(EncoderLoad, ErrorsNameTheProblem) {
  TempDir dir;
  const fs::path d = dir.path / "ckpt";
  fs::create_directories(d);
  // Missing config.json.
  EXPECT_HAS(error_of([&] { load_model(d.string()); }), "config.json");
  // A checkpoint missing tensors: list them.
  fs::copy_file(kTiny + "/config.json", d / "config.json");
  const Checkpoint full = Checkpoint::open(kTiny + "/model.safetensors");
  std::vector<TensorToWrite> kept;
  for (const auto& [name, t] : full.tensors()) {
    if (name.find("blocks.1.attn") != std::string::npos) continue;
    kept.push_back({name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.bytes)});
  }
  write_safetensors((d / "model.safetensors").string(), kept);
  const std::string missing = error_of([&] { load_model(d.string()); });
  EXPECT_HAS(missing, "missing");
  EXPECT_HAS(missing, "model.visual.blocks.1.attn.qkv.weight");
  EXPECT_HAS(missing, "model.visual.blocks.1.attn.proj.bias");
  // A shape mismatch: expected vs found.
  for (auto& t : kept)
    if (t.name == "model.visual.pos_embed.weight") t.shape = {32, 128};
  kept.push_back({"model.visual.blocks.1.attn.qkv.weight", DType::F32, {192, 64}, std::vector<uint8_t>(192 * 64 * 4)});
  kept.push_back({"model.visual.blocks.1.attn.qkv.bias", DType::F32, {192}, std::vector<uint8_t>(192 * 4)});
  kept.push_back({"model.visual.blocks.1.attn.proj.weight", DType::F16, {64, 64}, std::vector<uint8_t>(64 * 64 * 2)});
  kept.push_back({"model.visual.blocks.1.attn.proj.bias", DType::BF16, {64}, std::vector<uint8_t>(64 * 2)});
  write_safetensors((d / "model.safetensors").string(), kept);
  const std::string shape = error_of([&] { load_model(d.string()); });
  EXPECT_HAS(shape, "model.visual.pos_embed.weight");
  EXPECT_HAS(shape, "[32, 128]");
  EXPECT_HAS(shape, "[64, 64]");
}

// fovea's fp32 CPU forward against transformers' fp32 forward on the same weights and pixels.
TEST(EncoderConformance, TinyMatchesTransformers) {
  const Model m = load_model(kTiny);
  const Golden g = load_golden();
  ForwardOptions o;
  o.keep_intermediates = true;
  const ForwardResult r = forward_cpu(m, g.pixels, g.grids, o);
  std::map<std::string, const std::vector<float>*> ours = {{"merged", &r.merged}};
  for (size_t k = 0; k < r.deepstack.size(); ++k) ours["deepstack." + std::to_string(k)] = &r.deepstack[k];
  ours["embed"] = &r.intermediates.at("embed");  // the golden file's names for three of them
  ours["block0"] = &r.intermediates.at("blocks.0");
  ours["last_hidden"] = &r.intermediates.at("blocks." + std::to_string(m.config.depth - 1));
  ASSERT_EQ(ours.size(), g.out.size());
  for (const auto& [name, want] : g.out) {
    ASSERT_TRUE(ours.count(name)) << name;
    const double e = rel_l2(*ours[name], want);
    std::printf("%-12s rel_l2 vs transformers %.3e\n", name.c_str(), e);
    EXPECT_LT(e, 1e-5) << name;  // fp32 against fp32: only summation order differs
  }
}

// The 8B shapes (hd 72, intermediate 4304, 4096-wide mergers) cut to two blocks, with fovea's
// synthetic weights exported and loaded by transformers (tools/make-golden.py --model, fp32, TF32 off).
// The file also holds transformers' own BF16 outputs ("<name>.bf16"), printed for scale.
TEST(EncoderConformance, EightBShapesTwoBlocksMatchTransformers) {
  const Model m = two_block_8b();
  const Golden g = load_golden(std::string(FOVEA_TEST_DATA) + "/qwen3vl-8b-2blocks/golden.safetensors");
  const ForwardResult r = forward_cpu(m, g.pixels, g.grids, {});
  std::map<std::string, const std::vector<float>*> ours = {{"merged", &r.merged}};
  for (size_t k = 0; k < r.deepstack.size(); ++k) ours["deepstack." + std::to_string(k)] = &r.deepstack[k];
  for (const auto& [name, v] : ours) {
    ASSERT_TRUE(g.out.count(name)) << name;
    const double e = rel_l2(*v, g.out.at(name));
    const double hf_bf16 = g.out.count(name + ".bf16") ? rel_l2(g.out.at(name + ".bf16"), g.out.at(name)) : NAN;
    std::printf("%-12s rel_l2 vs transformers fp32 %.3e (transformers bf16: %.3e)\n", name.c_str(), e, hf_bf16);
    EXPECT_LT(e, 1e-5) << name;
  }
}

// FP8 scaling end to end on the CPU: dynamic, then calibration (16 forwards, file written once),
// then static scales from that file on other inputs, each against the exact forward.
TEST(EncoderFp8, DynamicCalibrateStatic) {
  const Model m = load_model(kTiny);
  const Golden g = load_golden();
  const auto exact = forward_cpu(m, g.pixels, g.grids);
  const int out = m.config.out_hidden;

  ScaleBook dynamic = ScaleBook::dynamic(m.config.depth);
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  o.scales = &dynamic;
  const auto fp8 = forward_cpu(m, g.pixels, g.grids, o);
  const double cos_dyn = mean_cosine(fp8.merged, exact.merged, out);
  std::printf("fp8 dynamic: rel_l2 %.3e, mean cosine %.6f\n", rel_l2(fp8.merged, exact.merged), cos_dyn);
  EXPECT_GT(cos_dyn, 0.99);
  EXPECT_LT(rel_l2(fp8.merged, exact.merged), 0.1);
  EXPECT_GT(rel_l2(fp8.merged, exact.merged), 1e-4);  // FP8 rounding really happened

  TempDir dir;
  const std::string path = dir.file("scales.json");
  ScaleBook cal = ScaleBook::calibrating(m.config.depth, path, 1.5f);
  o.scales = &cal;
  for (int i = 0; i < 16; ++i) {
    EXPECT_FALSE(fs::exists(path)) << "written before the 16th forward";
    forward_cpu(m, g.pixels, g.grids, o);
    EXPECT_EQ(cal.after_forward(), i == 15);  // the caller (EncoderRunner) advances calibration
  }
  ASSERT_TRUE(fs::exists(path));
  const auto file = read_scale_file(path);
  ASSERT_EQ(file.layers.size(), size_t(m.config.depth));
  for (int l = 0; l < m.config.depth; ++l) EXPECT_FLOAT_EQ(file.layers.at(l).q, dynamic.scales(l).q * 1.5f);

  // Static scales on other inputs (pixels scaled by 0.8: within the calibrated range).
  std::vector<float> other = g.pixels;
  for (auto& x : other) x *= 0.8f;
  ScaleBook fixed = ScaleBook::fixed(scales_for_model(file, m.config.depth));
  o.scales = &fixed;
  const auto st = forward_cpu(m, other, g.grids, o);
  const auto ex2 = forward_cpu(m, other, g.grids);
  const double cos_static = mean_cosine(st.merged, ex2.merged, out);
  std::printf("fp8 static (calibrated, margin 1.5) on other inputs: rel_l2 %.3e, mean cosine %.6f\n",
              rel_l2(st.merged, ex2.merged), cos_static);
  EXPECT_GT(cos_static, 0.99);
}

// The static guard end to end: static per-tensor scales far below the batch's range are each raised
// to the batch's own amax / 448, which is what dynamic scaling's first forward uses: the same bits.
// Scales far above it are used as given, uncounted.
TEST(EncoderFp8, StaticGuardNeverClips) {
  const Model m = load_model(kTiny);
  const Golden g = load_golden();
  const int L = m.config.depth;
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  ScaleBook dynamic = ScaleBook::dynamic(L);
  o.scales = &dynamic;
  const auto first = forward_cpu(m, g.pixels, g.grids, o);
  ScaleBook tiny = ScaleBook::fixed(std::vector<QkvScales>(size_t(L), QkvScales{1e-9f, 1e-9f, 1e-9f}));
  o.scales = &tiny;
  const auto guarded = forward_cpu(m, g.pixels, g.grids, o);
  EXPECT_EQ(guarded.merged, first.merged) << "every tensor at the batch's own scale, as dynamic's first forward";
  EXPECT_EQ(tiny.guarded(), (GuardCounts{uint64_t(L), uint64_t(L), uint64_t(L)}));
  for (int l = 0; l < L; ++l) EXPECT_EQ(tiny.scales(l), (QkvScales{1e-9f, 1e-9f, 1e-9f})) << "the file's stay";
  ScaleBook large = ScaleBook::fixed(std::vector<QkvScales>(size_t(L), QkvScales{1e3f, 1e3f, 1e3f}));
  o.scales = &large;
  forward_cpu(m, g.pixels, g.grids, o);
  EXPECT_EQ(large.guarded(), GuardCounts{});
}

TEST(EncoderForward, RejectsBadInputs) {
  const Model m = load_model("synthetic:tiny");
  std::vector<float> px(size_t(16) * 1536, 0.1f);
  EXPECT_HAS(error_of([&] { forward_cpu(m, px, {{1, 4, 6}}); }), "pixel_values has");
  EXPECT_HAS(error_of([&] { forward_cpu(m, px, {{1, 3, 4}}); }), "even");
  EXPECT_HAS(error_of([&] { forward_cpu(m, px, {}); }), "no images");
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  EXPECT_HAS(error_of([&] { forward_cpu(m, px, {{1, 4, 4}}, o); }), "scale book");
}

TEST(EncoderLoad, Qwen35ConfigsHaveNoDeepstackAndPrefixesAndDtypesVary) {
  // Qwen3.5: same ViT, no deepstack key; Qwen3-VL without the key gets the class default.
  EXPECT_TRUE(
      parse_config(R"({"model_type": "qwen3_5", "vision_config": {"out_hidden_size": 4096}})", "c").deepstack.empty());
  EXPECT_EQ(parse_config(R"({"model_type": "qwen3_vl", "vision_config": {}})", "c").deepstack,
            (std::vector<int>{8, 16, 24}));
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"hidden_size": 1000}})", "cfg.json"); }), "num_heads");
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"depth": "x"}})", "cfg.json"); }), "vision_config.depth");
  EXPECT_HAS(error_of([] { parse_config("{", "cfg.json"); }), "cfg.json");
}

// Wrongly typed config values are fovea::Errors naming the field, not escaping JSON-library
// exceptions, and integers are never silently truncated.
TEST(EncoderLoad, ConfigTypeErrorsNameTheField) {
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"hidden_act": 5}})", "c"); }), "hidden_act");
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"deepstack_visual_indexes": ["a"]}})", "c"); }),
             "deepstack_visual_indexes");
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"deepstack_visual_indexes": [8.5]}})", "c"); }),
             "deepstack_visual_indexes");
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"depth": 4294967299}})", "c"); }), "vision_config.depth");
  EXPECT_HAS(error_of([] { parse_config(R"({"vision_config": {"depth": 18446744073709551615}})", "c"); }),
             "vision_config.depth");
  // A non-string model_type is simply not Qwen3-VL's (no deepstack default).
  EXPECT_TRUE(parse_config(R"({"model_type": 3, "vision_config": {}})", "c").deepstack.empty());

  // The tiny checkpoint rewritten with the older "visual." prefix and fp32 tensors loads the same
  // weights, with a warning for a stray tensor under the prefix.
  TempDir dir;
  const fs::path d = dir.path / "ckpt";
  fs::create_directories(d);
  fs::copy_file(kTiny + "/config.json", d / "config.json");
  const Checkpoint full = Checkpoint::open(kTiny + "/model.safetensors");
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : full.tensors()) {
    const std::vector<float> v = t.to_float();
    TensorToWrite w{"visual." + name.substr(std::string("model.visual.").size()), DType::F32, t.shape, {}};
    w.bytes.resize(v.size() * 4);
    std::memcpy(w.bytes.data(), v.data(), w.bytes.size());
    out.push_back(std::move(w));
  }
  out.push_back({"visual.stray.weight", DType::F32, {1}, std::vector<uint8_t>(4)});
  write_safetensors((d / "model.safetensors").string(), out);
  static std::string warned;
  warned.clear();
  set_warning_sink([](const std::string& m) { warned += m; });
  const Model a = load_model(d.string()), b = load_model(kTiny);
  set_warning_sink(nullptr);
  EXPECT_HAS(warned, "visual.stray.weight");
  EXPECT_EQ(a.weights.blocks[2].fc2.w, b.weights.blocks[2].fc2.w);
  EXPECT_EQ(a.weights.deepstack[1].norm.w, b.weights.deepstack[1].norm.w);
}

// synthetic:<preset>-outliers: the preset's weights with add_outlier_channels' offsets in every block's
// qkv and nothing else changed; the suffix on an unknown preset stays an error listing the presets.
TEST(SyntheticModel, OutliersSuffix) {
  const Model plain = load_model("synthetic:tiny"), out = load_model("synthetic:tiny-outliers");
  EXPECT_EQ(out.config.name, "synthetic:tiny-outliers");
  EXPECT_EQ(out.config.depth, plain.config.depth);
  const int D = plain.config.hidden, hd = plain.config.head_dim();
  for (size_t b = 0; b < plain.weights.blocks.size(); ++b) {
    const Block &p = plain.weights.blocks[b], &o = out.weights.blocks[b];
    EXPECT_EQ(o.fc1.w, p.fc1.w);
    EXPECT_EQ(o.qkv.b[size_t(D + hd + 2)], p.qkv.b[size_t(D + hd + 2)] + 40.f);  // head 1, K channel 2
    EXPECT_EQ(o.qkv.b[size_t(7)], p.qkv.b[size_t(7)] + 15.f);                    // head 0, Q channel 7
    EXPECT_EQ(o.qkv.b[size_t(8)], p.qkv.b[size_t(8)]);
    EXPECT_EQ(o.qkv.w[size_t(2 * D + 5) * size_t(D)], 20.f * p.qkv.w[size_t(2 * D + 5) * size_t(D)]);  // V channel 5
  }
  EXPECT_TRUE(synthetic_config("synthetic:qwen3-vl-8b-2blocks-outliers").has_value());
  EXPECT_HAS(error_of([] { load_model("synthetic:nope-outliers"); }), "each also with the suffix -outliers");
}

// A saved model reads back with identical weights and gives the identical forward; the CLI does it too.
TEST(EncoderSave, SyntheticRoundTripsThroughACheckpoint) {
  TempDir dir;
  const Model a = load_model("synthetic:tiny");
  save_model(a, dir.path.string());
  const Model b = load_model(dir.path.string());
  EXPECT_EQ(b.config.deepstack, a.config.deepstack);
  EXPECT_EQ(b.weights.blocks[1].qkv.w, a.weights.blocks[1].qkv.w);  // synthetic weights are bf16 values
  const Golden g = load_golden();
  EXPECT_EQ(forward_cpu(b, g.pixels, g.grids).merged, forward_cpu(a, g.pixels, g.grids).merged);
  EXPECT_HAS(error_of([&] { save_model(a, (dir.path / "missing").string()); }), "does not exist");
  const fs::path cli = dir.path / "cli";
  fs::create_directories(cli);
  ASSERT_EQ(
      std::system(
          (std::string("'") + FOVEA_BIN + "' export-model synthetic:tiny '" + cli.string() + "' >/dev/null").c_str()),
      0);
  EXPECT_EQ(load_model(cli.string()).weights.merger.fc2.w, a.weights.merger.fc2.w);
}

// ---- FP8 linears (docs/fp8.md §FP8 linears) ----

namespace {

// A random linear with bf16-exact weights (as every checkpoint's are) and fresh random inputs.
Linear random_linear(int out, int in, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.f, 1.f / std::sqrt(float(in)));
  Linear l;
  l.out = out, l.in = in;
  for (int i = 0; i < out * in; ++i) l.w.push_back(bf16_round(n(rng)));
  for (int i = 0; i < out; ++i) l.b.push_back(bf16_round(0.1f * n(rng)));
  return l;
}

}  // namespace

TEST(Fp8Linear, IsTheQuantizedProductWithPerRowAndPerChannelScales) {
  std::mt19937_64 rng(fresh_seed());
  const int out = 24, in = 40, rows = 6;
  Linear l = random_linear(out, in, rng);
  l.w[5] = bf16_round(40.f * l.w[5]);  // one large (bf16) weight: only output channel 0's scale grows
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> x(size_t(rows) * in);
  for (auto& v : x) v = n(rng);
  for (int i = 0; i < in; ++i) x[size_t(in + i)] *= 1000.f;  // row 1 a thousand times larger
  for (int i = 0; i < in; ++i) x[size_t(2 * in + i)] = 0.f;  // row 2 all zeros
  const std::vector<float> y = linear_fp8(l, x, rows);

  // The definition, written out independently: scales amax / 448, codes sat(rne(v / s)).
  auto quantized = [](const float* v, int count, std::vector<double>& q) {
    float amax = 0.f;
    for (int i = 0; i < count; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float s = amax > 0.f ? amax / 448.f : 1.f;
    q.resize(size_t(count));
    for (int i = 0; i < count; ++i) q[size_t(i)] = double(e4m3_to_float(e4m3_from_float(v[i] / s)));
    return double(s);
  };
  double worst = 0;
  for (int r = 0; r < rows; ++r) {
    std::vector<double> xq, wq;
    const double xs = quantized(x.data() + r * in, in, xq);
    for (int o = 0; o < out; ++o) {
      const double ws = quantized(l.w.data() + o * in, in, wq);
      double acc = 0, mag = 0;  // mag: the sum of |terms|, what bounds fp32 summation error
      for (int i = 0; i < in; ++i)
        acc += xq[size_t(i)] * wq[size_t(i)], mag += std::fabs(xq[size_t(i)] * wq[size_t(i)]);
      const double want = acc * xs * ws + l.b[size_t(o)];
      const double got = y[size_t(r * out + o)];
      worst = std::max(worst, std::fabs(got - want) / (mag * xs * ws + std::fabs(l.b[size_t(o)]) + 1e-30));
      if (r == 2) EXPECT_EQ(got, l.b[size_t(o)]) << "an all-zero row gives the bias";
    }
  }
  EXPECT_LT(worst, 1e-5);  // fp32 summation of exact products

  // Per-row scales: the large row's relative error is that of an ordinary row.
  const std::vector<float> ref =
      linear_fp8(Linear{l.w, std::vector<float>(size_t(out), 0.f), out, in, std::nullopt}, x, rows);
  auto row_rel = [&](int r) {
    double num = 0, den = 0;
    for (int o = 0; o < out; ++o) {
      double exact = 0;
      for (int i = 0; i < in; ++i) exact += double(x[size_t(r * in + i)]) * l.w[size_t(o * in + i)];
      num += (ref[size_t(r * out + o)] - exact) * (ref[size_t(r * out + o)] - exact);
      den += exact * exact;
    }
    return std::sqrt(num / den);
  };
  for (int r : {0, 1, 3}) {
    EXPECT_GT(row_rel(r), 1e-4) << "row " << r << ": FP8 rounding really happened";
    EXPECT_LT(row_rel(r), 0.1) << "row " << r;
  }
}

TEST(Fp8Linear, NanStaysInItsRowAndWeightsRoundToBf16First) {
  std::mt19937_64 rng(fresh_seed());
  const int out = 8, in = 16, rows = 3;
  Linear l = random_linear(out, in, rng);
  std::vector<float> x(size_t(rows) * in, 0.5f);
  x[size_t(in + 3)] = std::nanf("");
  const std::vector<float> y = linear_fp8(l, x, rows);
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < out; ++o) EXPECT_EQ(std::isnan(y[size_t(r * out + o)]), r == 1) << r << "," << o;

  // Weights that are not bf16 values are rounded to bf16 before they are quantized.
  Linear fine = l;
  for (auto& w : fine.w) w = std::nextafter(w, 2.f * w);
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;
  quantize_weight_rows(l, a, sa);
  quantize_weight_rows(fine, b, sb);
  EXPECT_EQ(a, b);
  EXPECT_EQ(sa, sb);
}

TEST(EncoderFp8, Fp8LinearsRunEndToEndCloseToTheFp32Forward) {
  const Model m = load_model(kTiny);
  const Golden g = load_golden();
  const auto exact = forward_cpu(m, g.pixels, g.grids);
  ForwardOptions o;
  o.fp8_linears = true;
  const auto f8 = forward_cpu(m, g.pixels, g.grids, o);
  const int out = m.config.out_hidden;
  const double err = rel_l2(f8.merged, exact.merged);
  std::printf("fp8 linears: rel_l2 %.3e, mean cosine %.6f\n", err, mean_cosine(f8.merged, exact.merged, out));
  EXPECT_GT(mean_cosine(f8.merged, exact.merged, out), 0.99);
  EXPECT_LT(err, 0.1);
  EXPECT_GT(err, 1e-4);  // the linears really ran in FP8
  ASSERT_EQ(f8.deepstack.size(), exact.deepstack.size());
  for (size_t k = 0; k < f8.deepstack.size(); ++k) EXPECT_LT(rel_l2(f8.deepstack[k], exact.deepstack[k]), 0.1);
}

// The robust FP8 scheme end to end (docs/fp8.md §Outlier channels): the tiny model with outlier
// channels put into every block's qkv (with_outlier_channels; the Q/K one on the row's slowest RoPE
// frequency, channel hd/4 - 1 = 3): per-tensor FP8 loses much more than on the plain model, the
// robust scheme recovers most of it.
Model outlier_model() {
  Model m = load_model(kTiny);
  const int qk = m.config.head_dim() / 4 - 1;
  return with_outlier_channels(std::move(m), qk);
}

TEST(EncoderFp8, RobustSchemeHoldsUpUnderOutlierChannels) {
  const Model m = outlier_model();
  const int H = m.config.heads, hd = m.config.head_dim();
  const Golden g = load_golden();
  const auto exact = forward_cpu(m, g.pixels, g.grids);
  auto fp8 = [&](bool robust) {
    ScaleBook book = ScaleBook::dynamic(m.config.depth);
    const Fp8Plan plan = robust ? Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, m.config.depth)
                                : Fp8Plan::tensor(ScaleMode::DYNAMIC, m.config.depth);
    ForwardOptions o;
    o.attention = cpu::RefMode::FP8;
    o.scales = &book;
    o.fp8_plan = &plan;
    return rel_l2(forward_cpu(m, g.pixels, g.grids, o).merged, exact.merged);
  };
  ForwardOptions bo;
  bo.attention = cpu::RefMode::BF16;
  const double bf16 = rel_l2(forward_cpu(m, g.pixels, g.grids, bo).merged, exact.merged);
  const double tensor = fp8(false), robust = fp8(true);
  std::printf("outlier channels, merged rel_l2 vs exact: bf16 %.3e, fp8 tensor %.3e, fp8 robust %.3e\n", bf16, tensor,
              robust);
  // Measured: bf16 1.0e-1, tensor 0.69, robust 8.1e-2. BF16 attention suffers too (K rounded to
  // bf16 next to an offset of 30 moves the scores by more than softmax forgives); smoothing K
  // before it is quantized removes that, so here robust FP8 beats BF16.
  EXPECT_GT(robust, 1e-4);  // still FP8
  EXPECT_LT(robust, tensor / 4);
  EXPECT_LT(robust, 1.5 * bf16);

  // Static robust scales: the fine scales a file would hold, one per layer, used as given.
  std::vector<FineScales> fine(
      size_t(m.config.depth),
      FineScales{std::vector<float>(size_t(H), 1e-3f), std::vector<float>(size_t(H), 1e-3f),
                 std::vector<float>(size_t(H) * hd, 1e-3f), std::vector<float>(size_t(H) * hd, 0.0f)});
  ScaleBook book = ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth)));
  Fp8Plan plan = Fp8Plan::robust_static(fine, H, hd);
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  o.scales = &book;
  o.fp8_plan = &plan;
  EXPECT_GT(rel_l2(forward_cpu(m, g.pixels, g.grids, o).merged, exact.merged), 2 * robust)
      << "the given arrays are used: K about a mean of 0, not smoothed";

  // The static guard: the batch's own K mean and split pairs (one calibrating forward) with scales of
  // 1e-9, far below the batch's range; every head's Q and K scale and every V channel's is raised to
  // the batch's amax / 448, what robust dynamic scaling's first forward uses: the same bits.
  ScaleBook cal = ScaleBook::calibrating(m.config.depth, "unused.json", 1.0f);
  const Fp8Plan dyn_plan = Fp8Plan::robust_dynamic(ScaleMode::CALIBRATE, m.config.depth);
  o.scales = &cal, o.fp8_plan = &dyn_plan;
  const auto first = forward_cpu(m, g.pixels, g.grids, o);
  std::vector<FineScales> own = cal.calibrated_fine(1.0f);
  for (FineScales& f : own)
    for (auto* a : {&f.q_head, &f.k_head, &f.v_channel}) a->assign(a->size(), 1e-9f);
  ScaleBook guarded_book = ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth)));
  const Fp8Plan own_plan = Fp8Plan::robust_static(own, H, hd);
  o.scales = &guarded_book, o.fp8_plan = &own_plan;
  EXPECT_EQ(forward_cpu(m, g.pixels, g.grids, o).merged, first.merged);
  const uint64_t L = uint64_t(m.config.depth);
  EXPECT_EQ(guarded_book.guarded(), (GuardCounts{L, L, L}));
  o.fp8_plan = &plan;
  // A plan and a book that disagree, and fine scales of another shape, are refused.
  ScaleBook dyn = ScaleBook::dynamic(m.config.depth);
  o.scales = &dyn;
  EXPECT_HAS(error_of([&] { forward_cpu(m, g.pixels, g.grids, o); }), "a dynamic scale book for an FP8 plan of static");
  o.scales = &book;
  fine.pop_back();
  plan = Fp8Plan::robust_static(fine, H, hd);
  EXPECT_HAS(error_of([&] { forward_cpu(m, g.pixels, g.grids, o); }), "a scale book of 3 layers for an FP8 plan of 2");
  fine[1].v_channel.pop_back();
  EXPECT_HAS(error_of([&] { Fp8Plan::robust_static(fine, H, hd); }), "layer 1's fine scales are for");
}

// Calibrating the robust scheme: 16 forwards write a file with the fine scales for every layer,
// which then runs the robust scheme statically about as well as dynamic scaling does (another
// image than the calibration's: the golden's pixels flipped).
// Robust calibration of `m` on the golden's pixels: 16 forwards, the file written after the 16th and
// not before; what it wrote.
ScaleFile calibrate_robust(const Model& m, const Golden& g, const std::string& path) {
  ScaleBook cal = ScaleBook::calibrating(m.config.depth, path, kDefaultScaleMargin);
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  o.scales = &cal;
  const Fp8Plan plan = Fp8Plan::robust_dynamic(ScaleMode::CALIBRATE, m.config.depth);
  o.fp8_plan = &plan;
  for (int f = 0; f < 16; ++f) {
    EXPECT_FALSE(std::filesystem::exists(path)) << "before forward " << f + 1;
    forward_cpu(m, g.pixels, g.grids, o);
    EXPECT_EQ(cal.after_forward(), f == 15);  // the caller (EncoderRunner) advances calibration
  }
  EXPECT_TRUE(cal.calibration_written());
  return read_scale_file(path);
}

TEST(EncoderFp8, RobustCalibrationWritesFineScalesThatServeStatically) {
  const Model m = outlier_model();
  const Golden g = load_golden();
  TempDir dir;
  const ScaleFile file = calibrate_robust(m, g, dir.file("robust.json"));
  ASSERT_EQ(file.fine.size(), size_t(m.config.depth));
  std::vector<FineScales> fine;
  for (int l = 0; l < m.config.depth; ++l) fine.push_back(file.fine.at(l));

  std::vector<float> other(g.pixels.rbegin(), g.pixels.rend());
  const auto exact = forward_cpu(m, other, g.grids);
  ScaleBook dyn = ScaleBook::dynamic(m.config.depth);
  const Fp8Plan robust_dyn = Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, m.config.depth),
                robust_static = Fp8Plan::robust_static(fine, m.config.heads, m.config.head_dim());
  ForwardOptions o;
  o.attention = cpu::RefMode::FP8;
  o.fp8_plan = &robust_dyn;
  o.scales = &dyn;
  const double dynamic = rel_l2(forward_cpu(m, other, g.grids, o).merged, exact.merged);
  ScaleBook fixed = ScaleBook::fixed(scales_for_model(file, m.config.depth));
  o.scales = &fixed;
  o.fp8_plan = &robust_static;
  const double stat = rel_l2(forward_cpu(m, other, g.grids, o).merged, exact.merged);
  o.fp8_plan = nullptr;  // every layer per tensor
  const double tensor_static = rel_l2(forward_cpu(m, other, g.grids, o).merged, exact.merged);
  std::printf("robust calibration, held-out rel_l2: dynamic %.3e, static %.3e; per-tensor static %.3e\n", dynamic, stat,
              tensor_static);
  EXPECT_GT(stat, 1e-4);
  EXPECT_LT(stat, 2.0 * dynamic);
  EXPECT_LT(stat, tensor_static / 2);
}

// --fp8-scheme auto (docs/fp8.md §Choosing a scheme): calibration records each layer's robust gain,
// far above kAutoRobustGain with outlier channels and below it on the plain model; a fine list with
// empty layers runs those layers per-tensor from the same file and the others robust, layer by layer
// (the tiny model's first deepstack tap is block 0's output).
TEST(EncoderFp8, AutoRunsRobustOnlyOnTheLayersThatNeedIt) {
  const Golden g = load_golden();
  TempDir dir;
  const Model m = outlier_model(), plain = load_model(kTiny);
  const ScaleFile file = calibrate_robust(m, g, dir.file("outliers.json")),
                  calm = calibrate_robust(plain, g, dir.file("plain.json"));
  for (int l = 0; l < m.config.depth; ++l) {
    std::printf("layer %d robust gain: plain %.3f, outlier channels %.3f\n", l, calm.fine.at(l).robust_gain,
                file.fine.at(l).robust_gain);
    EXPECT_GE(file.fine.at(l).robust_gain, 2 * kAutoRobustGain) << "layer " << l;
    EXPECT_GE(calm.fine.at(l).robust_gain, 1.0f) << "layer " << l;
    EXPECT_LT(calm.fine.at(l).robust_gain, kAutoRobustGain) << "layer " << l;
  }

  ScaleBook fixed = ScaleBook::fixed(scales_for_model(file, m.config.depth));
  auto run = [&](std::vector<bool> robust_layers) {
    std::vector<FineScales> fine;
    for (int l = 0; l < m.config.depth; ++l) fine.push_back(robust_layers[size_t(l)] ? file.fine.at(l) : FineScales{});
    const Fp8Plan plan = Fp8Plan::robust_static(fine, m.config.heads, m.config.head_dim());
    ForwardOptions o;
    o.attention = cpu::RefMode::FP8;
    o.scales = &fixed;
    o.fp8_plan = &plan;
    return forward_cpu(m, g.pixels, g.grids, o);
  };
  ForwardOptions t;
  t.attention = cpu::RefMode::FP8;
  t.scales = &fixed;
  const auto tensor = forward_cpu(m, g.pixels, g.grids, t);
  const auto none = run({false, false, false}), all = run({true, true, true});
  const auto late = run({false, true, true}), first = run({true, false, false});
  EXPECT_EQ(none.merged, tensor.merged) << "every layer empty: the per-tensor forward, bit for bit";
  EXPECT_EQ(late.deepstack[0], tensor.deepstack[0]) << "block 0 per-tensor";
  EXPECT_EQ(first.deepstack[0], all.deepstack[0]) << "block 0 robust";
  EXPECT_NE(late.deepstack[0], all.deepstack[0]);
  EXPECT_NE(late.merged, all.merged);
  EXPECT_NE(late.merged, tensor.merged);
  const auto exact = forward_cpu(m, g.pixels, g.grids);
  const double e_tensor = rel_l2(tensor.merged, exact.merged), e_all = rel_l2(all.merged, exact.merged);
  EXPECT_LT(e_all, e_tensor / 2);
}
