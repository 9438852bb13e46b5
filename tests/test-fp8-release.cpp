// FP8 releases (docs/encoder.md §FP8 releases): checkpoints written as Qwen's FP8 releases and
// llm-compressor's FP8 re-quantizations are (sharded, model.safetensors.index.json, the language
// model's linears in F8_E4M3 with their scales, config.json's quantization_config). The vision tower
// loads, in BF16 or itself FP8 (block `weight_scale_inv` or per-channel `weight_scale`), its weights
// equal to a dequantization computed here independently, bit for bit; the commands that read a
// checkpoint accept it; every bad piece of quantization metadata is an error naming tensor and field.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fovea/fp8.h"
#include "fovea/io.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"
#include "image-encode.h"
#include "test-util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace fovea;
using namespace fovea::qwen3vl;
using namespace fovea::test;

namespace {

const std::string kTiny = std::string(FOVEA_TEST_DATA) + "/qwen3vl-tiny";

// ---- the reference, written without fovea's codecs -------------------------------------------------

// E4M3 by its definition: 4 exponent bits (bias 7), 3 mantissa bits, subnormals m * 2^-9.
float ref_e4m3(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const double v = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return float(c & 0x80 ? -v : v);
}

// float -> bf16 -> float, round to nearest even (finite values).
float ref_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    const float r = ref_bf16(v[i]);
    std::memcpy(&u, &r, 4);
    h[i] = uint16_t(u >> 16);
  }
  return bytes_of(h);
}

// ---- writing a release -----------------------------------------------------------------------------

// How the release quantizes: transformers' "fp8" (block scales `weight_scale_inv`, F32) or
// llm-compressor's "compressed-tensors" (per-channel `weight_scale` [out, 1], BF16 as it writes them).
struct Layout {
  std::string method = "fp8";
  std::array<int64_t, 2> block{128, 128};  // fp8's weight_block_size
  bool vision_fp8 = false;                 // the vision tower's linears FP8 too (else BF16, not converted)
};

struct Release {
  json config;
  std::vector<TensorToWrite> lm, vision;           // two shards
  std::map<std::string, std::vector<float>> want;  // vision weight -> the values fovea must load
};

bool is_linear_weight(const std::string& name, const std::vector<int64_t>& shape) {
  return shape.size() == 2 && name.find("pos_embed") == std::string::npos &&
         name.compare(name.size() - 7, 7, ".weight") == 0;
}

// w [out, in] quantized with one scale per [br, bc] block (edge blocks partial): amax / 448 per block.
// Returns the codes and scales, and puts the reference dequantization into `deq`.
std::pair<std::vector<uint8_t>, std::vector<float>> quantize(const std::vector<float>& w, int64_t out, int64_t in,
                                                             int64_t br, int64_t bc, bool bf16_scales,
                                                             std::vector<float>& deq) {
  const int64_t R = (out + br - 1) / br, C = (in + bc - 1) / bc;
  std::vector<float> scales(size_t(R * C), 0.f);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      float& s = scales[size_t(i / br * C + j / bc)];
      s = std::max(s, std::fabs(w[size_t(i * in + j)]) / 448.f);
    }
  for (float& s : scales) s = bf16_scales ? ref_bf16(s > 0 ? s : 1.f) : (s > 0 ? s : 1.f);
  std::vector<uint8_t> codes(w.size());
  deq.resize(w.size());
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      const size_t k = size_t(i * in + j);
      const float s = scales[size_t(i / br * C + j / bc)];
      codes[k] = e4m3_from_float(w[k] / s);
      deq[k] = ref_bf16(ref_e4m3(codes[k]) * s);
    }
  return {codes, scales};
}

void add_fp8(std::vector<TensorToWrite>& out, const std::string& name, const std::vector<float>& w, int64_t rows,
             int64_t cols, const Layout& l, std::vector<float>& deq) {
  const bool ct = l.method == "compressed-tensors";
  const int64_t br = ct ? 1 : l.block[0], bc = ct ? cols : l.block[1];
  auto [codes, scales] = quantize(w, rows, cols, br, bc, ct, deq);
  const std::string module = name.substr(0, name.size() - 7);
  out.push_back({name, DType::F8_E4M3, {rows, cols}, codes});
  const std::vector<int64_t> sshape = {(rows + br - 1) / br, (cols + bc - 1) / bc};
  if (ct)
    out.push_back({module + ".weight_scale", DType::BF16, sshape, bf16_bytes(scales)});
  else
    out.push_back({module + ".weight_scale_inv", DType::F32, sshape, bytes_of(scales)});
}

