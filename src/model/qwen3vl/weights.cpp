// Loading the vision encoder's weights: from a Hugging Face checkpoint (safetensors, any of
// bf16/fp16/fp32) or generated deterministically for the synthetic presets.
#include <cmath>
#include <filesystem>
#include <cstring>
#include <functional>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/checked.h"
#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"

namespace fovea::qwen3vl {

namespace {

using Shape = std::vector<int64_t>;
using Source = std::function<std::vector<float>(const std::string& name, const Shape& shape)>;

// Fills the Weights struct in the order of expected_tensors() from a source of named fp32 tensors.
Weights assemble(const VisionConfig& c, const Source& get) {
  Weights w;
  auto linear = [&](const std::string& p, int out, int in) {
    Linear l;
    l.out = out;
    l.in = in;
    l.w = get(p + ".weight", {out, in});
    l.b = get(p + ".bias", {out});
    return l;
  };
  auto norm = [&](const std::string& p, int width) {
    return Norm{get(p + ".weight", {width}), get(p + ".bias", {width})};
  };
  const int D = c.hidden, I = c.intermediate, M = c.merged_dim();
  w.patch_embed.out = D;
  w.patch_embed.in = c.patch_dim();
  w.patch_embed.w = get("patch_embed.proj.weight", {D, c.in_channels, c.temporal_patch, c.patch, c.patch});
  w.patch_embed.b = get("patch_embed.proj.bias", {D});
  w.pos = get("pos_embed.weight", {c.num_pos_embeddings, D});
  for (int i = 0; i < c.depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    Block blk;
    blk.norm1 = norm(b + "norm1", D);
    blk.qkv = linear(b + "attn.qkv", 3 * D, D);
    blk.proj = linear(b + "attn.proj", D, D);
    blk.norm2 = norm(b + "norm2", D);
    blk.fc1 = linear(b + "mlp.linear_fc1", I, D);
    blk.fc2 = linear(b + "mlp.linear_fc2", D, I);
    w.blocks.push_back(std::move(blk));
  }
  auto merger = [&](const std::string& p, int norm_width) {
    return Merger{norm(p + "norm", norm_width), linear(p + "linear_fc1", M, M),
                  linear(p + "linear_fc2", c.out_hidden, M)};
  };
  w.merger = merger("merger.", D);
  for (size_t k = 0; k < c.deepstack.size(); ++k)
    w.deepstack.push_back(merger("deepstack_merger_list." + std::to_string(k) + ".", M));
  return w;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Deterministic synthetic values: a counter-based hash (splitmix64) of (tensor name, index), so any
// tensor can be regenerated alone and in any order; values are rounded to bf16 like a real checkpoint.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<float> synthetic_tensor(const std::string& name, const Shape& shape) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  const int64_t n = checked_numel(shape, "synthetic tensor size");
  const bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool is_norm = name.find("norm") != std::string::npos;
  const int64_t fan_in = shape.size() >= 2 ? n / shape[0] : 1;
  // Scales that keep a 27-block trunk's activations O(1): weights ~ U(-1,1) * sqrt(3 / fan_in).
  const float scale = is_norm                      ? (bias ? 0.05f : 0.1f)
                      : bias                       ? 0.02f
                      : name == "pos_embed.weight" ? 0.5f
                                                   : std::sqrt(3.0f / float(fan_in));
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double u = double(splitmix64(h ^ uint64_t(i) * 0xD1B54A32D192ED03ull) >> 11) * (1.0 / 9007199254740992.0);
    const float x = float(2.0 * u - 1.0) * scale + (is_norm && !bias ? 1.0f : 0.0f);
    v[size_t(i)] = bf16_round(x);
  }
  return v;
}

}  // namespace

namespace {
template <class B, class L>
std::array<std::pair<std::string, L*>, 4> linears_of(B& b, size_t index) {
  const std::string p = "blocks." + std::to_string(index) + ".";
  return {{{p + "attn.qkv", &b.qkv},
           {p + "attn.proj", &b.proj},
           {p + "mlp.linear_fc1", &b.fc1},
           {p + "mlp.linear_fc2", &b.fc2}}};
}
}  // namespace

