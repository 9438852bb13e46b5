// FP8 releases: `quantization_config` of config.json (transformers' / Qwen's "fp8" and
// llm-compressor's "compressed-tensors") and the dequantization of FP8 linear weights to bf16 values
// at load (docs/encoder.md §FP8 releases).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/fp8.h"
#include "fovea/json.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"

namespace fovea::qwen3vl {

using json = nlohmann::json;

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// An optional string field: `fallback` when absent or null, an error when not a string.
std::string string_field(const json& o, const char* key, const std::string& where, const std::string& fallback) {
  if (!o.contains(key) || o.at(key).is_null()) return fallback;
  if (!o.at(key).is_string()) fail("{}.{} is {}, not a string", where, key, quote_for_error(o.at(key).dump()));
  return o.at(key).get<std::string>();
}

// A block size: two integers in 1..kMaxQuantBlock.
std::array<int64_t, 2> block_field(const json& b, const std::string& field) {
  const bool ok = b.is_array() && b.size() == 2 && std::all_of(b.begin(), b.end(), [](const json& d) {
                    return d.is_number_integer() && d.get<int64_t>() >= 1 && d.get<int64_t>() <= kMaxQuantBlock;
                  });
  if (!ok)
    fail("{} is {}: a block size is two positive integers (rows, columns) of at most {}", field,
         escape_for_error(b.dump(), 80), kMaxQuantBlock);
  return {b[0].get<int64_t>(), b[1].get<int64_t>()};
}

std::vector<std::string> module_list(const json& o, const char* key, const std::string& where) {
  std::vector<std::string> out;
  if (!o.contains(key) || o.at(key).is_null()) return out;
  const json& l = o.at(key);
  if (!l.is_array()) fail("{}.{} is not a list of module names", where, key);
  for (const json& m : l) {
    if (!m.is_string()) fail("{}.{} holds {}, not a module name", where, key, escape_for_error(m.dump(), 80));
    out.push_back(m.get<std::string>());
  }
  return out;
}

// transformers' FineGrainedFP8Config (quant_method "fp8"), as Qwen's FP8 releases write it.
void parse_fp8(const json& q, QuantConfig& c) {
  const std::string fmt = string_field(q, "fmt", c.where, "e4m3");
  if (fmt != "e4m3")
    fail("{}.fmt is {}: fovea reads FP8 releases in e4m3 (F8_E4M3 weights)", c.where, quote_for_error(fmt));
  c.activation_scheme = string_field(q, "activation_scheme", c.where, "dynamic");
  if (c.activation_scheme != "dynamic" && c.activation_scheme != "static")
    fail("{}.activation_scheme is {}, not \"dynamic\" or \"static\"", c.where, quote_for_error(c.activation_scheme));
  c.scale_suffix = "weight_scale_inv";
  c.block = {128, 128};  // FineGrainedFP8Config's default
  if (q.contains("weight_block_size"))
    c.block = q.at("weight_block_size").is_null()
                  ? std::array<int64_t, 2>{0, 0}
                  : block_field(q.at("weight_block_size"), c.where + ".weight_block_size");
  c.not_converted = module_list(q, "modules_to_not_convert", c.where);
}

// One config group's "weights" of compressed-tensors: 8-bit symmetric floats, per channel, tensor or block.
std::array<int64_t, 2> ct_weights(const json& w, const std::string& where) {
  if (!w.is_object()) fail("{} is not an object", where);
  if (!w.contains("num_bits") || w.at("num_bits") != 8)
    fail("{}.num_bits is {}: fovea reads 8-bit (FP8) weights", where,
         w.contains("num_bits") ? escape_for_error(w.at("num_bits").dump()) : std::string("missing"));
  if (string_field(w, "type", where, "") != "float")
    fail("{}.type is {}: fovea reads float (FP8 E4M3) weights", where,
         quote_for_error(string_field(w, "type", where, "")));
  if (w.contains("symmetric") && w.at("symmetric") != true)
    fail("{}.symmetric is {}: asymmetric weights (a zero point) are not supported", where, w.at("symmetric").dump());
  if (w.contains("dynamic") && w.at("dynamic") != false)
    fail("{}.dynamic is {}: weights must carry their scales in the checkpoint", where, w.at("dynamic").dump());
  const std::string strategy = string_field(w, "strategy", where, "");
  if (strategy == "channel") return {1, 0};
  if (strategy == "tensor") return {0, 0};
  if (strategy == "block")
    return block_field(w.contains("block_structure") ? w.at("block_structure") : json(), where + ".block_structure");
  fail("{}.strategy is {}: fovea reads \"channel\", \"tensor\" and \"block\" FP8 weights", where,
       quote_for_error(strategy));
}

// llm-compressor's compressed-tensors config (quant_method "compressed-tensors").
void parse_compressed_tensors(const json& q, QuantConfig& c) {
  auto check_format = [&](const json& o, const std::string& where) {
    const std::string f = string_field(o, "format", where, "float-quantized");
    if (f != "float-quantized")
      fail("{}.format is {}: fovea reads \"float-quantized\" (FP8) checkpoints", where, quote_for_error(f));
  };
  check_format(q, c.where);
  c.scale_suffix = "weight_scale";
  c.not_converted = module_list(q, "ignore", c.where);
  if (!q.contains("config_groups") || !q.at("config_groups").is_object() || q.at("config_groups").empty())
    fail("{}.config_groups is missing or empty", c.where);
  bool first = true;
  for (const auto& [name, g] : q.at("config_groups").items()) {
    const std::string gw = c.where + ".config_groups." + escape_for_error(name, 64);
    if (!g.is_object() || !g.contains("weights")) fail("{} has no \"weights\"", gw);
    check_format(g, gw);
    const std::array<int64_t, 2> b = ct_weights(g.at("weights"), gw + ".weights");
    if (!first && b != c.block)
      fail("{}.weights differs from the other groups' scale layout: fovea reads one layout per checkpoint", gw);
    c.block = b;
    first = false;
    const json a = g.contains("input_activations") ? g.at("input_activations") : json();
    c.activation_scheme = a.is_object() && a.contains("dynamic") && a.at("dynamic") == false ? "static" : "dynamic";
  }
}

bool is_literal(const std::string& p) {
  return p.rfind("re:", 0) != 0 && p.find_first_of("*?[]()|^$+\\{}") == std::string::npos;
}

}  // namespace