json quantization_config(const Layout& l) {
  if (l.method == "compressed-tensors") {
    const json w = {{"num_bits", 8},    {"type", "float"},       {"symmetric", true},         {"strategy", "channel"},
                    {"dynamic", false}, {"group_size", nullptr}, {"block_structure", nullptr}};
    const json a = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"strategy", "token"}, {"dynamic", true}};
    json ignore = {"lm_head"};
    if (!l.vision_fp8) ignore.push_back("re:.*visual.*");
    return {{"quant_method", "compressed-tensors"},
            {"format", "float-quantized"},
            {"quantization_status", "compressed"},
            {"ignore", ignore},
            {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", w}, {"input_activations", a}}}}}};
  }
  json skip = {"lm_head"};
  if (!l.vision_fp8) skip.push_back("model.visual");
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", l.block},
          {"modules_to_not_convert", skip}};
}

// The tiny golden model's vision tower (tests/data/qwen3vl-tiny, BF16) inside a release whose
// language model is FP8.
Release make_release(const Layout& l) {
  Release r;
  r.config = json::parse(read_file(kTiny + "/config.json"));
  r.config["quantization_config"] = quantization_config(l);
  const Checkpoint tiny = Checkpoint::open(kTiny + "/model.safetensors");
  for (const auto& [name, t] : tiny.tensors()) {
    std::vector<float> v = t.to_float();
    if (l.vision_fp8 && is_linear_weight(name, t.shape)) {
      add_fp8(r.vision, name, v, t.shape[0], t.shape[1], l, r.want[name]);
    } else {
      r.vision.push_back({name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.bytes)});
      r.want[name] = v;
    }
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  std::vector<float> unused;
  for (const char* p : {"mlp.down_proj", "mlp.gate_proj", "self_attn.q_proj"})
    add_fp8(r.lm, std::string("model.language_model.layers.0.") + p + ".weight", random(96 * 200), 96, 200, l, unused);
  r.lm.push_back({"model.language_model.embed_tokens.weight", DType::BF16, {40, 64}, bf16_bytes(random(40 * 64))});
  r.lm.push_back({"model.language_model.norm.weight", DType::BF16, {64}, bf16_bytes(random(64))});
  r.vision.push_back({"lm_head.weight", DType::BF16, {40, 64}, bf16_bytes(random(40 * 64))});
  return r;
}

// Shards and index as the releases lay them out.
void write_release(const fs::path& dir, const Release& r) {
  fs::create_directories(dir);
  const char* shards[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  write_safetensors((dir / shards[0]).string(), r.lm, {{"format", "pt"}});
  write_safetensors((dir / shards[1]).string(), r.vision, {{"format", "pt"}});
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (const auto& t : r.lm) index["weight_map"][t.name] = shards[0];
  for (const auto& t : r.vision) index["weight_map"][t.name] = shards[1];
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump(1), "index");
  write_file_atomic((dir / "config.json").string(), r.config.dump(1), "config");
}

// The loaded model's values by name, through save_model (bf16 values, which these all are; FP8
// linears written as their dequantized values).
std::map<std::string, std::vector<float>> loaded(Model m, const fs::path& dir) {
  fs::create_directories(dir);
  for (size_t b = 0; b < m.weights.blocks.size(); ++b)
    for (auto [name, l] : block_linears(m.weights.blocks[b], b)) l->fp8.reset();
  save_model(m, dir.string());
  const Checkpoint ck = Checkpoint::open((dir / "model.safetensors").string());
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, t] : ck.tensors()) out[name] = t.to_float();
  return out;
}

