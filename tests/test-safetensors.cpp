// Tests of safetensors checkpoints: exact round trips of BF16/F16/F32, sharded and single-file
// folders, and every malformed input (truncated, corrupt header, bad offsets, broken index) as a
// fovea::Error naming the file, the tensor and the problem, never a crash or an out-of-bounds read.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/io.h"
#include "fovea/safetensors.h"
#include "test-util.h"

namespace fs = std::filesystem;
using namespace fovea;
using namespace fovea::test;

namespace {

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) memcpy(b.data(), v.data(), b.size());
  return b;
}

TensorToWrite f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return {name, DType::F32, std::move(shape), bytes_of(v)};
}

// A safetensors file written by hand: the 8-byte little-endian length, the header text, the data.
std::string raw(const std::string& header, const std::string& data = "", uint64_t n = UINT64_MAX) {
  if (n == UINT64_MAX) n = header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char((n >> (8 * i)) & 0xFF);
  return s + header + data;
}

// The error of opening a hand-written file whose header is `header` followed by `data`.
std::string open_error(const TempDir& dir, const std::string& header, const std::string& data = "") {
  const std::string p = dir.write("bad.safetensors", raw(header, data));
  const std::string msg = error_of([&] { Checkpoint::open(p); });
  EXPECT_HAS(msg, p);
  return msg;
}

// The header JSON and data-start offset of a written file, read without fovea's reader.
std::pair<nlohmann::json, uint64_t> raw_header(const std::string& path) {
  const std::string s = read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(s[i]);
  return {nlohmann::json::parse(s.substr(8, n)), 8 + n};
}

// f16 value by its definition, in double, for the exhaustive check.
double f16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
  if (exp == 0x1F) v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  return sign ? -v : v;
}

}  // namespace

// ---- round trips -----------------------------------------------------------------------------------

TEST(Safetensors, RoundTripExactValues) {
  TempDir dir;
  const std::vector<uint16_t> f16 = {0x3C00, 0xC100, 0x7BFF, 0x0001, 0x7C00, 0xFC00, 0x8000, 0x03FF, 0x0400};
  const std::vector<float> f16_want = {1.0f,
                                       -2.5f,
                                       65504.0f,
                                       std::ldexp(1.0f, -24),
                                       INFINITY,
                                       -INFINITY,
                                       -0.0f,
                                       std::ldexp(1023.0f, -24),
                                       std::ldexp(1.0f, -14)};
  const std::vector<float> bf_vals = {1.0f, -3.5f, 0.0078125f, std::ldexp(1.0f, 100), -0.0f, std::ldexp(1.0f, -130)};
  std::vector<uint16_t> bf;
  for (float x : bf_vals) bf.push_back(bf16_from_float(x));
  const std::vector<float> f32_vals = {0.1f, -1e-40f, 3.4e38f, 42.0f, -7.25f, 1.0f / 3.0f};

  const std::string p = dir.file("m.safetensors");
  write_safetensors(p, {{"half", DType::F16, {3, 3}, bytes_of(f16)},
                        {"brain", DType::BF16, {2, 1, 3}, bytes_of(bf)},
                        f32("full", {6}, f32_vals)});
  const Checkpoint ck = Checkpoint::open(p);
  ASSERT_EQ(ck.tensors().size(), 3u);

  const TensorInfo* h = ck.find("half");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->dtype, DType::F16);
  EXPECT_EQ(h->shape, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(h->numel(), 9);
  EXPECT_EQ(h->bytes, 18u);
  EXPECT_EQ(h->file, p);
  EXPECT_EQ(memcmp(h->data, f16.data(), 18), 0);
  const std::vector<float> hv = h->to_float();
  ASSERT_EQ(hv.size(), f16_want.size());
  for (size_t i = 0; i < hv.size(); ++i) EXPECT_EQ(float_bits(hv[i]), float_bits(f16_want[i])) << "f16 #" << i;

  const TensorInfo* b = ck.find("brain");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::BF16);
  EXPECT_EQ(b->shape, (std::vector<int64_t>{2, 1, 3}));
  const std::vector<float> bv = b->to_float();
  ASSERT_EQ(bv.size(), bf_vals.size());
  for (size_t i = 0; i < bv.size(); ++i) EXPECT_EQ(float_bits(bv[i]), float_bits(bf_vals[i])) << "bf16 #" << i;

  const TensorInfo* f = ck.find("full");
  ASSERT_NE(f, nullptr);
  const std::vector<float> fv = f->to_float();
  ASSERT_EQ(fv.size(), f32_vals.size());
  for (size_t i = 0; i < fv.size(); ++i) EXPECT_EQ(float_bits(fv[i]), float_bits(f32_vals[i])) << "f32 #" << i;

  EXPECT_EQ(ck.find("missing"), nullptr);
  EXPECT_STREQ(dtype_str(DType::BF16), "BF16");
  EXPECT_STREQ(dtype_str(DType::F16), "F16");
  EXPECT_STREQ(dtype_str(DType::F32), "F32");
}