std::string QuantConfig::scheme() const {
  if (block[0] == 1 && block[1] == 0) return "one per output channel";
  if (block[0] == 0 && block[1] == 0) return "one per tensor";
  return "blocks of " + shape_text({block[0], block[1]});
}

QuantConfig parse_quantization_config(std::string_view text, const std::string& where) {
  const json doc = parse_json_bounded(text, config_json_limits(), where);
  QuantConfig c;
  c.where = where + ": quantization_config";
  if (!doc.is_object() || !doc.contains("quantization_config") || doc.at("quantization_config").is_null()) return c;
  const json& q = doc.at("quantization_config");
  if (!q.is_object()) fail("{} is not an object", c.where);
  if (!q.contains("quant_method") || !q.at("quant_method").is_string())
    fail("{}.quant_method is missing or not a string", c.where);
  c.method = q.at("quant_method").get<std::string>();
  if (c.method == "fp8") {
    parse_fp8(q, c);
  } else if (c.method == "compressed-tensors") {
    parse_compressed_tensors(q, c);
  } else {
    fail(
        "{}.quant_method is {}: fovea reads \"fp8\" (transformers' FP8 releases) and \"compressed-tensors\" "
        "(llm-compressor's FP8)",
        c.where, quote_for_error(c.method));
  }
  return c;
}

bool listed_not_converted(const QuantConfig& q, const std::string& module) {
  for (const std::string& p : q.not_converted) {
    if (p.empty() || !is_literal(p)) continue;
    if (module == p || module.rfind(p + ".", 0) == 0) return true;
    if (module.size() > p.size() && module.compare(module.size() - p.size(), p.size(), p) == 0 &&
        module[module.size() - p.size() - 1] == '.')
      return true;
  }
  return false;
}

std::vector<int64_t> expected_scale_shape(const QuantConfig& q, int64_t out, int64_t in) {
  auto blocks = [](int64_t n, int64_t b) { return b == 0 ? int64_t(1) : (n + b - 1) / b; };
  if (q.block[0] == 0 && q.block[1] == 0) return {1};  // per tensor; [] and [1, 1] accepted too
  return {blocks(out, q.block[0]), blocks(in, q.block[1])};
}

namespace {

// The scales as fp32, each checked finite and positive.
std::vector<float> checked_scales(const TensorInfo& scale, const std::vector<int64_t>& want, const std::string& why) {
  const std::string sn = escape_for_error(scale.name, 200);
  if (scale.dtype != DType::F32 && scale.dtype != DType::BF16)
    fail("tensor '{}' in '{}': a scale of dtype {}: FP8 scales are F32 or BF16", sn, scale.file,
         dtype_str(scale.dtype));
  const bool per_tensor = want == std::vector<int64_t>{1};
  const bool ok =
      scale.shape == want || (per_tensor && (scale.shape.empty() || scale.shape == std::vector<int64_t>{1, 1}));
  if (!ok)
    fail("tensor '{}' in '{}': shape {}, expected {} {}", sn, scale.file, shape_text(scale.shape), shape_text(want),
         why);
  std::vector<float> s = scale.to_float();
  for (size_t i = 0; i < s.size(); ++i)
    if (!std::isfinite(s[i]) || s[i] <= 0)
      fail("tensor '{}' in '{}': scale {} at flat index {}: scales must be finite and positive", sn, scale.file, s[i],
           i);
  return s;
}

}  // namespace

