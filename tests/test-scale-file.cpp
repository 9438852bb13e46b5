// Tests of scale files (docs/fp8.md §Scale file): the accepted formats, a bit-exact atomic write,
// and every bad input as an error naming the file, the layer and the problem.
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/error.h"
#include "test-util.h"
#include "fovea/hd.h"
#include "fovea/io.h"
#include "fovea/scales.h"

namespace fs = std::filesystem;
using namespace fovea;
using namespace fovea::test;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const std::string L0 = "visual.blocks.0.attn.attn";
const std::string L1 = "visual.blocks.1.attn.attn";

bool has_any(const std::string& msg, const std::vector<std::string>& words) {
  return std::any_of(words.begin(), words.end(),
                     [&](const std::string& w) { return msg.find(w) != std::string::npos; });
}

// {"q": q, "k": k, "v": v} as JSON text.
std::string entry(const std::string& q, const std::string& k = "0.5", const std::string& v = "0.5") {
  return "{\"q\": " + q + ", \"k\": " + k + ", \"v\": " + v + "}";
}

}  // namespace

// ---- accepted formats ------------------------------------------------------------------------------

TEST(ReadScaleFile, Flat) {
  TempDir dir;
  const std::string path = dir.write(
      "flat.json", "{\"" + L0 + "\": " + entry("0.0123", "0.25", "3") + ", \"" + L1 + "\": " + entry("1e-3") + "}");
  const ScaleFile f = read_scale_file(path);
  EXPECT_EQ(f.path, path);
  EXPECT_FALSE(f.nested);
  ASSERT_EQ(f.layers.size(), 2u);
  EXPECT_EQ(f.layers.at(0), (QkvScales{float(0.0123), 0.25f, 3.0f}));
  EXPECT_EQ(f.layers.at(1), (QkvScales{float(1e-3), 0.5f, 0.5f}));
  EXPECT_EQ(f.names.at(1), L1);
}

TEST(ReadScaleFile, NestedUnderLayers) {
  TempDir dir;
  const std::string path = dir.write("nested.json", "{\"layers\": {\"" + L0 + "\": " + entry("2", "4", "8") + "}}");
  const ScaleFile f = read_scale_file(path);
  EXPECT_TRUE(f.nested);
  ASSERT_EQ(f.layers.size(), 1u);
  EXPECT_EQ(f.layers.at(0), (QkvScales{2, 4, 8}));
}

TEST(ReadScaleFile, AliasesPlainMixedAndPrefixedKeys) {
  TempDir dir;
  const std::string path = dir.write("mixed.json", R"({
    "visual.blocks.0.attn.attn": {"q_scale": 0.125, "k_scale": 0.25, "v_scale": 0.5},
    "visual.blocks.1.attn.attn": {"q": 1, "k": 2, "v": 4},
    "visual.blocks.2.attn.attn": {"q": 8, "k_scale": 16, "v": 32},
    "model.visual.blocks.3.attn.attn": {"q": 0.75, "k": 1.5, "v_scale": 3}
  })");
  const ScaleFile f = read_scale_file(path);
  ASSERT_EQ(f.layers.size(), 4u);
  EXPECT_EQ(f.layers.at(0), (QkvScales{0.125f, 0.25f, 0.5f}));
  EXPECT_EQ(f.layers.at(1), (QkvScales{1, 2, 4}));
  EXPECT_EQ(f.layers.at(2), (QkvScales{8, 16, 32}));
  EXPECT_EQ(f.layers.at(3), (QkvScales{0.75f, 1.5f, 3}));
  EXPECT_EQ(f.names.at(3), "model.visual.blocks.3.attn.attn");
}

TEST(ReadScaleFile, UnknownFieldIsAWarning) {
  TempDir dir;
  CaptureWarnings cw;
  const std::string path = dir.write("extra.json", "{\"" + L0 + "\": {\"q\": 1, \"k\": 1, \"v\": 1, \"o_scale\": 2}}");
  EXPECT_EQ(read_scale_file(path).layers.at(0), (QkvScales{1, 1, 1}));
  ASSERT_EQ(g_warnings.size(), 1u);
  EXPECT_HAS(g_warnings[0], "o_scale");
  EXPECT_HAS(g_warnings[0], path);
}

// ---- writing -----------------------------------------------------------------------------------------