TEST(Safetensors, F16ToFloatAllBitPatterns) {
  TempDir dir;
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  const std::string p = dir.file("all.safetensors");
  write_safetensors(p, {{"all", DType::F16, {65536}, bytes_of(all)}});
  const std::vector<float> v = Checkpoint::open(p).find("all")->to_float();
  for (uint32_t i = 0; i < 65536; ++i) {
    const double want = f16_reference(uint16_t(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(v[i])) << std::hex << i;
    } else {
      EXPECT_EQ(double(v[i]), want) << std::hex << i;
      EXPECT_EQ(std::signbit(v[i]), std::signbit(want)) << std::hex << i;
    }
  }
}

TEST(Safetensors, MetadataAlignmentAndOffsets) {
  TempDir dir;
  const std::string p = dir.file("m.safetensors");
  // An odd-sized F16 tensor first: later tensors land unaligned, which to_float must tolerate.
  write_safetensors(
      p,
      {{"a", DType::F16, {3}, bytes_of(std::vector<uint16_t>{0x3C00, 0x4000, 0x4200})}, f32("b", {2}, {5.5f, -6.0f})},
      {{"format", "pt"}, {"producer", "fovea"}});
  const auto [h, start] = raw_header(p);
  EXPECT_EQ(start % 8, 0u);
  EXPECT_EQ(h["__metadata__"], (nlohmann::json{{"format", "pt"}, {"producer", "fovea"}}));
  EXPECT_EQ(h["a"]["data_offsets"], (nlohmann::json{0, 6}));
  EXPECT_EQ(h["b"]["data_offsets"], (nlohmann::json{6, 14}));
  EXPECT_EQ(h["b"]["dtype"], "F32");
  EXPECT_EQ(fs::file_size(p), start + 14);
  const Checkpoint ck = Checkpoint::open(p);
  EXPECT_EQ(ck.tensors().size(), 2u);  // __metadata__ is not a tensor
  EXPECT_EQ(ck.find("b")->to_float(), (std::vector<float>{5.5f, -6.0f}));
  EXPECT_EQ(ck.find("a")->to_float(), (std::vector<float>{1.0f, 2.0f, 3.0f}));

  // Without metadata there is no __metadata__ key, and the data is still 8-aligned.
  const std::string q = dir.file("n.safetensors");
  write_safetensors(q, {f32("x", {1}, {1.0f})});
  const auto [h2, start2] = raw_header(q);
  EXPECT_FALSE(h2.contains("__metadata__"));
  EXPECT_EQ(start2 % 8, 0u);
}

TEST(Safetensors, ScalarAndEmptyTensors) {
  TempDir dir;
  const std::string p = dir.file("m.safetensors");
  write_safetensors(p, {f32("scalar", {}, {2.5f}), f32("empty", {0, 4}, {}), f32("after", {1}, {9.0f})});
  const Checkpoint ck = Checkpoint::open(p);
  EXPECT_EQ(ck.find("scalar")->numel(), 1);
  EXPECT_EQ(ck.find("scalar")->to_float(), std::vector<float>{2.5f});
  EXPECT_EQ(ck.find("empty")->numel(), 0);
  EXPECT_TRUE(ck.find("empty")->to_float().empty());
  EXPECT_EQ(ck.find("after")->to_float(), std::vector<float>{9.0f});
}

