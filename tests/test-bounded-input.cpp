// Tests of hostile local input (issue 10, point 2): bounded JSON (depth, keys, strings, values,
// duplicates; linear time; truncated quoting), and every local file format on top of it: scale files,
// config.json, preprocessor_config.json checked against the model, safetensors headers and shard
// indexes, FIFOs where a file is expected, and checked size arithmetic. Each case is one class of
// input that used to crash, hang, allocate without bound or load silently wrong.
#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fovea/checked.h"
#include "fovea/clock.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"
#include "fovea/scales.h"
#include "test-util.h"

namespace fs = std::filesystem;
using namespace fovea;
using namespace fovea::test;
using json = nlohmann::json;

namespace {

// An object of n keys "k0".."k<n-1>" with integer values.
std::string many_keys(size_t n) {
  std::string s = "{";
  for (size_t i = 0; i < n; ++i) s += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
  return s + "}";
}

std::string layer_entry(int i) {
  return "\"visual.blocks." + std::to_string(i) + ".attn.attn\":{\"q\":1,\"k\":1,\"v\":1}";
}

std::string raw_safetensors(const std::string& header, const std::string& data) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
  return s + header + data;
}

std::string safetensors_error(const std::string& header, const std::string& data) {
  const std::string bytes = raw_safetensors(header, data);
  return error_of(
      [&] { parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t.safetensors"); });
}

const std::string kTinyConfig = std::string(FOVEA_SOURCE_DIR) + "/tests/data/qwen3vl-tiny/config.json";

}  // namespace

// ---- bounded JSON -------------------------------------------------------------------------------------

TEST(BoundedJson, ValidDocumentsParseAsNlohmannDoes) {
  const std::string text =
      R"({"a": [1, -2, 3.5, true, false, null, "x\u00e9\n"], "b": {"c": {"d": []}, "e": {}}, "f": 18446744073709551615})";
  const json mine = parse_json_bounded(text, {}, "doc");
  EXPECT_EQ(mine, json::parse(text));
  EXPECT_EQ(parse_json_bounded("7", {}, "doc"), json(7));
  EXPECT_EQ(parse_json_bounded("[[], [[]], {}]", {}, "doc"), json::parse("[[], [[]], {}]"));
}

// depth 100000: refused at the limit without recursion (neither in the scan nor in a DOM: none that
// deep is built), and nothing of the document is kept.
TEST(BoundedJson, DeepNestingIsRefusedWithoutRecursion) {
  for (const std::string open : {"[", "{\"a\":"}) {
    std::string text;
    for (int i = 0; i < 100000; ++i) text += open;
    const std::string msg = error_of([&] { parse_json_bounded(text, {}, "body"); });
    EXPECT_HAS(msg, "body: nesting deeper than 32 levels");
    EXPECT_HAS(msg, "line 1, column " + std::to_string(32 * open.size() + 1));
    EXPECT_LT(msg.size(), 600u) << "the path in the message must be elided: " << msg;
  }
  // Exactly at the limit is fine.
  JsonLimits l;
  l.max_depth = 3;
  EXPECT_NO_THROW(parse_json_bounded("[[[1]]]", l, "d"));
  EXPECT_HAS(error_of([&] { parse_json_bounded("[[[[1]]]]", l, "d"); }), "nesting deeper than 3 levels");
}

// 100k keys (1.2 MB) used to cost 15 s in ordered_json: now refused at the key limit, long before
// the end; 1000 keys parse in linear time. The time bounds only catch gross quadratic behaviour.
TEST(BoundedJson, ManyKeysAreRefusedFastAndAThousandParseFast) {
  const std::string big = many_keys(100000);
  JsonLimits l;
  l.max_bytes = big.size();
  auto t0 = Clock::now();
  const std::string msg = error_of([&] { parse_json_bounded(big, l, "body"); });
  EXPECT_LT(seconds_since(t0), 2.0 * fovea::test::kTimeScale);
  EXPECT_HAS(msg, "an object has more than 1024 keys");

  const std::string thousand = many_keys(1000);
  t0 = Clock::now();
  const json j = parse_json_bounded(thousand, {}, "body");
  EXPECT_LT(seconds_since(t0), 2.0 * fovea::test::kTimeScale);
  EXPECT_EQ(j.size(), 1000u);
  EXPECT_EQ(j.at("k999"), 999);

  // With the key limit raised, 100k keys still parse in linear time (std::map: log-time lookups).
  l.max_object_keys = 200000;
  l.max_elements = 200000;
  t0 = Clock::now();
  EXPECT_EQ(parse_json_bounded(big, l, "body").size(), 100000u);
  EXPECT_LT(seconds_since(t0), 2.0 * fovea::test::kTimeScale);
}

TEST(BoundedJson, LongStringsKeysAndTextAreRefused) {
  JsonLimits l;
  l.max_string_bytes = 100;
  const std::string long_key = "{\"" + std::string(1000, 'k') + "\": 1}";
  std::string msg = error_of([&] { parse_json_bounded(long_key, l, "doc"); });
  EXPECT_HAS(msg, "a key of 1000 bytes is longer than the limit of 100 bytes");
  EXPECT_EQ(msg.find(std::string(101, 'k')), std::string::npos) << "client text must be cut: " << msg;
  msg = error_of([&] { parse_json_bounded("[\"" + std::string(1000, 's') + "\"]", l, "doc"); });
  EXPECT_HAS(msg, "a string of 1000 bytes");
  msg = error_of([&] { parse_json_bounded(std::string(2 << 20, ' '), {}, "doc"); });
  EXPECT_HAS(msg, "doc: 2097152 bytes, longer than the limit of 1048576 bytes");
  l = {};
  l.max_elements = 10;
  EXPECT_HAS(error_of([&] { parse_json_bounded("[1,2,3,4,5,6,7,8,9,10,11]", l, "doc"); }),
             "more than 10 values in the document");
}

TEST(BoundedJson, DuplicateKeysAreRefused) {
  EXPECT_HAS(error_of([] { parse_json_bounded(R"({"a": 1, "b": 2, "a": 3})", {}, "doc"); }),
             "doc: key 'a' appears twice in the top-level object");
  EXPECT_HAS(error_of([] { parse_json_bounded(R"({"x": [{"q": 1, "q": 2}]})", {}, "doc"); }),
             "key 'q' appears twice in '[0]'");
  EXPECT_HAS(error_of([] { parse_json_bounded(R"({"x": {"q": 1, "q": 2}})", {}, "doc"); }),
             "key 'q' appears twice in 'x'");
}

TEST(BoundedJson, InvalidJsonNamesLineAndColumnAndCutsTheToken) {
  std::string msg = error_of([] { parse_json_bounded("{\n  \"a\": @\n}", {}, "doc"); });
  EXPECT_HAS(msg, "doc is not valid JSON: parse error at line 2, column 8");
  // An unterminated string of 1 MB: nlohmann's "last read" would quote all of it.
  msg = error_of([] { parse_json_bounded("[\"" + std::string(1000000, 'z'), {}, "doc"); });
  EXPECT_HAS(msg, "not valid JSON");
  EXPECT_LT(msg.size(), 400u) << msg.substr(0, 400);
  msg = error_of([] { parse_json_bounded(R"({"a": {"b": 1e999}})", {}, "doc"); });
  EXPECT_HAS(msg, "number overflow");
  EXPECT_HAS(msg, "/a/b");
  EXPECT_HAS(error_of([] { parse_json_bounded("", {}, "doc"); }), "not valid JSON");
  EXPECT_HAS(error_of([] { parse_json_bounded("[1] x", {}, "doc"); }), "not valid JSON");
  EXPECT_HAS(error_of([] { parse_json_bounded("\"\xff\"", {}, "doc"); }), "not valid JSON");
}

TEST(BoundedJson, QuoteForErrorIsCutEscapedAndNeverRecursive) {
  EXPECT_EQ(quote_for_error("abc"), "\"abc\"");
  EXPECT_EQ(quote_for_error(std::string(100, 'x'), 5), "\"xxxxx...\"");
  EXPECT_EQ(quote_for_error(std::string_view("a\"b\\c\n\x01\xff", 8)), "\"a\\\"b\\\\c\\n\\x01\\xff\"");
  EXPECT_EQ(quote_for_error("\xc3\xa9t\xc3\xa9", 2), "\"\xc3\xa9t...\"");  // UTF-8 kept, counted as characters
  EXPECT_EQ(quote_for_error(json::parse(R"({"a":[1,"x"],"b":null})")), R"({"a":[1,"x"],"b":null})");
  EXPECT_EQ(quote_for_error(json::parse(R"([1,2,3,4,5,6])"), 6), "[1,2,3...");
  // A value 200000 deep (built iteratively here): rendered up to max_chars only.
  json deep = json::array();
  json* at = &deep;
  for (int i = 0; i < 200000; ++i) {
    at->push_back(json::array());
    at = &at->back();
  }
  EXPECT_EQ(quote_for_error(deep, 10), "[[[[[[[[[[...");
}

// ---- scale files --------------------------------------------------------------------------------------

TEST(BoundedScaleFile, TwoHundredThousandLayersAreRefused) {
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? "," : "") + layer_entry(i % 4096);
  text += "}";
  auto t0 = Clock::now();
  EXPECT_HAS(error_of([&] { parse_scale_file(text, "s.json"); }), "longer than the limit");
  // Under the size limit, the layer count limit.
  text = "{";
  for (int i = 0; i < 5000; ++i) text += (i ? "," : "") + layer_entry(i);
  text += "}";
  const std::string msg = error_of([&] { parse_scale_file(text, "s.json"); });
  EXPECT_HAS(msg, "scale file 's.json'");
  EXPECT_HAS(msg, "keys");
  EXPECT_LT(seconds_since(t0), 2.0 * fovea::test::kTimeScale);
  // 4096 layers is the limit, and fine.
  text = "{";
  for (int i = 0; i < kMaxScaleLayers; ++i) text += (i ? "," : "") + layer_entry(i);
  EXPECT_EQ(parse_scale_file(text + "}", "s.json").layers.size(), size_t(kMaxScaleLayers));
  EXPECT_HAS(error_of([] { parse_scale_file("{" + layer_entry(4096) + "}", "s.json"); }), "over the limit of 4095");
  EXPECT_HAS(
      error_of([] { parse_scale_file("{" + layer_entry(0).replace(15, 1, "99999999999999999999") + "}", "s.json"); }),
      "over the limit of 4095");
}