TEST(WriteScaleFile, RoundTripIsBitExactAcrossMagnitudes) {
  TempDir dir;
  std::mt19937 rng(12345);
  std::uniform_real_distribution<double> log10(-30.0, 30.0);
  std::vector<QkvScales> scales(2000);
  for (auto& s : scales) {
    s.q = float(std::pow(10.0, log10(rng)));
    s.k = float(std::pow(10.0, log10(rng)));
    s.v = float(std::pow(10.0, log10(rng)));
  }
  // Edges: the dynamic floor, the largest float, the smallest subnormal, neighbours of 1.
  scales[0] = {FLT_MIN, FLT_MAX, std::numeric_limits<float>::denorm_min()};
  scales[1] = {1.0f, std::nextafter(1.0f, 2.0f), std::nextafter(1.0f, 0.0f)};
  const std::string path = dir.file("rt.json");
  write_scale_file(path, scales);
  EXPECT_EQ(dir.list(), std::vector<std::string>{"rt.json"});

  const ScaleFile f = read_scale_file(path);
  EXPECT_FALSE(f.nested);
  ASSERT_EQ(f.layers.size(), scales.size());
  for (size_t i = 0; i < scales.size(); ++i)
    for (int t = 0; t < 3; ++t)
      ASSERT_EQ(float_bits(f.layers.at(int(i))[t]), float_bits(scales[i][t]))
          << "layer " << i << " " << kQkvNames[t] << ": wrote " << scales[i][t] << ", read " << f.layers.at(int(i))[t];
}

TEST(WriteScaleFile, LayersAreWrittenInNumericOrder) {
  TempDir dir;
  const std::string path = dir.file("order.json");
  write_scale_file(path, std::vector<QkvScales>(12, QkvScales{0.5f, 0.5f, 0.5f}));
  const std::string text = read_file(path);
  size_t last = 0;
  for (int i = 0; i < 12; ++i) {
    const size_t at = text.find("\"visual.blocks." + std::to_string(i) + ".attn.attn\"");
    ASSERT_NE(at, std::string::npos) << "layer " << i << " missing:\n" << text;
    EXPECT_GT(at, last) << "layer " << i << " is out of order:\n" << text;
    last = at;
  }
}

TEST(WriteScaleFile, FailureLeavesTheExistingFileAndNoTempFile) {
  TempDir dir;
  const std::string path = dir.write("keep.json", "original contents\n");
  for (float bad : {kNaN, 0.0f, -1.0f, std::numeric_limits<float>::infinity()}) {
    const std::string msg = error_of([&] { write_scale_file(path, {{1, 1, 1}, {1, bad, 1}}); });
    EXPECT_HAS(msg, path);
    EXPECT_HAS(msg, "layer 1");
    EXPECT_EQ(read_file(path), "original contents\n");
    EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.json"});
  }
  EXPECT_HAS(error_of([&] { write_scale_file(path, {}); }), path);
  EXPECT_EQ(read_file(path), "original contents\n");

  const std::string missing = dir.file("no-such-folder/s.json");
  EXPECT_HAS(error_of([&] { write_scale_file(missing, {{1, 1, 1}}); }), "does not exist");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.json"});

  write_scale_file(path, {{2, 2, 2}});  // and a good write replaces it
  EXPECT_EQ(read_scale_file(path).layers.at(0), (QkvScales{2, 2, 2}));
  EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.json"});
}

// A write that fails after the temporary file exists (the file size limit makes write() fail with
// EFBIG): the error names the file, the existing file is untouched, and the temporary is removed.
TEST(WriteScaleFile, FailureInTheMiddleOfWritingLeavesNoTempFile) {
  TempDir dir;
  const std::string path = dir.write("keep.json", "original contents\n");
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old_limit;
  small.rlim_cur = 32;  // bytes: less than any scale file
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    write_scale_file(path, std::vector<QkvScales>(8, QkvScales{0.5f, 0.5f, 0.5f}));
  } catch (const Error& e) {
    msg = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);  // before any assertion writes output
  std::signal(SIGXFSZ, old_handler);
  ASSERT_FALSE(msg.empty()) << "the write did not fail";
  EXPECT_HAS(msg, path);
  EXPECT_EQ(read_file(path), "original contents\n");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.json"});
}

// ---- errors -----------------------------------------------------------------------------------------