TEST(Safetensors, MovedCheckpointKeepsMapping) {
  TempDir dir;
  const std::string p = dir.file("m.safetensors");
  write_safetensors(p, {f32("w", {2}, {1.0f, 2.0f})});
  Checkpoint a = Checkpoint::open(p);
  const uint8_t* data = a.find("w")->data;
  Checkpoint b = std::move(a);
  EXPECT_EQ(b.find("w")->data, data);
  Checkpoint c = Checkpoint::open(p);
  c = std::move(b);
  EXPECT_EQ(c.find("w")->to_float(), (std::vector<float>{1.0f, 2.0f}));
}

// ---- folders and shards ----------------------------------------------------------------------------

TEST(Checkpoint, FolderWithIndexAndTwoShards) {
  TempDir dir;
  write_safetensors(dir.file("model-00001-of-00002.safetensors"), {f32("a", {1}, {1.0f}), f32("b", {1}, {2.0f})});
  write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                    {f32("c", {2}, {3.0f, 4.0f}), f32("extra", {1}, {5.0f})});
  dir.write("model.safetensors.index.json",
            R"({"metadata": {"total_size": 20}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  for (const std::string& path : {dir.path.string(), dir.file("model.safetensors.index.json")}) {
    const Checkpoint ck = Checkpoint::open(path);
    EXPECT_EQ(ck.tensors().size(), 4u) << path;  // "extra" is not in the weight_map but still loaded
    EXPECT_EQ(ck.find("a")->file, dir.file("model-00001-of-00002.safetensors"));
    EXPECT_EQ(ck.find("c")->file, dir.file("model-00002-of-00002.safetensors"));
    EXPECT_EQ(ck.find("c")->to_float(), (std::vector<float>{3.0f, 4.0f}));
    EXPECT_EQ(ck.find("extra")->to_float(), std::vector<float>{5.0f});
  }
}

TEST(Checkpoint, FolderWithOneFile) {
  TempDir dir;
  write_safetensors(dir.file("model.safetensors"), {f32("w", {2}, {1.5f, -1.5f})});
  dir.write("config.json", "{}");
  const Checkpoint ck = Checkpoint::open(dir.path.string());
  ASSERT_EQ(ck.tensors().size(), 1u);
  EXPECT_EQ(ck.find("w")->file, dir.file("model.safetensors"));
  EXPECT_EQ(ck.find("w")->to_float(), (std::vector<float>{1.5f, -1.5f}));
}

TEST(Checkpoint, FolderWithSeveralFilesNoIndexLoadsAll) {
  TempDir dir;
  write_safetensors(dir.file("b.safetensors"), {f32("y", {1}, {2.0f})});
  write_safetensors(dir.file("a.safetensors"), {f32("x", {1}, {1.0f})});
  const Checkpoint ck = Checkpoint::open(dir.path.string());
  EXPECT_EQ(ck.tensors().size(), 2u);
  EXPECT_EQ(ck.find("y")->file, dir.file("b.safetensors"));
}

TEST(Checkpoint, FolderErrors) {
  TempDir dir;
  std::string msg = error_of([&] { Checkpoint::open(dir.path.string()); });
  EXPECT_HAS(msg, "no *.safetensors in " + dir.path.string());

  msg = error_of([&] { Checkpoint::open(dir.file("nope.safetensors")); });
  EXPECT_HAS(msg, dir.file("nope.safetensors"));
  EXPECT_HAS(msg, "does not exist");

  // The same tensor in two files: both are named.
  write_safetensors(dir.file("a.safetensors"), {f32("w", {1}, {1.0f})});
  write_safetensors(dir.file("b.safetensors"), {f32("w", {1}, {2.0f})});
  msg = error_of([&] { Checkpoint::open(dir.path.string()); });
  EXPECT_HAS(msg, "'w'");
  EXPECT_HAS(msg, dir.file("a.safetensors"));
  EXPECT_HAS(msg, dir.file("b.safetensors"));
}