void expect_loads_as_reference(const Layout& l) {
  TempDir dir;
  const Release r = make_release(l);
  write_release(dir.path / "release", r);
  CaptureWarnings warnings;
  const Model m = load_model((dir.path / "release").string());
  EXPECT_TRUE(g_warnings.empty()) << g_warnings.front();
  const auto got = loaded(m, dir.path / "saved");
  ASSERT_EQ(got.size(), r.want.size());
  for (const auto& [name, want] : r.want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name), want) << name;  // bit for bit
  }
  const size_t fp8 = std::count_if(r.vision.begin(), r.vision.end(), [](const TensorToWrite& t) {
    return t.dtype == DType::F8_E4M3 && t.name.rfind("model.visual.", 0) == 0;
  });
  EXPECT_EQ(fp8 > 0, l.vision_fp8);
  // The language model was skipped by name, FP8 and all.
  const Checkpoint ck = Checkpoint::open((dir.path / "release").string(),
                                         [](const std::string& n) { return n.rfind("model.visual.", 0) == 0; });
  EXPECT_EQ(ck.skipped().count("model.language_model.layers.0.mlp.down_proj.weight"), 1u);
  EXPECT_EQ(ck.skipped().count("lm_head.weight"), 1u);
}

}  // namespace

// ---- what loads ------------------------------------------------------------------------------------

// Qwen's FP8 releases: the language model FP8, the vision tower BF16 (modules_to_not_convert).
TEST(Fp8Release, BlockScaledLanguageModelIsSkipped) {
  expect_loads_as_reference({"fp8", {128, 128}, false});
  TempDir dir;
  write_release(dir.path, make_release({}));
  const Model m = load_model(dir.path.string());
  EXPECT_EQ(m.weights.blocks[1].qkv.w, load_model(kTiny).weights.blocks[1].qkv.w);
  EXPECT_EQ(parse_quantization_config(read_file(dir.file("config.json")), "c").scheme(), "blocks of [128, 128]");
}

// The vision tower FP8 too, in blocks of [128, 128] (partial blocks: qkv is [192, 64]) and of
// [32, 48] (partial blocks in both dimensions of every linear).
TEST(Fp8Release, BlockScaledVisionTowerDequantizesAsTransformers) {
  expect_loads_as_reference({"fp8", {128, 128}, true});
  expect_loads_as_reference({"fp8", {32, 48}, true});
  expect_loads_as_reference({"fp8", {1, 1}, true});
}

// llm-compressor's FP8_DYNAMIC: per-channel weight_scale [out, 1] in BF16; vision BF16 or FP8.
TEST(Fp8Release, CompressedTensorsPerChannel) {
  expect_loads_as_reference({"compressed-tensors", {}, false});
  expect_loads_as_reference({"compressed-tensors", {}, true});
}

TEST(Fp8Release, QuantizationConfigIsRead) {
  const auto q = [](const json& qc) {
    return parse_quantization_config(json{{"quantization_config", qc}}.dump(), "m/config.json");
  };
  EXPECT_EQ(parse_quantization_config("{}", "c").method, "");
  const QuantConfig fp8 = q(quantization_config({"fp8", {128, 128}, false}));
  EXPECT_EQ(fp8.method, "fp8");
  EXPECT_EQ(fp8.scale_suffix, "weight_scale_inv");
  EXPECT_EQ(fp8.activation_scheme, "dynamic");
  EXPECT_EQ(fp8.not_converted, (std::vector<std::string>{"lm_head", "model.visual"}));
  EXPECT_TRUE(listed_not_converted(fp8, "model.visual.blocks.0.attn.qkv"));
  EXPECT_TRUE(listed_not_converted(fp8, "lm_head"));
  EXPECT_FALSE(listed_not_converted(fp8, "model.visualx.blocks.0"));
  EXPECT_EQ(expected_scale_shape(fp8, 4304, 1152), (std::vector<int64_t>{34, 9}));
  EXPECT_EQ(q({{"quant_method", "fp8"}}).block, (std::array<int64_t, 2>{128, 128}));  // the class default
  EXPECT_EQ(q({{"quant_method", "fp8"}, {"weight_block_size", nullptr}}).scheme(), "one per tensor");
  EXPECT_EQ(q({{"quant_method", "fp8"}, {"activation_scheme", "static"}}).activation_scheme, "static");
  const QuantConfig ct = q(quantization_config({"compressed-tensors", {}, false}));
  EXPECT_EQ(ct.scale_suffix, "weight_scale");
  EXPECT_EQ(ct.scheme(), "one per output channel");
  EXPECT_EQ(expected_scale_shape(ct, 96, 64), (std::vector<int64_t>{96, 1}));
  EXPECT_FALSE(listed_not_converted(ct, "model.visual.blocks.0.attn.qkv"));  // "re:" entries are not interpreted
}