TEST(ReadScaleFileErrors, MissingFileAndFolder) {
  TempDir dir;
  const std::string missing = dir.file("absent.json");
  std::string msg = error_of([&] { read_scale_file(missing); });
  EXPECT_HAS(msg, missing);
  EXPECT_TRUE(has_any(msg, {"No such file", "cannot open", "not exist"})) << msg;

  fs::create_directory(dir.path / "folder.json");
  msg = error_of([&] { read_scale_file(dir.file("folder.json")); });
  EXPECT_HAS(msg, dir.file("folder.json"));
  EXPECT_HAS(msg, "folder");
}

TEST(ReadScaleFileErrors, InvalidJsonGivesLineAndColumn) {
  TempDir dir;
  // A bad character on line 3, and a trailing comma whose '}' is at column 1 of line 4.
  const std::vector<std::vector<std::string>> docs = {
      {"{", "  \"" + L0 + "\": " + entry("0.5") + ",", "  \"" + L1 + "\": {\"q\": 0.5, \"k\": @, \"v\": 0.5}", "}"},
      {"{", "  \"" + L0 + "\": " + entry("0.5") + ",", "  \"" + L1 + "\": " + entry("0.5") + ",", "}"},
  };
  const std::vector<std::pair<size_t, size_t>> where = {{3, docs[0][2].find('@') + 1}, {4, 1}};
  for (size_t d = 0; d < docs.size(); ++d) {
    std::string text;
    for (const auto& line : docs[d]) text += line + "\n";
    const std::string path = dir.write("bad" + std::to_string(d) + ".json", text);
    const std::string msg = error_of([&] { read_scale_file(path); });
    EXPECT_HAS(msg, path);
    EXPECT_HAS(msg, "JSON");
    EXPECT_HAS(msg, "line " + std::to_string(where[d].first) + ", column " + std::to_string(where[d].second));
  }
}

TEST(ReadScaleFileErrors, EveryBadInputNamesFileLayerAndProblem) {
  struct Case {
    const char* name;
    std::string text;
    std::string layer;               // the layer key the message must name ("" if none)
    std::vector<std::string> words;  // the message names the problem with one of these
  };
  const std::string l0 = "\"" + L0 + "\": ";
  const std::vector<Case> cases = {
      {"top-level-array", "[" + entry("0.5") + "]", "", {"not an object"}},
      {"layers-not-object", "{\"layers\": [1, 2]}", "", {"\"layers\""}},
      {"empty-object", "{}", "", {"no layers"}},
      {"empty-layers", "{\"layers\": {}}", "", {"no layers"}},
      {"entry-number", "{" + l0 + "0.5}", L0, {"not an object"}},
      {"entry-string", "{" + l0 + "\"0.5\"}", L0, {"not an object"}},
      {"entry-array", "{" + l0 + "[0.5, 0.5, 0.5]}", L0, {"not an object"}},
      {"missing-q", "{" + l0 + "{\"k\": 1, \"v\": 1}}", L0, {"missing 'q'"}},
      {"missing-k", "{" + l0 + "{\"q\": 1, \"v_scale\": 1}}", L0, {"missing 'k'"}},
      {"missing-v", "{" + l0 + "{\"q_scale\": 1, \"k\": 1}}", L0, {"missing 'v'"}},
      {"q-and-q_scale", "{" + l0 + "{\"q\": 1, \"q_scale\": 1, \"k\": 1, \"v\": 1}}", L0, {"both"}},
      {"value-string", "{" + l0 + entry("\"0.5\"") + "}", L0, {"not a number"}},
      {"value-bool", "{" + l0 + entry("0.5", "true") + "}", L0, {"not a number"}},
      {"value-null", "{" + l0 + entry("0.5", "0.5", "null") + "}", L0, {"not a number"}},
      {"value-object", "{" + l0 + entry("{}") + "}", L0, {"not a number"}},
      {"value-zero", "{" + l0 + entry("0") + "}", L0, {"> 0"}},
      {"value-minus-zero", "{" + l0 + entry("-0.0") + "}", L0, {"> 0"}},
      {"value-negative", "{" + l0 + entry("0.5", "-0.25") + "}", L0, {"> 0"}},
      // 1e39 is a finite double but overflows float; 1e-50 is a positive double that underflows
      // float to 0. (1e999, not even a finite double, has its own test below.)
      {"value-1e39", "{" + l0 + entry("0.5", "0.5", "1e39") + "}", L0, {"float"}},
      {"value-1e-50", "{" + l0 + entry("1e-50") + "}", L0, {"float", "> 0"}},
      {"nested-bad-value", "{\"layers\": {" + l0 + entry("-1") + "}}", L0, {"> 0"}},
      {"second-layer-bad", "{" + l0 + entry("0.5") + ", \"" + L1 + "\": " + entry("0.5", "0") + "}", L1, {"> 0"}},
      {"not-a-layer-name", "{\"visual.blocks.0.mlp\": " + entry("0.5") + "}", "visual.blocks.0.mlp", {"not a layer"}},
      {"not-a-layer-index",
       "{\"visual.blocks.x.attn.attn\": " + entry("0.5") + "}",
       "visual.blocks.x.attn.attn",
       {"not a layer"}},
      {"duplicate-layer",
       "{\"visual.blocks.3.attn.attn\": " + entry("0.5") + ", \"model.visual.blocks.3.attn.attn\": " + entry("0.5") +
           "}",
       "model.visual.blocks.3.attn.attn",
       {"twice"}},
  };
  TempDir dir;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.write(std::string(c.name) + ".json", c.text);
    const std::string msg = error_of([&] { read_scale_file(path); });
    EXPECT_HAS(msg, path);
    if (!c.layer.empty()) {
      EXPECT_HAS(msg, "'" + c.layer + "'");
    }
    EXPECT_TRUE(has_any(msg, c.words)) << "message: " << msg
                                       << "\nnames none of: " << ::testing::PrintToString(c.words);
  }
}