std::array<std::pair<std::string, Linear*>, 4> block_linears(Block& b, size_t index) {
  return linears_of<Block, Linear>(b, index);
}
std::array<std::pair<std::string, const Linear*>, 4> block_linears(const Block& b, size_t index) {
  return linears_of<const Block, const Linear>(b, index);
}

void check_fp8_linears(const Weights& w) {
  for (size_t i = 0; i < w.blocks.size(); ++i)
    for (const auto& [name, l] : block_linears(w.blocks[i], i)) fp8_linear_form(*l, name);
}

void quantize_block_linears(Model& m, std::array<int64_t, 2> block) {
  for (size_t i = 0; i < m.weights.blocks.size(); ++i)
    for (auto [name, l] : block_linears(m.weights.blocks[i], i)) {
      l->fp8 = quantize_fp8_weight(l->w, l->out, l->in, block);
      l->w = l->fp8->dequantized();
    }
}

Model synthetic_model(const VisionConfig& config) {
  config.validate();
  Model m;
  m.config = config;
  m.weights = assemble(m.config, synthetic_tensor);
  return m;
}

void add_outlier_channels(Model& m) {
  const int H = m.config.heads, hd = m.config.head_dim(), D = m.config.hidden;
  if (hd < 16) fail("add_outlier_channels: head_dim {} is below 16", hd);
  std::vector<int> keys = {2, 13};
  if (hd / 2 - 6 != 2) keys.push_back(hd / 2 - 6);  // at head_dim 16 it is channel 2 again
  for (Block& b : m.weights.blocks)
    for (int h = 0; h < H; ++h) {
      for (int c : keys) b.qkv.b[size_t(D + h * hd + c)] += 40.f;
      b.qkv.b[size_t(h * hd + 7)] += 15.f;
      const size_t v = size_t(2 * D + h * hd + 5);
      for (int i = 0; i < b.qkv.in; ++i) b.qkv.w[v * size_t(b.qkv.in) + size_t(i)] *= 20.f;
      b.qkv.b[v] *= 20.f;
    }
}

namespace {

// The tensors beside `<module>.weight` an FP8 release may hold: its scale (either layout) and the
// activation scales of activation_scheme "static" (read past: fovea computes in bf16).
constexpr const char* kScaleSuffixes[] = {"weight_scale_inv", "weight_scale"};
constexpr const char* kActivationSuffixes[] = {"input_scale", "activation_scale"};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// `<module>.<suffix>` -> `<module>` for the suffixes above, or "" for any other name.
std::string quant_sibling_module(const std::string& name, bool with_activation) {
  for (const char* suf : kScaleSuffixes)
    if (ends_with(name, std::string(".") + suf)) return name.substr(0, name.size() - std::strlen(suf) - 1);
  if (with_activation)
    for (const char* suf : kActivationSuffixes)
      if (ends_with(name, std::string(".") + suf)) return name.substr(0, name.size() - std::strlen(suf) - 1);
  return "";
}

// What load_model reads of a checkpoint, by name: everything under a vision prefix, and (a checkpoint
// of the vision tower alone, without prefix) each expected tensor and its quantization siblings.
// The rest (an FP8 release's language model) is validated and skipped, whatever its dtype.
TensorFilter vision_tensors(const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected) {
  auto known = std::make_shared<std::set<std::string>>();
  for (const auto& [name, shape] : expected) known->insert(name);
  return [known](const std::string& name) {
    if (name.rfind("model.visual.", 0) == 0 || name.rfind("visual.", 0) == 0 || known->count(name)) return true;
    const std::string module = quant_sibling_module(name, true);
    return !module.empty() && known->count(module + ".weight") > 0;
  };
}

// Missing tensors (listed) and shapes (expected vs found) are errors, unexpected tensors under the
// prefix a warning; a quantization sibling of an expected weight is expected.
void check_vision_tensors(const Checkpoint& ck, const std::string& prefix, const std::string& spec,
                          const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected) {
  std::vector<std::string> missing;
  std::map<std::string, bool> known;
  for (const auto& [name, shape] : expected) {
    known[name] = true;
    const TensorInfo* t = ck.find(prefix + name);
    if (!t) {
      missing.push_back(prefix + name);
      continue;
    }
    if (t->shape != shape)
      fail("model '{}': tensor {} has shape {} in {}, expected {}", spec, prefix + name, shape_str(t->shape), t->file,
           shape_str(shape));
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 12; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 12) list += fmt::format(", ... ({} more)", missing.size() - 12);
    fail("model '{}': {} vision tensor(s) missing from the checkpoint: {}", spec, missing.size(), list);
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : ck.tensors()) {
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rel = name.substr(prefix.size()), module = quant_sibling_module(rel, true);
    if (!known.count(rel) && (module.empty() || !known.count(module + ".weight")) &&
        (!prefix.empty() || name.find("language_model") == std::string::npos))
      unexpected.push_back(name);
  }
  if (!unexpected.empty() && !prefix.empty())
    warn(fmt::format("model '{}': {} unexpected tensor(s) under '{}' ignored (first: {})", spec, unexpected.size(),
                     prefix, unexpected.front()));
}