TEST(Checkpoint, IndexErrors) {
  TempDir dir;
  const std::string idx = dir.file("model.safetensors.index.json");
  write_safetensors(dir.file("s1.safetensors"), {f32("a", {1}, {1.0f})});

  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  std::string msg = error_of([&] { Checkpoint::open(dir.path.string()); });
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "s2.safetensors");
  EXPECT_HAS(msg, "missing");

  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}})");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "'ghost'");
  EXPECT_HAS(msg, "absent");

  // A tensor that exists, but in another shard than the index says.
  write_safetensors(dir.file("s2.safetensors"), {f32("b", {1}, {2.0f})});
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors"}})");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, "tensor 'a' is listed in shard 's2.safetensors' but absent from it");

  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors")");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "not valid JSON");

  dir.write("model.safetensors.index.json",
            R"({"metadata": {"total_size": 1e999}, "weight_map": {"a": "s1.safetensors"}})");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "not valid JSON");

  dir.write("model.safetensors.index.json", R"({"metadata": {}})");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "weight_map");

  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": 7}})");
  msg = error_of([&] { Checkpoint::open(idx); });
  EXPECT_HAS(msg, "weight_map['a']");

  msg = error_of([&] { Checkpoint::open(dir.file("other.index.json")); });
  EXPECT_HAS(msg, dir.file("other.index.json"));
}

// ---- malformed files -------------------------------------------------------------------------------

TEST(SafetensorsErrors, ShortAndAbsurdHeader) {
  TempDir dir;
  for (size_t n : {0, 1, 7}) {
    const std::string p = dir.write("short.safetensors", std::string(n, '\x01'));
    const std::string msg = error_of([&] { Checkpoint::open(p); });
    EXPECT_HAS(msg, p);
    EXPECT_HAS(msg, "shorter than the 8-byte header length");
  }
  std::string p = dir.write("absurd.safetensors", raw("{}", "", 200'000'000));
  std::string msg = error_of([&] { Checkpoint::open(p); });
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "absurd");
  p = dir.write("huge.safetensors", raw("{}", "", UINT64_MAX - 1));  // 8 + n would wrap around
  EXPECT_HAS(error_of([&] { Checkpoint::open(p); }), "absurd");

  p = dir.write("trunc.safetensors", raw("{}", "", 64));
  msg = error_of([&] { Checkpoint::open(p); });
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "truncated: the header needs bytes up to 72, the file has 10");
}

TEST(SafetensorsErrors, HeaderNotJsonOrNotObject) {
  TempDir dir;
  std::string msg = open_error(dir, R"({"w": {"dtype": "F32",)");
  EXPECT_HAS(msg, "header is not valid JSON");
  EXPECT_HAS(msg, "parse error");  // the JSON library's own explanation follows
  EXPECT_HAS(open_error(dir, "[1, 2]"), "header is not a JSON object");
  EXPECT_HAS(open_error(dir, "\"\xff\xfe\""), "header is not valid JSON");  // not UTF-8
  EXPECT_HAS(open_error(dir, R"({"__metadata__": 3})"), "__metadata__ is not a JSON object");
  // A number that overflows a double is the JSON library's out_of_range, still a fovea::Error.
  EXPECT_HAS(open_error(dir, R"({"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}})"),
             "header is not valid JSON");
}