// 1e999 overflows double: nlohmann's parser does not hand it over as inf but throws
// json::out_of_range (406, "number overflow"), which is not a json::parse_error. It must still be a
// fovea::Error naming the file, the layer and the problem like any other non-finite value.
TEST(ReadScaleFileErrors, ValueOverflowingDoubleNamesFileLayerAndProblem) {
  TempDir dir;
  const std::string path =
      dir.write("huge.json", "{\"" + L0 + "\": " + entry("0.5") + ",\n \"" + L1 + "\": " + entry("0.5", "1e999") + "}");
  const std::string msg = error_of([&] { read_scale_file(path); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, L1);
  EXPECT_TRUE(has_any(msg, {"finite", "overflow"})) << msg;
}

// ---- scales_for_model ---------------------------------------------------------------------------------

TEST(ScalesForModel, MissingLayerListsTheLayersTheFileHas) {
  TempDir dir;
  std::string text = "{";
  for (int i : {0, 2, 5})
    text += (i ? ", " : "") + ("\"visual.blocks." + std::to_string(i) + ".attn.attn\": ") + entry("1");
  const std::string path = dir.write("gaps.json", text + "}");
  const ScaleFile f = read_scale_file(path);
  const std::string msg = error_of([&] { scales_for_model(f, 3); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "visual.blocks.1.attn.attn");
  EXPECT_TRUE(has_any(msg, {"0,2,5", "0, 2, 5"})) << msg;
}

TEST(ScalesForModel, ExtraLayersAreAWarningAndIgnored) {
  TempDir dir;
  std::vector<QkvScales> written;
  for (int i = 0; i < 5; ++i) written.push_back({float(i + 1), 0.5f * float(i + 1), 0.25f * float(i + 1)});
  const std::string path = dir.file("five.json");
  write_scale_file(path, written);
  const ScaleFile f = read_scale_file(path);

  CaptureWarnings cw;
  const std::vector<QkvScales> exact = scales_for_model(f, 5);
  EXPECT_EQ(exact, written);
  EXPECT_TRUE(g_warnings.empty()) << g_warnings[0];

  const std::vector<QkvScales> three = scales_for_model(f, 3);
  ASSERT_EQ(three.size(), 3u);
  EXPECT_EQ(three, std::vector<QkvScales>(written.begin(), written.begin() + 3));
  ASSERT_EQ(g_warnings.size(), 1u);
  EXPECT_HAS(g_warnings[0], path);
  EXPECT_TRUE(has_any(g_warnings[0], {"3,4", "3, 4"})) << g_warnings[0];
}

TEST(ReadScaleFileErrors, RepeatedKeysAreErrors) {
  TempDir dir;
  const std::string layer_twice =
      dir.write("a.json", "{\"" + L0 + "\": " + entry("0.5") + ", \"" + L0 + "\": " + entry("0.25") + "}");
  const std::string e1 = error_of([&] { read_scale_file(layer_twice); });
  EXPECT_HAS(e1, layer_twice);
  EXPECT_HAS(e1, L0);
  EXPECT_HAS(e1, "twice");
  const std::string field_twice = dir.write("b.json", "{\"" + L0 + "\": {\"q\": 1, \"k\": 1, \"v\": 1, \"q\": 2}}");
  const std::string e2 = error_of([&] { read_scale_file(field_twice); });
  EXPECT_HAS(e2, "'q' appears twice in '" + L0 + "'");
}

// ---- fovea's optional fine scales (fovea_q_head, fovea_k_head, fovea_v_channel, fovea_k_mean) --------

namespace {

// A layer entry with q/k/v and the four fine fields (JSON text each); the mean defaults to zeros as
// long as the V channels.
std::string fine_entry(const std::string& qh, const std::string& kh, const std::string& vc, std::string km = "") {
  if (km.empty()) {
    const size_t n = std::count(vc.begin(), vc.end(), ',') + 1;
    km = "[0";
    for (size_t i = 1; i < n; ++i) km += ", 0";
    km += "]";
  }
  return "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_q_head\": " + qh + ", \"fovea_k_head\": " + kh +
         ", \"fovea_v_channel\": " + vc + ", \"fovea_k_mean\": " + km + "}";
}

// A fine_entry with `field`: value (JSON text) added.
std::string with_field(const std::string& fine, const std::string& field, const std::string& value) {
  return fine.substr(0, fine.size() - 1) + ", \"" + field + "\": " + value + "}";
}
std::string with_split(const std::string& fine, const std::string& split) {
  return with_field(fine, "fovea_qk_split", split);
}

}  // namespace

TEST(FineScales, RoundTripBitExactAndQkvStayVllmReadable) {
  TempDir dir;
  std::mt19937 rng(777);
  std::uniform_real_distribution<double> log10(-20.0, 20.0);
  const int layers = 5, heads = 3, channels = 3 * 8;
  std::vector<QkvScales> scales(layers);
  std::vector<FineScales> fine(layers);
  for (int l = 0; l < layers; ++l) {
    scales[size_t(l)] = {float(0.01 * (l + 1)), float(0.02 * (l + 1)), float(0.03 * (l + 1))};
    for (int h = 0; h < heads; ++h) {
      fine[size_t(l)].q_head.push_back(float(std::pow(10.0, log10(rng))));
      fine[size_t(l)].k_head.push_back(float(std::pow(10.0, log10(rng))));
    }
    for (int c = 0; c < channels; ++c) {
      fine[size_t(l)].v_channel.push_back(float(std::pow(10.0, log10(rng))));
      fine[size_t(l)].k_mean.push_back(float((c % 2 ? -1 : 1) * std::pow(10.0, log10(rng))));
    }
  }
  for (int l = 0; l < layers - 1; ++l)  // the split pairs (optional: the last layer has none)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < fp8_split_pairs(8); ++i) fine[size_t(l)].qk_split.push_back(i < 4 - h ? (i + l + h) % 4 : -1);
  fine[0].robust_gain = 1.1803f;  // the statistic auto reads (optional: layer 3 has none)
  fine[1].robust_gain = 37.25f;
  fine[2].robust_gain = FLT_MAX;
  fine[4].robust_gain = std::numeric_limits<float>::denorm_min();
  fine[1].k_mean[0] = 0.0f;
  fine[1].k_mean[1] = -FLT_MAX;
  fine[0].v_channel[0] = std::numeric_limits<float>::denorm_min();
  fine[0].v_channel[1] = FLT_MAX;
  const std::string path = dir.file("fine.json");
  write_scale_file(path, scales, &fine);
  const ScaleFile f = read_scale_file(path);
  ASSERT_EQ(f.fine.size(), size_t(layers));
  for (int l = 0; l < layers; ++l) {
    EXPECT_EQ(f.layers.at(l), scales[size_t(l)]);
    const FineScales& g = f.fine.at(l);
    ASSERT_EQ(g.v_channel.size(), size_t(channels));
    for (int c = 0; c < channels; ++c)
      ASSERT_EQ(float_bits(g.v_channel[size_t(c)]), float_bits(fine[size_t(l)].v_channel[size_t(c)]));
    EXPECT_EQ(float_bits(g.robust_gain), float_bits(fine[size_t(l)].robust_gain));
    EXPECT_EQ(g, fine[size_t(l)]);
  }
  EXPECT_EQ(f.fine.at(3).robust_gain, 0.0f);  // absent reads as "not given"
  // A file without them reads as before, with no fine scales.
  write_scale_file(dir.file("plain.json"), scales);
  EXPECT_TRUE(read_scale_file(dir.file("plain.json")).fine.empty());
}

TEST(FineScales, BadFieldsAreErrorsNamingFileLayerAndProblem) {
  const std::string l0 = "\"" + L0 + "\": ", l1 = "\"" + L1 + "\": ";
  const std::string ok = fine_entry("[1, 2]", "[1, 2]", "[1, 2, 3, 4]");
  struct Case {
    const char* name;
    std::string text;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"two-of-four",
       "{" + l0 + "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_q_head\": [1], \"fovea_k_head\": [1]}}",
       {"all of", "2 of them"}},
      {"three-of-four",
       "{" + l0 +
           "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_q_head\": [1], \"fovea_k_head\": [1], \"fovea_v_channel\": [1]}}",
       {"fovea_k_mean", "3 of them"}},
      {"mean-length", "{" + l0 + fine_entry("[1, 2]", "[1, 2]", "[1, 2, 3, 4]", "[0, 0]") + "}", {"fovea_k_mean 2"}},
      {"mean-not-finite",
       "{" + l0 + fine_entry("[1]", "[1]", "[1, 2]", "[0, 1e39]") + "}",
       {"fovea_k_mean[1]", "finite float32"}},
      {"mean-string",
       "{" + l0 + fine_entry("[1]", "[1]", "[1, 2]", "[0, \"x\"]") + "}",
       {"fovea_k_mean[1]", "not a number"}},
      {"not-array", "{" + l0 + fine_entry("1", "[1]", "[1]") + "}", {"fovea_q_head", "not a non-empty array"}},
      {"empty-array", "{" + l0 + fine_entry("[]", "[1]", "[1]") + "}", {"not a non-empty array"}},
      {"string-value",
       "{" + l0 + fine_entry("[1, \"2\"]", "[1, 2]", "[1, 2]") + "}",
       {"fovea_q_head[1]", "not a number"}},
      {"zero-value", "{" + l0 + fine_entry("[1, 2]", "[1, 2]", "[1, 0, 1, 1]") + "}", {"fovea_v_channel[1]", "> 0"}},
      {"negative-value", "{" + l0 + fine_entry("[1, 2]", "[-1, 2]", "[1, 1]") + "}", {"fovea_k_head[0]"}},
      {"beyond-float", "{" + l0 + fine_entry("[1, 1e39]", "[1, 2]", "[1, 1]") + "}", {"float32"}},
      {"k-heads-differ", "{" + l0 + fine_entry("[1, 2]", "[1, 2, 3]", "[1, 2, 3, 4, 5, 6]") + "}", {"one per head"}},
      {"v-not-multiple", "{" + l0 + fine_entry("[1, 2]", "[1, 2]", "[1, 2, 3]") + "}", {"heads x head_dim"}},
      {"nested-array", "{" + l0 + fine_entry("[[1], 2]", "[1, 2]", "[1, 2]") + "}", {"fovea_q_head[0]"}},
      {"unknown-fovea-field",
       "{" + l0 + "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_rotation\": [1]}}",
       {"fovea_rotation", "newer fovea"}},
      {"only-one-layer-has-them", "{" + l0 + ok + ", " + l1 + entry("1") + "}", {"every layer or for none"}},
      // fovea_qk_split: 2 heads of 2 channels, so 1 pair each, room for it: [p0, p1], each 0 or -1
      {"split-count", "{" + l0 + with_split(ok, "[0]") + "}", {"fovea_qk_split: 1 split pairs, not 2"}},
      {"split-range", "{" + l0 + with_split(ok, "[0, 1]") + "}", {"head 1: split pair 1 is not a rotary pair (0..0)"}},
      {"split-below", "{" + l0 + with_split(ok, "[-2, 0]") + "}", {"fovea_qk_split[0]", "not a rotary pair index"}},
      {"split-float", "{" + l0 + with_split(ok, "[0, 0.5]") + "}", {"fovea_qk_split[1]", "not a rotary pair index"}},
      {"split-huge", "{" + l0 + with_split(ok, "[0, 18446744073709551615]") + "}", {"fovea_qk_split[1]"}},
      {"split-string", "{" + l0 + with_split(ok, "[\"0\", 0]") + "}", {"fovea_qk_split[0]"}},
      {"split-not-array", "{" + l0 + with_split(ok, "3") + "}", {"fovea_qk_split", "not an array"}},
      {"split-alone",
       "{" + l0 + "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_qk_split\": [0]}}",
       {"without the fine scales"}},
      {"gain-alone",
       "{" + l0 + "{\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_robust_gain\": 3}}",
       {"fovea_robust_gain", "without the fine scales"}},
      {"gain-zero", "{" + l0 + with_field(ok, "fovea_robust_gain", "0") + "}", {"fovea_robust_gain", "> 0"}},
      {"gain-negative", "{" + l0 + with_field(ok, "fovea_robust_gain", "-2") + "}", {"fovea_robust_gain"}},
      {"gain-array",
       "{" + l0 + with_field(ok, "fovea_robust_gain", "[2]") + "}",
       {"fovea_robust_gain", "not a number"}},
      {"gain-beyond-float",
       "{" + l0 + with_field(ok, "fovea_robust_gain", "1e39") + "}",
       {"fovea_robust_gain", "float32"}},
      {"shapes-differ-across-layers",
       "{" + l0 + ok + ", " + l1 + fine_entry("[1]", "[1]", "[1, 2]") + "}",
       {"heads and"}},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of([&] { parse_scale_file(c.text, "fine.json"); });
    EXPECT_HAS(msg, "fine.json") << c.name;
    EXPECT_TRUE(has_any(msg, c.words)) << c.name << ": " << msg;
  }
  // Over the length limit.
  std::string big = "[";
  for (int i = 0; i <= kMaxFineScales; ++i) big += i ? ",1" : "1";
  big += "]";
  EXPECT_HAS(error_of([&] { parse_scale_file("{" + l0 + fine_entry("[1]", "[1]", big) + "}", "big.json"); }), "limit");
  // An unknown field without the prefix stays a warning (vLLM's or another tool's).
  CaptureWarnings cw;
  EXPECT_EQ(parse_scale_file("{" + l0 + "{\"q\": 1, \"k\": 1, \"v\": 1, \"o_scale\": 1}}", "w.json").fine.size(), 0u);
  EXPECT_EQ(g_warnings.size(), 1u);
}

TEST(FineScales, WriterRefusesWhatTheReaderWould) {
  TempDir dir;
  const std::vector<QkvScales> two = {{1, 1, 1}, {1, 1, 1}};
  const FineScales good{{1, 2}, {1, 2}, {1, 2, 3, 4}, {0, -1, 1, 0}, {}};
  auto refused = [&](const std::vector<FineScales>& fine) {
    const std::string path = dir.file("w.json");
    const std::string msg = error_of([&] { write_scale_file(path, two, &fine); });
    EXPECT_FALSE(fs::exists(path)) << msg;
    return msg;
  };
  EXPECT_HAS(refused({good}), "2 layers of scales but 1");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1}, {1, 2}, {0, 0}, {}}}), "refusing");
  EXPECT_HAS(refused({good, FineScales{{1}, {1}, {1, 2}, {0, 0}, {}}}), "the same for every layer");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1, 2}, {1, 0, 1, 1}, {0, 0, 0, 0}, {}}}), "fovea_v_channel");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1, kNaN}, {1, 1, 1, 1}, {0, 0, 0, 0}, {}}}), "fovea_k_head");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1, 2}, {1, 1, 1, 1}, {0, 0, 0}, {}}}), "refusing");
  EXPECT_HAS(
      refused({good, FineScales{{1, 2}, {1, 2}, {1, 1, 1, 1}, {0, std::numeric_limits<float>::infinity(), 0, 0}, {}}}),
      "fovea_k_mean");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1, 2}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0, 1}}}), "fovea_qk_split");
  EXPECT_HAS(refused({good, FineScales{{1, 2}, {1, 2}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0}}}), "1 split pairs, not 2");
  for (float gain : {kNaN, -1.0f, std::numeric_limits<float>::infinity()}) {
    FineScales g = good;
    g.robust_gain = gain;
    EXPECT_HAS(refused({good, g}), "fovea_robust_gain");
  }
}