// A ~1 MB key crashed std::regex by recursion; the key limit refuses it, and the hand-written key
// parser is linear anyway.
TEST(BoundedScaleFile, HugeKeyAndDeepValuesAreErrorsNotCrashes) {
  const std::string key(1 << 20, 'a');
  std::string msg = error_of([&] { parse_scale_file("{\"" + key + ".visual.blocks.0.attn.attn\": {}}", "s.json"); });
  EXPECT_HAS(msg, "scale file 's.json'");
  EXPECT_HAS(msg, "longer than the limit");
  EXPECT_LT(msg.size(), 400u);
  std::string deep = "{\"visual.blocks.0.attn.attn\": {\"q\": ";
  for (int i = 0; i < 100000; ++i) deep += "[";
  EXPECT_HAS(error_of([&] { parse_scale_file(deep, "s.json"); }), "nesting deeper than 8 levels");
  // Keys that look almost like layer names.
  for (const char* bad : {"visual.blocks..attn.attn", "xvisual.blocks.1.attn.attn", "visual.blocks.1.attn.att",
                          ".attn.attn", "visual.blocks.1a.attn.attn"})
    EXPECT_HAS(
        error_of([&] { parse_scale_file(std::string("{\"") + bad + "\": {\"q\":1,\"k\":1,\"v\":1}}", "s.json"); }),
        "is not a layer name")
        << bad;
  EXPECT_EQ(
      parse_scale_file("{\"a.b.visual.blocks.7.attn.attn\": {\"q\":1,\"k\":1,\"v\":1}}", "s.json").layers.count(7), 1u);
}