TEST(SafetensorsErrors, BadEntries) {
  TempDir dir;
  const std::string d8(8, '\0');
  struct Case {
    std::string entry, want;
  };
  const std::vector<Case> cases = {
      {R"(5)", "entry is not a JSON object"},
      {R"({"shape": [2], "data_offsets": [0, 8]})", "lacks one of dtype, shape, data_offsets"},
      {R"({"dtype": "F32", "data_offsets": [0, 8]})", "lacks one of dtype, shape, data_offsets"},
      {R"({"dtype": "F32", "shape": [2]})", "lacks one of dtype, shape, data_offsets"},
      {R"({"dtype": 32, "shape": [2], "data_offsets": [0, 8]})", "dtype is not a string"},
      {R"({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]})", "shape is not an array of integers"},
      {R"({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]})", "shape is not an array of integers"},
      {R"({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]})", "shape is not an array of integers"},
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [0]})", "data_offsets is not [begin, end]"},
      {R"({"dtype": "F32", "shape": [2], "data_offsets": "0-8"})", "data_offsets is not [begin, end]"},
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]})", "data_offsets is not [begin, end]"},
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 18446744073709551615]})",
       "data_offsets is not [begin, end]"},
      {R"({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]})",
       "dtype I64 is not supported: vision checkpoints hold BF16, F16, F32 or F8_E4M3 (with its scale)"},
      {R"({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]})", "negative dimension in shape [-2]"},
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]})", "end before begin"},
      {R"({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]})", "span 8 bytes, but shape [3] of F32 needs 12"},
      {R"({"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]})", "span 8 bytes, but shape [2] of BF16 needs 4"},
      {R"({"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]})", "needs more than 2^63"},
      {R"({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})",
       "truncated: tensor 'w' needs bytes up to "},  // header size varies; the file size is checked below
      {R"({"dtype": "F32", "shape": [2], "data_offsets": [8, 16]})", "truncated: tensor 'w' needs bytes up to"},
  };
  for (const Case& c : cases) {
    const std::string msg = open_error(dir, R"({"w": )" + c.entry + "}", d8);
    EXPECT_HAS(msg, c.want);
    EXPECT_HAS(msg, "tensor 'w'");
  }
  // The truncation message gives the byte the tensor needs and the file's actual size.
  const std::string h = R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})";
  EXPECT_HAS(open_error(dir, h, d8), "needs bytes up to " + std::to_string(8 + h.size() + 16) + ", the file has " +
                                         std::to_string(8 + h.size() + 8));
}

TEST(SafetensorsErrors, EveryTruncationIsAnError) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  write_safetensors(good,
                    {{"h", DType::F16, {3}, bytes_of(std::vector<uint16_t>{1, 2, 3})}, f32("w", {4}, {1, 2, 3, 4})},
                    {{"k", "v"}});
  const std::string full = read_file(good);
  const uint64_t start = raw_header(good).second;
  ASSERT_GT(full.size(), start);
  for (size_t cut = 0; cut < full.size(); ++cut) {
    const std::string p = dir.write("cut.safetensors", full.substr(0, cut));
    const std::string msg = error_of([&] { Checkpoint::open(p); });
    EXPECT_HAS(msg, p);
    // Tensors are checked in name order: a cut inside h's 6 bytes is reported for h, later ones for w.
    EXPECT_HAS(msg, cut < 8           ? "shorter than"
                    : cut < start     ? "truncated: the header"
                    : cut < start + 6 ? "truncated: tensor 'h'"
                                      : "truncated: tensor 'w'");
  }
  EXPECT_NO_THROW(Checkpoint::open(good));
}

// ---- writer errors ---------------------------------------------------------------------------------

TEST(WriteSafetensors, Errors) {
  TempDir dir;
  const std::string p = dir.file("out.safetensors");
  std::string msg = error_of([&] { write_safetensors(p, {f32("ok", {1}, {1}), f32("w", {3}, {1, 2})}); });
  EXPECT_HAS(msg, p);
  EXPECT_HAS(msg, "tensor 'w' has 8 bytes, but shape [3] of F32 needs 12");
  msg = error_of([&] { write_safetensors(p, {{"h", DType::BF16, {2}, std::vector<uint8_t>(2)}}); });
  EXPECT_HAS(msg, "tensor 'h' has 2 bytes, but shape [2] of BF16 needs 4");
  EXPECT_HAS(error_of([&] { write_safetensors(p, {f32("w", {1}, {1}), f32("w", {1}, {1})}); }), "repeated");
  EXPECT_HAS(error_of([&] { write_safetensors(p, {f32("__metadata__", {1}, {1})}); }), "reserved");
  EXPECT_HAS(error_of([&] { write_safetensors(p, {f32("w", {-1}, {})}); }), "invalid shape [-1]");
  EXPECT_FALSE(fs::exists(p));  // nothing written by a failed call
  EXPECT_HAS(error_of([&] { write_safetensors(dir.file("no/such/dir.safetensors"), {}); }), "does not exist");
}