Fp8Weight read_fp8_weight(const TensorInfo& w, const TensorInfo& scale, const QuantConfig& q) {
  const std::string wn = escape_for_error(w.name, 200);
  if (w.dtype != DType::F8_E4M3 || w.shape.size() != 2)
    fail("tensor '{}' in '{}': {} {}, not an F8_E4M3 linear weight [out, in]", wn, w.file, dtype_str(w.dtype),
         shape_text(w.shape));
  Fp8Weight f;
  f.out = w.shape[0], f.in = w.shape[1];
  f.block = q.block;
  const std::string why = fmt::format("for the weight {}, {} ({})", shape_text(w.shape), q.scheme(),
                                      q.where + (q.method == "fp8" ? ".weight_block_size" : ".config_groups' weights"));
  f.scales = checked_scales(scale, expected_scale_shape(q, f.out, f.in), why);
  f.codes.assign(w.data, w.data + f.out * f.in);
  for (size_t k = 0; k < f.codes.size(); ++k)
    if ((f.codes[k] & 0x7F) == kE4M3NaN)
      fail("tensor '{}' in '{}': NaN (code {:#04x}) at [{}, {}]", wn, w.file, f.codes[k], int64_t(k) / f.in,
           int64_t(k) % f.in);
  // Every value must dequantize to a finite bf16. |e4m3| <= 448 and rounding is monotone, so a scale
  // with bf16(448 * s) finite bounds its block: the values are visited only to name one that is not.
  const bool bounded =
      std::all_of(f.scales.begin(), f.scales.end(), [](float s) { return std::isfinite(bf16_round(kE4M3Max * s)); });
  for (int64_t i = 0; i < (bounded ? 0 : f.out); ++i)
    for (int64_t j = 0; j < f.in; ++j) {
      const float x = bf16_round(e4m3_to_float(f.codes[size_t(i * f.in + j)]) * f.scale_at(i, j));
      if (!std::isfinite(x))
        fail("tensor '{}' in '{}': [{}, {}] dequantizes to {} (scale '{}')", wn, w.file, i, j, x,
             escape_for_error(scale.name, 200));
    }
  return f;
}

float Fp8Weight::scale_at(int64_t row, int64_t col) const {
  // Block (row / br, col / bc) of a [ceil(out / br), ceil(in / bc)] grid; 0: the whole dimension.
  const int64_t br = block[0] == 0 ? out : block[0], bc = block[1] == 0 ? in : block[1];
  const int64_t cols = bc == 0 ? 1 : (in + bc - 1) / bc;
  return scales[size_t((br == 0 ? 0 : row / br) * cols + (bc == 0 ? 0 : col / bc))];
}

std::vector<float> Fp8Weight::dequantized() const {
  std::vector<float> v(codes.size());
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j)
      v[size_t(i * in + j)] = bf16_round(e4m3_to_float(codes[size_t(i * in + j)]) * scale_at(i, j));
  return v;
}

Fp8Weight quantize_fp8_weight(const std::vector<float>& w, int64_t out, int64_t in, std::array<int64_t, 2> block) {
  if (out <= 0 || in <= 0 || int64_t(w.size()) != out * in || block[0] < 0 || block[1] < 0)
    fail("quantize_fp8_weight: {} values for [{}, {}] in blocks of [{}, {}]", w.size(), out, in, block[0], block[1]);
  Fp8Weight f;
  f.out = out, f.in = in, f.block = block;
  const int64_t br = block[0] == 0 ? out : block[0], bc = block[1] == 0 ? in : block[1];
  const int64_t R = (out + br - 1) / br, C = (in + bc - 1) / bc;
  f.scales.assign(size_t(R * C), 0.f);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      float& s = f.scales[size_t(i / br * C + j / bc)];
      s = std::max(s, std::fabs(w[size_t(i * in + j)]) / 448.f);
    }
  for (float& s : f.scales) {
    if (!std::isfinite(s)) fail("quantize_fp8_weight: the weight holds a non-finite value");
    if (s == 0.f) s = 1.f;
  }
  f.codes.resize(w.size());
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j)
      f.codes[size_t(i * in + j)] = e4m3_from_float(w[size_t(i * in + j)] / f.scales[size_t(i / br * C + j / bc)]);
  return f;
}

}  // namespace fovea::qwen3vl