// ---- config.json ranges -------------------------------------------------------------------------------

TEST(BoundedConfig, HugeDimensionsAreRefusedNamingFieldValueAndRange) {
  struct Case {
    std::string field, value, want;
  };
  const std::vector<Case> cases = {
      {"depth", "2147483647", "vision_config.depth is 2147483647, outside the supported range 1..256"},
      {"hidden_size", "1000000000", "vision_config.hidden_size is 1000000000, outside the supported range 1..65536"},
      {"intermediate_size", "0", "vision_config.intermediate_size is 0, outside the supported range 1..262144"},
      {"num_heads", "-4", "vision_config.num_heads is -4, outside"},
      {"patch_size", "65", "vision_config.patch_size is 65, outside the supported range 1..64"},
      {"temporal_patch_size", "5", "vision_config.temporal_patch_size is 5, outside the supported range 1..4"},
      {"spatial_merge_size", "9", "vision_config.spatial_merge_size is 9, outside the supported range 1..8"},
      {"out_hidden_size", "70000", "vision_config.out_hidden_size is 70000, outside"},
      {"num_position_embeddings", "1000000", "vision_config.num_position_embeddings is 1000000, outside"},
      {"num_position_embeddings", "63", "num_position_embeddings 63 is not a square grid"},
      {"depth", "4294967323", "vision_config.depth is 4294967323, not an integer"},
      {"depth", "3.5", "vision_config.depth is 3.5, not an integer"},
      {"num_heads", "3", "hidden_size 64 is not divisible by num_heads 3"},
      {"num_heads", "32", "head_dim (hidden_size / num_heads) is 2"},
      {"deepstack_visual_indexes", "[0, 0]", "must increase"},
      {"deepstack_visual_indexes", "[0, 3]", "outside blocks 0..2"},
  };
  const json base = json::parse(read_file(kTinyConfig));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field + " = " + c.value);
    json doc = base;
    doc["vision_config"][c.field] = json::parse(c.value);
    const auto t0 = Clock::now();
    const std::string msg = error_of([&] { qwen3vl::parse_config(doc.dump(), "m/config.json"); });
    EXPECT_HAS(msg, "m/config.json");
    EXPECT_HAS(msg, c.want);
    EXPECT_LT(seconds_since(t0), 1.0);
  }
  EXPECT_NO_THROW(qwen3vl::parse_config(base.dump(), "m/config.json"));
}