// Every scale under the prefix belongs to an F8_E4M3 weight of the layout quantization_config names,
// and every F8_E4M3 vision tensor is a linear weight with its scale, not listed as left unconverted.
void check_quantized_tensors(const Checkpoint& ck, const std::string& prefix, const std::string& spec,
                             const QuantConfig& q) {
  for (const auto& [name, t] : ck.tensors()) {
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string shown = escape_for_error(name, 200);
    if (t.dtype == DType::F8_E4M3) {
      if (!ends_with(name, ".weight") || t.shape.size() != 2)
        fail("model '{}': tensor '{}' is F8_E4M3 {}: only linear weights [out, in] may be FP8", spec, shown,
             shape_str(t.shape));
      const std::string module = name.substr(0, name.size() - 7);
      if (q.method.empty())
        fail("model '{}': tensor '{}' is F8_E4M3, but {} has no quantization_config to say how its scale is laid out",
             spec, shown, q.where.substr(0, q.where.rfind(": ")));
      if (listed_not_converted(q, module))
        fail("model '{}': tensor '{}' is F8_E4M3, but {} lists its module '{}' as not converted", spec, shown,
             q.where + (q.method == "fp8" ? ".modules_to_not_convert" : ".ignore"), escape_for_error(module, 200));
      if (!ck.find(module + "." + q.scale_suffix))
        fail(
            "model '{}': tensor '{}' is F8_E4M3 without its scale: '{}.{}' is not in the checkpoint ({}.quant_method "
            "\"{}\": {})",
            spec, shown, escape_for_error(module, 200), q.scale_suffix, q.where, q.method, q.scheme());
      continue;
    }
    const std::string module = quant_sibling_module(name, false);
    if (module.empty()) continue;
    const TensorInfo* w = ck.find(module + ".weight");
    if (!w)
      fail("model '{}': tensor '{}' is a scale without its tensor: '{}.weight' is not in the checkpoint", spec, shown,
           escape_for_error(module, 200));
    if (w->dtype != DType::F8_E4M3)
      fail("model '{}': tensor '{}' is a scale of '{}.weight', which is {}, not F8_E4M3", spec, shown,
           escape_for_error(module, 200), dtype_str(w->dtype));
    if (!ends_with(name, "." + q.scale_suffix))
      fail("model '{}': tensor '{}' is not the scale {}.quant_method \"{}\" names ('{}')", spec, shown, q.where,
           q.method, q.scale_suffix);
  }
}

}  // namespace