// ---- the commands that read a checkpoint -----------------------------------------------------------

namespace {

int run_fovea(const std::string& args, const fs::path& err) {
  const std::string cmd = std::string("'") + FOVEA_BIN + "' " + args + " >/dev/null 2>'" + err.string() + "'";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string q(const fs::path& p) {
  std::string r = "'";
  r += p.string();
  r += '\'';
  return r;
}

}  // namespace

// encode, export-model and check-golden on both releases: the BF16-vision one gives exactly what the
// tiny BF16 checkpoint gives, the FP8-vision one exactly what its own BF16 export gives.
TEST(Fp8Release, CommandsReadIt) {
  TempDir dir;
  write_release(dir.path / "bf16-vision", make_release({}));
  write_release(dir.path / "fp8-vision", make_release({"fp8", {32, 48}, true}));
  write_release(dir.path / "ct-vision", make_release({"compressed-tensors", {}, true}));
  std::vector<uint8_t> rgb(64 * 48 * 3);
  for (size_t k = 0; k < rgb.size(); ++k) rgb[k] = uint8_t(k * 37 % 251);
  const std::vector<uint8_t> png = encode_png_rgb(64, 48, rgb);
  const fs::path img = dir.write("img.png", std::string(png.begin(), png.end())), err = dir.path / "err";
  auto encode = [&](const fs::path& model, const std::string& out) {  // every output tensor's bytes
    EXPECT_EQ(
        run_fovea("encode " + q(model) + " " + q(img) + " --device cpu --output-dtype f32 -o " + q(dir.path / out),
                  err),
        0)
        << slurp(err);
    std::map<std::string, std::vector<uint8_t>> t;
    const Checkpoint ck = Checkpoint::open((dir.path / out).string());
    for (const auto& [name, info] : ck.tensors()) t[name] = std::vector<uint8_t>(info.data, info.data + info.bytes);
    EXPECT_FALSE(t.empty());
    return t;
  };
  EXPECT_EQ(encode(dir.path / "bf16-vision", "a.safetensors"), encode(kTiny, "b.safetensors"));
  EXPECT_EQ(run_fovea("check-golden " + q(dir.path / "bf16-vision") + " " + q(kTiny + "/golden.safetensors") +
                          " --device cpu",
                      err),
            0)
      << slurp(err);
  for (const char* name : {"fp8-vision", "ct-vision"}) {
    const fs::path exported = dir.path / (std::string(name) + "-bf16");
    fs::create_directories(exported);
    ASSERT_EQ(run_fovea("export-model " + q(dir.path / name) + " " + q(exported), err), 0) << slurp(err);
    EXPECT_EQ(encode(dir.path / name, "c.safetensors"), encode(exported, "d.safetensors")) << name;
  }
}

// ---- bad quantization metadata ---------------------------------------------------------------------

namespace {

// The error load_model gives on a block-FP8 release (vision FP8, blocks of [128, 128]) after `edit`.
std::string load_error(const std::function<void(Release&)>& edit, Layout l = {"fp8", {128, 128}, true}) {
  TempDir dir;
  Release r = make_release(l);
  edit(r);
  write_release(dir.path / "m", r);
  return error_of([&] { load_model((dir.path / "m").string()); });
}

TensorToWrite* tensor(Release& r, const std::string& name) {
  for (auto& t : r.vision)
    if (t.name == name) return &t;
  ADD_FAILURE() << "no tensor " << name;
  return &r.vision.front();
}

void set_scale(Release& r, const std::string& name, float v) {
  TensorToWrite* t = tensor(r, name);
  std::memcpy(t->bytes.data(), &v, 4);
}

const std::string kQkv = "model.visual.blocks.0.attn.qkv";

}  // namespace

TEST(Fp8ReleaseErrors, ScalesNameTheTensor) {
  std::string m = load_error([](Release& r) {
    TensorToWrite* s = tensor(r, kQkv + ".weight_scale_inv");
    s->shape = {1, 2};
  });
  EXPECT_HAS(m, "tensor '" + kQkv + ".weight_scale_inv'");
  EXPECT_HAS(m, "shape [1, 2], expected [2, 1]");
  EXPECT_HAS(m, "quantization_config.weight_block_size");
  for (const float bad : {NAN, INFINITY, -1.f, 0.f}) {
    m = load_error([&](Release& r) { set_scale(r, kQkv + ".weight_scale_inv", bad); });
    EXPECT_HAS(m, kQkv + ".weight_scale_inv");
    EXPECT_HAS(m, "scales must be finite and positive");
  }
  // A finite scale whose block's largest code overflows: the value that does is named.
  m = load_error([](Release& r) { set_scale(r, kQkv + ".weight_scale_inv", 1e37f); });
  EXPECT_HAS(m, "tensor '" + kQkv + ".weight'");
  EXPECT_HAS(m, "dequantizes to");
  EXPECT_HAS(m, "inf (scale");
  EXPECT_HAS(m, "(scale '" + kQkv + ".weight_scale_inv')");
  m = load_error([](Release& r) {
    TensorToWrite* s = tensor(r, kQkv + ".weight_scale_inv");
    s->dtype = DType::F16;
    s->bytes.resize(s->bytes.size() / 2);
  });
  EXPECT_HAS(m, "a scale of dtype F16: FP8 scales are F32 or BF16");
  // The per-channel layout: [out, 1].
  m = load_error(
      [](Release& r) {
        tensor(r, kQkv + ".weight_scale")->shape = {1, 192};
      },
      {"compressed-tensors", {}, true});
  EXPECT_HAS(m, "tensor '" + kQkv + ".weight_scale'");
  EXPECT_HAS(m, "shape [1, 192], expected [192, 1]");
}

TEST(Fp8ReleaseErrors, MissingOrOrphanTensors) {
  std::string m = load_error([](Release& r) {
    std::erase_if(r.vision, [](const TensorToWrite& t) { return t.name == kQkv + ".weight_scale_inv"; });
  });
  EXPECT_HAS(m, "tensor '" + kQkv + ".weight' is F8_E4M3 without its scale: '" + kQkv +
                    ".weight_scale_inv' is not in the checkpoint");
  m = load_error([](Release& r) {
    r.vision.push_back(
        {"model.visual.blocks.0.attn.extra.weight_scale_inv", DType::F32, {1, 1}, bytes_of(std::vector<float>{1})});
  });
  EXPECT_HAS(m, "tensor 'model.visual.blocks.0.attn.extra.weight_scale_inv' is a scale without its tensor");
  m = load_error([](Release& r) {
    r.vision.push_back(
        {"model.visual.blocks.0.norm1.weight_scale_inv", DType::F32, {1, 1}, bytes_of(std::vector<float>{1})});
  });
  EXPECT_HAS(m,
             "tensor 'model.visual.blocks.0.norm1.weight_scale_inv' is a scale of "
             "'model.visual.blocks.0.norm1.weight', which is BF16, not F8_E4M3");
  // A compressed-tensors scale in an fp8 release.
  m = load_error([](Release& r) {
    for (auto& t : r.vision)
      if (t.name == kQkv + ".weight_scale_inv") t.name = kQkv + ".weight_scale";
  });
  EXPECT_HAS(m, kQkv + ".weight_scale");
  // FP8 where the format allows none: a bias.
  m = load_error([](Release& r) {
    TensorToWrite* b = tensor(r, kQkv + ".bias");
    b->dtype = DType::F8_E4M3;
    b->bytes.assign(192, 0x38);
  });
  EXPECT_HAS(m, "tensor '" + kQkv + ".bias' is F8_E4M3 [192]: only linear weights [out, in] may be FP8");
  m = load_error([](Release& r) { tensor(r, kQkv + ".weight")->bytes[5] = 0x7F; });
  EXPECT_HAS(m, "tensor '" + kQkv + ".weight'");
  EXPECT_HAS(m, "NaN (code 0x7f) at [0, 5]");
}

TEST(Fp8ReleaseErrors, ConfigFieldsAreNamed) {
  auto with = [](const std::string& key, const json& v) {
    return load_error([&](Release& r) { r.config["quantization_config"][key] = v; });
  };
  for (const json& b : {json{0, 128}, json{-128, 128}, json{128.5, 128}, json{128, 128, 1}, json{128}, json("128")}) {
    const std::string m = with("weight_block_size", b);
    EXPECT_HAS(m, "config.json: quantization_config.weight_block_size is");
    EXPECT_HAS(m, "a block size is two positive integers");
  }
  EXPECT_HAS(with("quant_method", "awq"), "quantization_config.quant_method is \"awq\": fovea reads \"fp8\"");
  EXPECT_HAS(with("fmt", "e5m2"), "quantization_config.fmt is \"e5m2\"");
  EXPECT_HAS(with("activation_scheme", "sometimes"), "quantization_config.activation_scheme is \"sometimes\"");
  EXPECT_HAS(with("modules_to_not_convert", "lm_head"), "quantization_config.modules_to_not_convert is not a list");
  const std::string listed = with("modules_to_not_convert", json{"lm_head", "model.visual.blocks.0"});
  EXPECT_HAS(listed, "tensor 'model.visual.blocks.0.attn.proj.weight' is F8_E4M3, but ");
  EXPECT_HAS(listed,
             "config.json: quantization_config.modules_to_not_convert lists its module "
             "'model.visual.blocks.0.attn.proj' as not converted");
  EXPECT_HAS(load_error([](Release& r) { r.config.erase("quantization_config"); }),
             "model.visual.blocks.0.attn.proj.weight' is F8_E4M3, but");
  const Layout ct{"compressed-tensors", {}, true};
  auto weights = [&](const std::string& key, const json& v) {
    return load_error(
        [&](Release& r) { r.config["quantization_config"]["config_groups"]["group_0"]["weights"][key] = v; }, ct);
  };
  EXPECT_HAS(weights("strategy", "group"), "config_groups.group_0.weights.strategy is \"group\"");
  EXPECT_HAS(weights("num_bits", 4), "config_groups.group_0.weights.num_bits is 4");
  EXPECT_HAS(weights("symmetric", false), "weights.symmetric is false: asymmetric weights");
  EXPECT_HAS(load_error([](Release& r) { r.config["quantization_config"]["format"] = "pack-quantized"; }, ct),
             "quantization_config.format is \"pack-quantized\"");
}

// ---- --fp8-linears on FP8 weights as stored --------------------------------------------------------

namespace {

// The release's F8_E4M3 codes and fp32 scales of `module` (relative to the vision prefix).
std::pair<std::vector<uint8_t>, std::vector<float>> file_fp8(const Release& r, const std::string& module) {
  std::pair<std::vector<uint8_t>, std::vector<float>> out;
  for (const TensorToWrite& t : r.vision) {
    if (t.name == "model.visual." + module + ".weight") out.first = t.bytes;
    if (t.name == "model.visual." + module + ".weight_scale_inv" ||
        t.name == "model.visual." + module + ".weight_scale") {
      TensorInfo v;
      v.dtype = t.dtype, v.shape = t.shape, v.data = t.bytes.data(), v.bytes = t.bytes.size();
      out.second = v.to_float();
    }
  }
  return out;
}

// x [rows, in] through the stored weight, in fp64 from the definition: each row quantized to E4M3
// with amax / 448, each 128-deep (block layout) or whole (per channel) partial sum of exact products
// scaled by the weight's scale for that block times the row's.
std::vector<double> stored_product(const std::vector<uint8_t>& codes, const std::vector<float>& scales, bool blocks,
                                   const std::vector<float>& bias, const std::vector<float>& x, int rows, int out,
                                   int in) {
  std::vector<double> y(size_t(rows) * out);
  const int kb = (in + 127) / 128;
  for (int r = 0; r < rows; ++r) {
    float amax = 0.f;
    for (int i = 0; i < in; ++i) amax = std::max(amax, std::fabs(x[size_t(r * in + i)]));
    const float xs = amax > 0.f ? amax / 448.f : 1.f;
    std::vector<double> xq(static_cast<size_t>(in));
    for (int i = 0; i < in; ++i) xq[size_t(i)] = ref_e4m3(e4m3_from_float(x[size_t(r * in + i)] / xs));
    for (int o = 0; o < out; ++o) {
      double acc = 0;
      for (int i = 0; i < in; ++i) {
        const double s = blocks ? scales[size_t((o / 128) * kb + i / 128)] : scales[size_t(o)];
        acc += xq[size_t(i)] * ref_e4m3(codes[size_t(o * in + i)]) * s;
      }
      y[size_t(r * out + o)] = acc * xs + bias[size_t(o)];
    }
  }
  return y;
}

void expect_runs_as_stored(const Layout& layout) {
  TempDir dir;
  const Release r = make_release(layout);
  write_release(dir.path, r);
  Model m = load_model(dir.path.string());
  EXPECT_FALSE(m.weights.merger.fc1.fp8) << "the mergers run in BF16: nothing kept";
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t b = 0; b < m.weights.blocks.size(); ++b)
    for (auto [module, l] : block_linears(m.weights.blocks[b], b)) {
      ASSERT_TRUE(l->fp8) << module;
      const auto [codes, scales] = file_fp8(r, module);
      EXPECT_EQ(l->fp8->codes, codes) << module;
      EXPECT_EQ(l->fp8->block, (layout.method == "fp8" ? layout.block : std::array<int64_t, 2>{1, 0})) << module;
      const int rows = 5;
      std::vector<float> x(size_t(rows) * l->in);
      for (float& v : x) v = nd(rng);
      for (int i = 0; i < l->in; ++i) x[size_t(i)] *= 300.f;  // a large row: its own scale
      std::fill(l->w.begin(), l->w.end(), std::nanf(""));     // re-quantizing w would give NaN
      const std::vector<float> y = linear_fp8(*l, x, rows);
      const std::vector<double> want =
          stored_product(codes, scales, layout.method == "fp8", l->b, x, rows, l->out, l->in);
      double num = 0, den = 0;
      for (size_t k = 0; k < y.size(); ++k) {
        ASSERT_TRUE(std::isfinite(y[k])) << module << " at " << k;
        num += (y[k] - want[k]) * (y[k] - want[k]), den += want[k] * want[k];
      }
      EXPECT_LT(std::sqrt(num / den), 1e-6) << module;  // fp32 sums of exact products
    }
}

}  // namespace