// ---- preprocessor_config.json against the model -------------------------------------------------------

TEST(BoundedPreprocessConfig, MismatchWithTheModelIsRefusedNamingBothFiles) {
  TempDir dir;
  fs::copy_file(kTinyConfig, dir.path / "config.json");
  dir.write("preprocessor_config.json", R"({"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2})");
  std::string msg = error_of([&] { image::load_preprocess_config(dir.path.string()); });
  EXPECT_HAS(msg, dir.file("preprocessor_config.json") + ": patch_size is 14");
  EXPECT_HAS(msg, dir.file("config.json"));
  EXPECT_HAS(msg, "vision_config.patch_size 16");
  dir.write("preprocessor_config.json", R"({"temporal_patch_size": 1})");
  EXPECT_HAS(error_of([&] { image::load_preprocess_config(dir.path.string()); }), "temporal_patch_size is 1");
  dir.write("preprocessor_config.json", R"({"patch_size": 16, "merge_size": 2, "image_std": [0.5, 0.5, 0.5]})");
  EXPECT_NO_THROW(image::load_preprocess_config(dir.path.string()));
  qwen3vl::VisionConfig m = *qwen3vl::synthetic_config("synthetic:tiny");
  image::PreprocessConfig p;
  p.patch = 14;
  EXPECT_HAS(error_of([&] { image::check_against_model(p, "pp.json", m); }), "pp.json: patch_size is 14");
}