Model load_model(const std::string& spec) {
  Model m;
  if (auto c = synthetic_config(spec)) {
    m = synthetic_model(*c);
    if (synthetic_outliers(spec)) add_outlier_channels(m);
    return m;
  }
  if (spec.rfind("synthetic:", 0) == 0)
    fail("unknown synthetic model '{}' (built in: {}, each also with the suffix {})", spec,
         fmt::join(synthetic_names(), ", "), kOutliersSuffix);
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(spec, ec)) fail("model '{}': not a folder (and not a synthetic:<name> model)", spec);
  const std::string config_path = (fs::path(spec) / "config.json").string();
  const std::string config_text = read_file(config_path, "model config", config_json_limits().max_bytes);
  m.config = parse_config(config_text, config_path);
  m.config.name = spec;
  const QuantConfig quant = parse_quantization_config(config_text, config_path);
  const auto expected = expected_tensors(m.config);
  const Checkpoint ck = Checkpoint::open(spec, vision_tensors(expected));

  std::string prefix;
  for (const char* p : {"model.visual.", "visual.", ""})
    if (ck.find(std::string(p) + "patch_embed.proj.weight")) {
      prefix = p;
      break;
    }
  check_vision_tensors(ck, prefix, spec, expected);
  check_quantized_tensors(ck, prefix, spec, quant);
  std::map<std::string, Fp8Weight> stored;  // FP8 weights by name, kept for the blocks' linears
  m.weights = assemble(m.config, [&](const std::string& name, const Shape&) {
    const TensorInfo& t = *ck.find(prefix + name);
    if (t.dtype != DType::F8_E4M3) return t.to_float();
    Fp8Weight f =
        read_fp8_weight(t, *ck.find(prefix + name.substr(0, name.size() - 7) + "." + quant.scale_suffix), quant);
    std::vector<float> v = f.dequantized();
    stored.emplace(name, std::move(f));
    return v;
  });
  for (size_t i = 0; i < m.weights.blocks.size(); ++i)
    for (auto [module, l] : block_linears(m.weights.blocks[i], i))
      if (auto it = stored.find(module + ".weight"); it != stored.end()) l->fp8 = std::move(it->second);
  return m;
}