// A release's FP8 vision weights are kept as stored for the blocks' linears, and --fp8-linears
// (linear_fp8, the emulation the GPU is held to) uses them as they are: transformers' [128, 128]
// blocks (qkv [192, 64], fc1 [128, 64]: partial blocks) and llm-compressor's per-channel scales.
TEST(Fp8Release, Fp8LinearsRunTheStoredWeights) {
  expect_runs_as_stored({"fp8", {128, 128}, true});
  expect_runs_as_stored({"compressed-tensors", {}, true});
}

// Blocks cuBLASLt cannot scale ([32, 48]) are refused by --fp8-linears naming the linear and the
// block; without it the release runs (dequantized).
TEST(Fp8Release, Fp8LinearsRefuseOtherBlockSizes) {
  TempDir dir;
  write_release(dir.path, make_release({"fp8", {32, 48}, true}));
  const Model m = load_model(dir.path.string());
  const std::vector<float> pixels(size_t(4) * m.config.patch_dim(), 0.25f);
  ForwardOptions o;
  o.fp8_linears = true;
  const std::string e = error_of([&] { forward_cpu(m, pixels, {{1, 2, 2}}, o); });
  EXPECT_HAS(e, "blocks.0.attn.qkv");
  EXPECT_HAS(e, "blocks of [32, 48]");
  EXPECT_HAS(e, "run without --fp8-linears");
  EXPECT_FALSE(forward_cpu(m, pixels, {{1, 2, 2}}).merged.empty());
}