TEST(BoundedPreprocessConfig, BadValuesAreRefusedNamingTheField) {
  struct Case {
    std::string text, want;
  };
  const std::vector<Case> cases = {
      {R"({"image_std": [0.5, 0, 0.5]})", "image_std[1] is 0; it must be a finite number in [1e-6, 1e6]"},
      {R"({"image_std": [0.5, -0.5, 0.5]})", "image_std[1] is -0.5"},
      {R"({"image_std": [0.5, 0.5]})", "image_std is [0.5,0.5]; it must be a list of 3 numbers"},
      {R"({"image_mean": [0.5, "x", 0.5]})", "image_mean[1] is \"x\""},
      {R"({"image_mean": [0.5, 1e300, 0.5]})", "image_mean[1] is 1e+300"},
      {R"({"min_pixels": 0})", "min_pixels is 0; it must be an integer in 1..268435456"},
      {R"({"max_pixels": 1e12})", "max_pixels is 1000000000000.0; it must be an integer"},
      {R"({"max_pixels": 99999999999})", "max_pixels is 99999999999; it must be an integer in 1..268435456"},
      {R"({"min_pixels": 5000, "max_pixels": 4000})", "max_pixels 4000 is below min_pixels 5000"},
      {R"({"size": {"shortest_edge": -1}})", "size.shortest_edge is -1"},
      {R"({"patch_size": 0})", "patch_size is 0; it must be an integer in 1..64"},
      {R"({"merge_size": 1000})", "merge_size is 1000"},
      {R"([1])", "not a JSON object"},
      {R"({"patch_size": 16, "patch_size": 16})", "key 'patch_size' appears twice"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const std::string msg = error_of([&] { image::parse_preprocess_config(c.text, "p.json"); });
    EXPECT_HAS(msg, "p.json");
    EXPECT_HAS(msg, c.want);
  }
  const image::PreprocessConfig ok = image::parse_preprocess_config(
      R"({"size": {"shortest_edge": 1000, "longest_edge": 2000000}, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]})",
      "p.json");
  EXPECT_EQ(ok.min_pixels, 1000);
  EXPECT_EQ(ok.max_pixels, 2000000);
  EXPECT_FLOAT_EQ(ok.mean[2], 0.3f);
  EXPECT_FLOAT_EQ(ok.std[0], 0.4f);
}

// ---- only regular files ---------------------------------------------------------------------------------

// A FIFO where a file is expected: refused at once (opened O_NONBLOCK, then fstat), never blocking
// for a writer that never comes.
TEST(RegularFilesOnly, FifoShardConfigAndScaleFileAreRefusedFast) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.file("s1.safetensors").c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo(dir.file("fifo.json").c_str(), 0600), 0);
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors"}})");
  const auto t0 = Clock::now();
  std::string msg = error_of([&] { Checkpoint::open(dir.path.string()); });
  EXPECT_HAS(msg, dir.file("s1.safetensors"));
  EXPECT_HAS(msg, "is not a regular file");
  msg = error_of([&] { Checkpoint::open(dir.file("s1.safetensors")); });
  EXPECT_HAS(msg, "is not a regular file");
  EXPECT_HAS(error_of([&] { read_scale_file(dir.file("fifo.json")); }), "is not a regular file (a FIFO)");
  EXPECT_HAS(error_of([&] { read_file(dir.file("fifo.json")); }), "is not a regular file");
  EXPECT_HAS(error_of([&] { read_file("/dev/zero"); }), "is not a regular file (a device)");
  EXPECT_LT(seconds_since(t0), 2.0 * fovea::test::kTimeScale);
}

TEST(RegularFilesOnly, ReadFileIsBounded) {
  TempDir dir;
  const std::string p = dir.write("f.txt", std::string(1000, 'x'));
  EXPECT_EQ(read_file(p, "file", 1000).size(), 1000u);
  EXPECT_HAS(error_of([&] { read_file(p, "thing", 999); }),
             "thing '" + p + "': 1000 bytes, larger than the limit of 999 bytes");
  EXPECT_EQ(read_file(dir.write("empty", "")), "");
  EXPECT_HAS(error_of([&] { read_file(dir.path.string()); }), "is a folder");
}

// ---- safetensors headers and indexes --------------------------------------------------------------------