namespace {

// The one layout of a model's FP8 linears (none: no FP8 linear).
std::optional<std::array<int64_t, 2>> fp8_layout(const std::map<std::string, const Fp8Weight*>& fp8) {
  std::optional<std::array<int64_t, 2>> layout;
  for (const auto& [name, f] : fp8) {
    if (layout && *layout != f->block)
      fail("save model: '{}' is FP8 in blocks of [{}, {}], the others in [{}, {}]: a checkpoint holds one layout", name,
           f->block[0], f->block[1], (*layout)[0], (*layout)[1]);
    layout = f->block;
  }
  return layout;
}

bool is_per_channel_or_tensor(const std::array<int64_t, 2>& b) { return b[1] == 0 && (b[0] == 0 || b[0] == 1); }

// transformers' "fp8" for blocks, compressed-tensors for one scale per channel or per tensor; the
// mergers (nn.Linear too) run as stored in BF16.
nlohmann::ordered_json fp8_quantization_config(const std::array<int64_t, 2>& b) {
  const nlohmann::ordered_json skip = {"model.visual.merger", "model.visual.deepstack_merger_list", "lm_head"};
  if (!is_per_channel_or_tensor(b))
    return {{"quant_method", "fp8"},
            {"fmt", "e4m3"},
            {"activation_scheme", "dynamic"},
            {"weight_block_size", b},
            {"modules_to_not_convert", skip}};
  const nlohmann::ordered_json weights = {{"num_bits", 8},
                                          {"type", "float"},
                                          {"symmetric", true},
                                          {"strategy", b[0] == 1 ? "channel" : "tensor"},
                                          {"dynamic", false}};
  const nlohmann::ordered_json acts = {
      {"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"strategy", "token"}, {"dynamic", true}};
  return {
      {"quant_method", "compressed-tensors"},
      {"format", "float-quantized"},
      {"quantization_status", "compressed"},
      {"ignore", skip},
      {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", acts}}}}}};
}

void append_fp8(std::vector<TensorToWrite>& out, const std::string& module, const Fp8Weight& f) {
  out.push_back({module + ".weight", DType::F8_E4M3, {f.out, f.in}, f.codes, {}});
  std::vector<uint8_t> bytes(f.scales.size() * 4);
  std::memcpy(bytes.data(), f.scales.data(), bytes.size());
  std::vector<int64_t> shape;
  if (f.block[0] == 1 && f.block[1] == 0)
    shape = {f.out, 1};
  else if (f.block[0] == 0 && f.block[1] == 0)
    shape = {1};
  else
    shape = {(f.out + f.block[0] - 1) / f.block[0], (f.in + f.block[1] - 1) / f.block[1]};
  const char* suffix = is_per_channel_or_tensor(f.block) ? ".weight_scale" : ".weight_scale_inv";
  out.push_back({module + suffix, DType::F32, shape, std::move(bytes), {}});
}

}  // namespace

void save_model(const Model& m, const std::string& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) fail("save model: folder '{}' does not exist", folder);
  const VisionConfig& c = m.config;
  nlohmann::ordered_json v = {{"model_type", "qwen3_vl"},
                              {"depth", c.depth},
                              {"hidden_size", c.hidden},
                              {"intermediate_size", c.intermediate},
                              {"num_heads", c.heads},
                              {"in_channels", c.in_channels},
                              {"patch_size", c.patch},
                              {"temporal_patch_size", c.temporal_patch},
                              {"spatial_merge_size", c.merge},
                              {"out_hidden_size", c.out_hidden},
                              {"num_position_embeddings", c.num_pos_embeddings},
                              {"deepstack_visual_indexes", c.deepstack},
                              {"hidden_act", c.hidden_act}};
  nlohmann::ordered_json doc = {{"model_type", "qwen3_vl"}, {"vision_config", v}};
  // The tensors in expected_tensors() order, from the same assembly the loader uses, so a saved
  // model reads back identically.
  std::map<std::string, const std::vector<float>*> by_name;
  std::map<std::string, const Fp8Weight*> fp8_by_name;
  const Weights& w = m.weights;
  auto lin = [&](const std::string& p, const Linear& l) {
    by_name[p + ".weight"] = &l.w;
    by_name[p + ".bias"] = &l.b;
    if (l.fp8) fp8_by_name[p + ".weight"] = &*l.fp8;
  };
  auto nrm = [&](const std::string& p, const Norm& n) {
    by_name[p + ".weight"] = &n.w;
    by_name[p + ".bias"] = &n.b;
  };
  by_name["patch_embed.proj.weight"] = &w.patch_embed.w;
  by_name["patch_embed.proj.bias"] = &w.patch_embed.b;
  by_name["pos_embed.weight"] = &w.pos;
  for (size_t i = 0; i < w.blocks.size(); ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    nrm(b + "norm1", w.blocks[i].norm1);
    nrm(b + "norm2", w.blocks[i].norm2);
    lin(b + "attn.qkv", w.blocks[i].qkv);
    lin(b + "attn.proj", w.blocks[i].proj);
    lin(b + "mlp.linear_fc1", w.blocks[i].fc1);
    lin(b + "mlp.linear_fc2", w.blocks[i].fc2);
  }
  auto merger = [&](const std::string& p, const Merger& g) {
    nrm(p + "norm", g.norm);
    lin(p + "linear_fc1", g.fc1);
    lin(p + "linear_fc2", g.fc2);
  };
  merger("merger.", w.merger);
  for (size_t k = 0; k < w.deepstack.size(); ++k)
    merger("deepstack_merger_list." + std::to_string(k) + ".", w.deepstack[k]);
  std::vector<TensorToWrite> tensors;
  const std::optional<std::array<int64_t, 2>> layout = fp8_layout(fp8_by_name);
  if (layout) doc["quantization_config"] = fp8_quantization_config(*layout);
  for (const auto& [name, shape] : expected_tensors(c)) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) fail("save model: no weights for {}", name);
    if (const auto f = fp8_by_name.find(name); f != fp8_by_name.end()) {
      append_fp8(tensors, "model.visual." + name.substr(0, name.size() - 7), *f->second);
      continue;
    }
    TensorToWrite t{"model.visual." + name, DType::BF16, shape, {}, {}};
    t.bytes.resize(it->second->size() * 2);
    for (size_t i = 0; i < it->second->size(); ++i) {
      const uint16_t b = bf16_from_float((*it->second)[i]);
      std::memcpy(t.bytes.data() + 2 * i, &b, 2);
    }
    tensors.push_back(std::move(t));
  }
  write_safetensors((fs::path(folder) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(folder) / "config.json").string(), doc.dump(1) + "\n", "config");
}

}  // namespace fovea::qwen3vl