// save_model writes stored FP8 linears back as stored, with their quantization_config, and
// load_model reads them back identically; export-model --fp8-weights writes either layout, or none.
TEST(Fp8Release, SavedAsStoredAndReadBack) {
  for (const auto& [block, method] : {std::pair<std::array<int64_t, 2>, std::string>{{128, 128}, "fp8"},
                                      {{1, 0}, "compressed-tensors"},
                                      {{0, 0}, "compressed-tensors"}}) {
    TempDir dir;
    Model m = load_model(kTiny);
    quantize_block_linears(m, block);
    save_model(m, dir.path.string());
    const json cfg = json::parse(read_file(dir.file("config.json")));
    EXPECT_EQ(cfg["quantization_config"]["quant_method"], method);
    const Model back = load_model(dir.path.string());
    for (size_t b = 0; b < m.weights.blocks.size(); ++b)
      for (size_t k = 0; k < 4; ++k) {
        const Linear& want = *block_linears(m.weights.blocks[b], b)[k].second;
        const Linear& got = *block_linears(back.weights.blocks[b], b)[k].second;
        ASSERT_TRUE(got.fp8);
        EXPECT_EQ(got.fp8->codes, want.fp8->codes);
        EXPECT_EQ(got.fp8->scales, want.fp8->scales);
        EXPECT_EQ(got.fp8->block, block);
        EXPECT_EQ(got.w, want.w);
      }
    EXPECT_FALSE(back.weights.merger.fc2.fp8);
    EXPECT_EQ(back.weights.merger.fc2.w, m.weights.merger.fc2.w);
  }
  TempDir dir;
  const fs::path err = dir.path / "err";
  fs::create_directories(dir.path / "fp8");
  fs::create_directories(dir.path / "bf16");
  ASSERT_EQ(run_fovea("export-model " + q(kTiny) + " " + q(dir.path / "fp8") + " --fp8-weights blocks", err), 0)
      << slurp(err);
  ASSERT_EQ(run_fovea("export-model " + q(dir.path / "fp8") + " " + q(dir.path / "bf16") + " --fp8-weights none", err),
            0)
      << slurp(err);
  const Model fp8 = load_model((dir.path / "fp8").string()), bf16 = load_model((dir.path / "bf16").string());
  EXPECT_TRUE(fp8.weights.blocks[0].fc2.fp8);
  EXPECT_FALSE(bf16.weights.blocks[0].fc2.fp8);
  EXPECT_EQ(bf16.weights.blocks[0].fc2.w, fp8.weights.blocks[0].fc2.w);
  EXPECT_NE(run_fovea("export-model " + q(kTiny) + " " + q(dir.path / "bf16") + " --fp8-weights tiles", err), 0);
  EXPECT_HAS(slurp(err), "--fp8-weights");
}