// ---- tensors skipped by name (an FP8 release's language model, docs/encoder.md §FP8 releases) -------

// A tensor the filter turns away may have any dtype the format defines (FP8, integers, packed 4-bit):
// it is validated as every other, then only its name is kept, with its file. F8_E4M3 is read when kept.
TEST(SafetensorsSkip, SkippedTensorsAreValidatedNotRead) {
  TempDir dir;
  const std::string h = R"({"lm.a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
      "lm.b": {"dtype": "F8_E5M2", "shape": [4], "data_offsets": [16, 20]},
      "lm.c": {"dtype": "F4", "shape": [2, 4], "data_offsets": [20, 24]},
      "lm.d": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [24, 28]},
      "v.w": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [28, 32]}})";
  const std::string p = dir.write("m.safetensors", raw(h, std::string(32, '\x38')));
  const TensorFilter vision = [](const std::string& n) { return n.rfind("v.", 0) == 0; };
  const Checkpoint ck = Checkpoint::open(p, vision);
  ASSERT_EQ(ck.tensors().size(), 1u);
  EXPECT_EQ(ck.find("v.w")->dtype, DType::F8_E4M3);
  EXPECT_EQ(ck.find("v.w")->bytes, 4u);
  EXPECT_HAS(error_of([&] { ck.find("v.w")->to_float(); }), "its values need its scale");
  EXPECT_EQ(ck.skipped().size(), 4u);
  EXPECT_EQ(ck.skipped().at("lm.c"), p);
  EXPECT_FALSE(ck.find("lm.d"));
  // Without the filter, the integer tensor is refused as before.
  EXPECT_HAS(error_of([&] { Checkpoint::open(p); }), "dtype I64 is not supported");
}

TEST(SafetensorsSkip, SkippedTensorsKeepEveryHeaderCheck) {
  TempDir dir;
  const TensorFilter none = [](const std::string&) { return false; };
  auto err = [&](const std::string& entry, const std::string& data) {
    const std::string p = dir.write("bad.safetensors", raw(R"({"lm": )" + entry + "}", data));
    const std::string msg = error_of([&] { Checkpoint::open(p, none); });
    EXPECT_HAS(msg, p);
    EXPECT_HAS(msg, "tensor 'lm'");
    return msg;
  };
  const std::string d8(8, '\0');
  EXPECT_HAS(err(R"({"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]})", d8), "dtype Q7 is not supported");
  EXPECT_HAS(err(R"({"dtype": "I64", "shape": [2], "data_offsets": [0, 8]})", d8),
             "span 8 bytes, but shape [2] of I64 needs 16");
  EXPECT_HAS(err(R"({"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]})", d8),
             "truncated: tensor 'lm' needs bytes up to");
  EXPECT_HAS(err(R"({"dtype": "F4", "shape": [3], "data_offsets": [0, 1]})", d8), "needs part of a byte");
  EXPECT_HAS(err(R"({"dtype": "F8_E4M3", "shape": [-1], "data_offsets": [0, 1]})", d8), "negative dimension");
  // Overlap with a kept tensor is still found.
  const std::string p =
      dir.write("overlap.safetensors", raw(R"({"lm": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                          "v": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})",
                                           d8));
  EXPECT_HAS(error_of([&] { Checkpoint::open(p, none); }), "overlap in the data");
  // A sharded index still needs every listed tensor in its shard, skipped ones included.
  write_safetensors(dir.file("s1.safetensors"), {f32("a", {1}, {1})});
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}})");
  EXPECT_HAS(error_of([&] { Checkpoint::open(dir.path.string(), none); }), "'ghost' is listed in shard");
}