TEST(BoundedSafetensors, OverlappingOffsetsAreRefused) {
  const std::string d(16, '\0');
  std::string msg = safetensors_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                      d);
  EXPECT_HAS(msg, "t.safetensors");
  EXPECT_HAS(msg, "tensors 'a' [0, 8] and 'b' [4, 12] overlap");
  // The same range twice (an alias), and one inside another.
  EXPECT_HAS(safetensors_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                   "b": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}})",
                               d),
             "overlap");
  EXPECT_HAS(safetensors_error(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                               d),
             "overlap");
  // Adjacent and empty tensors do not overlap.
  const std::string ok = raw_safetensors(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                                         d);
  EXPECT_EQ(parse_safetensors(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), "t").size(), 3u);
}

TEST(BoundedSafetensors, OutOfRangeOffsetsAndSizeOverflowAreRefused) {
  const std::string d(8, '\0');
  EXPECT_HAS(safetensors_error(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", d),
             "truncated: tensor 'a' needs bytes up to");
  EXPECT_HAS(
      safetensors_error(
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [9223372036854775800, 9223372036854775807]}})", d),
      "span 7 bytes");
  // 2^62 elements of 4 bytes: numel fits int64, the byte count does not.
  EXPECT_HAS(safetensors_error(R"({"a": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 8]}})", d),
             "needs more than 2^63");
  EXPECT_HAS(
      safetensors_error(R"({"a": {"dtype": "F32", "shape": [3037000500, 3037000500], "data_offsets": [0, 8]}})", d),
      "needs more than 2^63");
  EXPECT_HAS(safetensors_error(
                 R"({"a": {"dtype": "F32", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "data_offsets": [0, 4]}})", d),
             "17 dimensions, more than the limit of 16");
  std::string deep = "{\"a\": {\"dtype\": \"F32\", \"shape\": [[[[[[1]]]]]], \"data_offsets\": [0, 4]}}";
  EXPECT_HAS(safetensors_error(deep, d), "nesting deeper than 4 levels");
}

TEST(BoundedSafetensors, IndexShardsAreFileNamesBesideTheIndex) {
  for (const char* shard : {"../x.safetensors", "/dev/zero", "sub/x.safetensors", "..", "."}) {
    SCOPED_TRACE(shard);
    const std::string text = std::string(R"({"weight_map": {"a": ")") + shard + "\"}}";
    EXPECT_HAS(error_of([&] { parse_checkpoint_index(text, "i.json"); }), "is not a file name beside the index");
  }
  EXPECT_HAS(error_of([] { parse_checkpoint_index(R"({"weight_map": {"a": "s", "a": "t"}})", "i.json"); }),
             "key 'a' appears twice");
  const auto wm =
      parse_checkpoint_index(R"({"metadata": {"total_size": 8}, "weight_map": {"a": "s1", "b": "s1"}})", "i.json");
  EXPECT_EQ(wm.size(), 2u);
  EXPECT_EQ(wm.at("b"), "s1");
}

// ---- checked size arithmetic ----------------------------------------------------------------------------

TEST(CheckedArithmetic, OverflowIsAnErrorNamingWhat) {
  EXPECT_EQ(checked_mul<int64_t>(3037000499, 3037000499, "x"), int64_t(3037000499) * 3037000499);
  EXPECT_HAS(error_of([] { checked_mul<int64_t>(3037000500, 3037000500, "image size"); }),
             "image size: 3037000500 x 3037000500 overflows a 64-bit signed integer");
  EXPECT_HAS(error_of([] { checked_mul<int>(65536, 65536, "w*h"); }), "w*h: 65536 x 65536 overflows a 32-bit");
  EXPECT_HAS(error_of([] { checked_add<size_t>(SIZE_MAX, 1, "bytes"); }), "bytes: ");
  EXPECT_EQ(checked_numel({2, 3, 4}, "t"), 24);
  EXPECT_EQ(checked_numel({}, "t"), 1);
  EXPECT_HAS(error_of([] { checked_numel({1 << 30, 1 << 30, 1 << 30}, "tensor"); }), "tensor: ");
  EXPECT_HAS(error_of([] { checked_numel({-1}, "tensor"); }), "negative dimension -1");
}