// End to end on the CPU: --fp8-linears on a [128, 128]-block release against the exact forward of
// its own dequantized weights (what transformers computes from the file).
TEST(Fp8Release, Fp8LinearsEndToEndAgainstTheDequantizedForward) {
  TempDir dir;
  const Release r = make_release({"fp8", {128, 128}, true});
  write_release(dir.path, r);
  const Model m = load_model(dir.path.string());
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> pixels(size_t(16) * m.config.patch_dim());
  for (float& v : pixels) v = u(rng);
  const auto exact = forward_cpu(m, pixels, {{1, 4, 4}});
  ForwardOptions o;
  o.fp8_linears = true;
  const auto f8 = forward_cpu(m, pixels, {{1, 4, 4}}, o);
  double num = 0, den = 0;
  for (size_t k = 0; k < exact.merged.size(); ++k) {
    ASSERT_TRUE(std::isfinite(f8.merged[k]));
    num += double(f8.merged[k] - exact.merged[k]) * (f8.merged[k] - exact.merged[k]);
    den += double(exact.merged[k]) * exact.merged[k];
  }
  const double err = std::sqrt(num / den);
  std::printf("fp8 linears on stored [128, 128] blocks: rel_l2 %.3e against the dequantized forward\n", err);
  EXPECT_LT(err, 0.1);
  EXPECT_GT(err, 1e-4);  // the activations really went through E4M3
}
