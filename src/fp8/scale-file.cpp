// Scale files: read, validate and write the per-layer FP8 Q/K/V scales (docs/fp8.md §Scale file).
// The format is vLLM's: a flat object of layer prefixes, or the same under "layers"; values are
// dequantization scales. Every error names the file, the layer and the problem.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/scales.h"

namespace fovea {

using json = nlohmann::json;

std::string scale_layer_name(int layer) { return fmt::format("visual.blocks.{}.attn.attn", layer); }

namespace {

// What a scale file may hold (see scales.h): far above a real file (27 layers, ~3 KB), far below
// what would cost real time or memory.
JsonLimits scale_file_limits() {
  JsonLimits l;
  l.max_bytes = size_t(4) << 20;             // 4096 layers of long decimals, indented, fit in ~1 MB
  l.max_depth = 8;                           // {"layers": {"<layer>": {"q": 1}}} is depth 3
  l.max_elements = size_t(1) << 20;          // 4096 layers x (entry + 3 values), or 27 layers with
                                             // 16 + 16 + 1152 fine scales each: ~32000
  l.max_object_keys = kMaxScaleLayers + 64;  // the layers object, plus a few unknown keys
  l.max_string_bytes = 1024;                 // a layer key is ~30 bytes, a prefix adds a few more
  return l;
}

// "visual.blocks.<i>.attn.attn", with any module prefix before "visual." (e.g. "model.visual."),
// parsed by hand in one pass (no regex: std::regex recursed once per character and crashed on a
// ~1 MB key). Returns -1 if the key is not a layer name, -2 if it is one whose index is too large.
int parse_layer_key(std::string_view key) {
  constexpr std::string_view kSuffix = ".attn.attn", kStem = "visual.blocks.";
  if (key.size() <= kSuffix.size() || key.substr(key.size() - kSuffix.size()) != kSuffix) return -1;
  key.remove_suffix(kSuffix.size());
  size_t digits = 0;
  while (digits < key.size() && key[key.size() - 1 - digits] >= '0' && key[key.size() - 1 - digits] <= '9') ++digits;
  if (digits == 0) return -1;
  const std::string_view number = key.substr(key.size() - digits);
  key.remove_suffix(digits);
  if (key.size() < kStem.size() || key.substr(key.size() - kStem.size()) != kStem) return -1;
  key.remove_suffix(kStem.size());
  if (!key.empty() && key.back() != '.') return -1;  // "xvisual.blocks." is not a module path
  int64_t index = 0;
  for (char c : number) {
    index = index * 10 + (c - '0');
    if (index >= kMaxScaleLayers) return -2;
  }
  return int(index);
}

std::string describe(const json& v) { return fmt::format("{} ({})", quote_for_error(v, 40), v.type_name()); }

// A dequantization scale as the file gives it: a JSON number, finite, > 0 and a positive finite
// float32; `what` names it in messages.
float scale_value(const std::string& path, const std::string& layer, const std::string& what, const json& v) {
  if (!v.is_number()) fail("scale file '{}': layer '{}': '{}' is {}, not a number", path, layer, what, describe(v));
  const double d = v.get<double>();
  if (!std::isfinite(d) || !(d > 0.0))
    fail("scale file '{}': layer '{}': '{}' is {}; a scale must be a finite number > 0", path, layer, what, v.dump());
  const float f = float(d);
  if (!std::isfinite(f) || !(f > 0.0f))
    fail("scale file '{}': layer '{}': '{}' = {} does not fit a positive finite float32", path, layer, what, v.dump());
  return f;
}

constexpr const char* kFineFields[] = {"fovea_q_head", "fovea_k_head", "fovea_v_channel", "fovea_k_mean"};
constexpr const char* kSplitField = "fovea_qk_split";    // optional, with the four above
constexpr const char* kGainField = "fovea_robust_gain";  // optional, with the four above

// K's mean as the file gives it: a JSON number that is a finite float32 (of any sign).
float mean_value(const std::string& path, const std::string& layer, const std::string& what, const json& v) {
  if (!v.is_number()) fail("scale file '{}': layer '{}': '{}' is {}, not a number", path, layer, what, describe(v));
  const double d = v.get<double>();
  const float f = float(d);
  if (!std::isfinite(d) || !std::isfinite(f))
    fail("scale file '{}': layer '{}': '{}' = {} is not a finite float32", path, layer, what, v.dump());
  return f;
}

// The layer's fine scales, if it has any: all four fields or none; q_head and k_head of one length
// (the heads), v_channel a multiple of it (heads x head_dim) and k_mean as long as v_channel.
std::optional<FineScales> read_fine(const std::string& path, const std::string& layer, const json& entry) {
  int present = 0;
  for (const char* f : kFineFields) present += entry.contains(f);
  if (present == 0) return std::nullopt;
  if (present != 4)
    fail(
        "scale file '{}': layer '{}': the fine scales come as all of fovea_q_head, fovea_k_head, fovea_v_channel "
        "and fovea_k_mean or none; {} of them are given",
        path, layer, present);
  FineScales out;
  std::vector<float>* into[] = {&out.q_head, &out.k_head, &out.v_channel, &out.k_mean};
  for (int i = 0; i < 4; ++i) {
    const json& a = entry.at(kFineFields[i]);
    if (!a.is_array() || a.empty())
      fail("scale file '{}': layer '{}': '{}' is {}, not a non-empty array of numbers", path, layer, kFineFields[i],
           describe(a));
    if (a.size() > size_t(kMaxFineScales))
      fail("scale file '{}': layer '{}': '{}' has {} values, more than the limit of {}", path, layer, kFineFields[i],
           a.size(), kMaxFineScales);
    for (size_t j = 0; j < a.size(); ++j) {
      const std::string what = fmt::format("{}[{}]", kFineFields[i], j);
      into[i]->push_back(i == 3 ? mean_value(path, layer, what, a[j]) : scale_value(path, layer, what, a[j]));
    }
  }
  if (out.k_head.size() != out.q_head.size() || out.v_channel.size() % out.q_head.size() != 0 ||
      out.k_mean.size() != out.v_channel.size())
    fail(
        "scale file '{}': layer '{}': fovea_q_head has {} values, fovea_k_head {}, fovea_v_channel {} and fovea_k_mean "
        "{}; expected one per head, one per head, heads x head_dim and heads x head_dim",
        path, layer, out.q_head.size(), out.k_head.size(), out.v_channel.size(), out.k_mean.size());
  if (entry.contains(kSplitField)) {  // optional: heads x fp8_split_pairs(head_dim) integers
    const json& a = entry.at(kSplitField);
    if (!a.is_array() || a.size() > size_t(kMaxFineScales))
      fail("scale file '{}': layer '{}': '{}' is {}, not an array of at most {} integers", path, layer, kSplitField,
           describe(a), kMaxFineScales);
    for (size_t j = 0; j < a.size(); ++j) {
      const json& x = a[j];  // a huge unsigned value must not wrap to -1
      if (!x.is_number_integer() ||
          (x.is_number_unsigned() ? x.get<uint64_t>() > uint64_t(kMaxFineScales) : x.get<int64_t>() < -1))
        fail("scale file '{}': layer '{}': '{}[{}]' is {}, not a rotary pair index or -1", path, layer, kSplitField, j,
             a[j].dump());
      out.qk_split.push_back(int32_t(a[j].get<int64_t>()));
    }
    const int heads = int(out.q_head.size());
    check_split_pairs(out.qk_split, heads, int(out.v_channel.size()) / heads,
                      fmt::format("scale file '{}': layer '{}': {}", path, layer, kSplitField));
  }
  if (entry.contains(kGainField)) out.robust_gain = scale_value(path, layer, kGainField, entry.at(kGainField));
  return out;
}

float read_value(const std::string& path, const std::string& layer, const json& entry, int t) {
  const std::string name = kQkvNames[t];
  const std::string alias = name + "_scale";
  const bool has_name = entry.contains(name), has_alias = entry.contains(alias);
  if (has_name && has_alias)
    fail("scale file '{}': layer '{}': both '{}' and '{}' are given (they are aliases; keep one)", path, layer, name,
         alias);
  if (!has_name && !has_alias) fail("scale file '{}': layer '{}': missing '{}' (or '{}')", path, layer, name, alias);
  return scale_value(path, layer, has_name ? name : alias, has_name ? entry.at(name) : entry.at(alias));
}

}  // namespace

ScaleFile read_scale_file(const std::string& path) {
  return parse_scale_file(read_file(path, "scale file", scale_file_limits().max_bytes), path);
}

ScaleFile parse_scale_file(std::string_view text, const std::string& path) {
  // The JSON limits bound the work; duplicate keys are refused there (JSON would keep the last of
  // a repeated key silently; a scale file must not).
  const json doc = parse_json_bounded(text, scale_file_limits(), fmt::format("scale file '{}'", path));

  ScaleFile out;
  out.path = path;
  const json* layers = &doc;
  if (!doc.is_object()) fail("scale file '{}': the top level is {}, not an object of layers", path, describe(doc));
  if (doc.contains("layers")) {
    if (!doc.at("layers").is_object())
      fail("scale file '{}': \"layers\" is {}, not an object of layers", path, describe(doc.at("layers")));
    layers = &doc.at("layers");
    out.nested = true;
  }
  if (layers->empty()) fail("scale file '{}': no layers in the file", path);
  if (layers->size() > size_t(kMaxScaleLayers))
    fail("scale file '{}': {} layers, more than the limit of {}", path, layers->size(), kMaxScaleLayers);

  for (const auto& [raw_key, entry] : layers->items()) {
    const std::string key = escape_for_error(raw_key, 128);  // keys go into messages: cut, escaped
    if (!entry.is_object())
      fail("scale file '{}': layer '{}': the entry is {}, not an object with q/k/v", path, key, describe(entry));
    const int idx = parse_layer_key(raw_key);
    if (idx == -2)
      fail("scale file '{}': key '{}': the layer index is over the limit of {}", path, key, kMaxScaleLayers - 1);
    if (idx < 0)
      fail("scale file '{}': key '{}' is not a layer name (expected 'visual.blocks.<i>.attn.attn')", path, key);
    if (out.layers.count(idx))
      fail("scale file '{}': layer {} is given twice ('{}' and '{}')", path, idx, out.names[idx], key);
    QkvScales s;
    s.q = read_value(path, key, entry, Q);
    s.k = read_value(path, key, entry, K);
    s.v = read_value(path, key, entry, V);
    for (const auto& [k2, unused] : entry.items()) {
      (void)unused;
      static const char* known[] = {"q",
                                    "k",
                                    "v",
                                    "q_scale",
                                    "k_scale",
                                    "v_scale",
                                    "fovea_q_head",
                                    "fovea_k_head",
                                    "fovea_v_channel",
                                    "fovea_k_mean",
                                    kSplitField,
                                    kGainField};
      if (std::find(std::begin(known), std::end(known), k2) != std::end(known)) continue;
      if (k2.starts_with("fovea_"))  // written by a newer fovea for a scheme this one cannot run
        fail(
            "scale file '{}': layer '{}': field '{}' is not one this fovea knows (a file from a newer fovea?); "
            "it knows fovea_q_head, fovea_k_head, fovea_v_channel, fovea_k_mean, fovea_qk_split, fovea_robust_gain",
            path, key, escape_for_error(k2));
      warn(fmt::format("scale file '{}': layer '{}': ignoring unknown field '{}'", path, key, escape_for_error(k2)));
    }
    if (auto fine = read_fine(path, key, entry))
      out.fine[idx] = std::move(*fine);
    else
      for (const char* f : {kSplitField, kGainField})
        if (entry.contains(f))
          fail("scale file '{}': layer '{}': '{}' is given without the fine scales it goes with (fovea_q_head, ...)",
               path, key, f);
    out.layers[idx] = s;
    out.names[idx] = key;
  }
  if (!out.fine.empty()) {  // for all layers or none, and of one shape
    for (const auto& [i, unused] : out.layers) {
      (void)unused;
      if (!out.fine.count(i))
        fail(
            "scale file '{}': layer '{}' has no fine scales (fovea_q_head, ...) but layer '{}' has; a file has them "
            "for every layer or for none",
            path, out.names[i], out.names[out.fine.begin()->first]);
    }
    const FineScales& first = out.fine.begin()->second;
    for (const auto& [i, f] : out.fine)
      if (f.q_head.size() != first.q_head.size() || f.v_channel.size() != first.v_channel.size())
        fail("scale file '{}': layer '{}' has fine scales for {} heads and {} channels, layer '{}' for {} and {}", path,
             out.names[i], f.q_head.size(), f.v_channel.size(), out.names[out.fine.begin()->first], first.q_head.size(),
             first.v_channel.size());
  }
  return out;
}

std::vector<QkvScales> scales_for_model(const ScaleFile& file, int num_layers) {
  std::vector<int> missing;
  for (int i = 0; i < num_layers; ++i)
    if (!file.layers.count(i)) missing.push_back(i);
  if (!missing.empty()) {
    std::vector<int> have;
    for (const auto& [i, s] : file.layers) have.push_back(i);
    fail(
        "scale file '{}': the model has {} attention layers (visual.blocks.0-{}); the file lacks {} of them "
        "(first missing: {}); the file has layers {}",
        file.path, num_layers, num_layers - 1, missing.size(), scale_layer_name(missing.front()), fmt::join(have, ","));
  }
  std::vector<int> extra;
  for (const auto& [i, s] : file.layers)
    if (i >= num_layers) extra.push_back(i);
  if (!extra.empty())
    warn(fmt::format("scale file '{}': ignoring layers {} (the model has {} attention layers)", file.path,
                     fmt::join(extra, ","), num_layers));
  std::vector<QkvScales> out;
  for (int i = 0; i < num_layers; ++i) out.push_back(file.layers.at(i));
  return out;
}

void write_scale_file(const std::string& path, const std::vector<QkvScales>& scales,
                      const std::vector<FineScales>* fine) {
  if (scales.empty()) fail("scale file '{}': nothing to write (zero layers)", path);
  if (fine && fine->size() != scales.size())
    fail("scale file '{}': {} layers of scales but {} of fine scales", path, scales.size(), fine->size());
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();  // layers in order
  for (size_t i = 0; i < scales.size(); ++i) {
    const auto& s = scales[i];
    for (int t = 0; t < 3; ++t)
      if (!std::isfinite(s[t]) || !(s[t] > 0.0f))
        fail("scale file '{}': refusing to write layer {} {} = {} (not a finite number > 0)", path, i, kQkvNames[t],
             s[t]);
    // nlohmann writes the shortest decimal that reads back to the same double; float -> double is
    // exact, so the file round-trips every float bit for bit.
    doc[scale_layer_name(int(i))] = {{"q", double(s.q)}, {"k", double(s.k)}, {"v", double(s.v)}};
    if (fine) {
      const FineScales& f = (*fine)[i];
      if (f.q_head.empty() || f.k_head.size() != f.q_head.size() || f.v_channel.empty() ||
          f.v_channel.size() % f.q_head.size() != 0 || f.v_channel.size() > size_t(kMaxFineScales) ||
          f.k_mean.size() != f.v_channel.size() ||
          (i > 0 && (f.q_head.size() != (*fine)[0].q_head.size() || f.v_channel.size() != (*fine)[0].v_channel.size())))
        fail(
            "scale file '{}': refusing to write layer {}'s fine scales: {} / {} / {} / {} values (one per head, one "
            "per "
            "head, heads x head_dim twice, the same for every layer)",
            path, i, f.q_head.size(), f.k_head.size(), f.v_channel.size(), f.k_mean.size());
      const std::vector<float>* parts[] = {&f.q_head, &f.k_head, &f.v_channel, &f.k_mean};
      for (int p = 0; p < 4; ++p) {
        nlohmann::ordered_json arr = nlohmann::ordered_json::array();
        for (const float x : *parts[p]) {
          if (!std::isfinite(x) || (p < 3 && !(x > 0.0f)))
            fail("scale file '{}': refusing to write layer {} {} value {} ({})", path, i, kFineFields[p], x,
                 p < 3 ? "not a finite number > 0" : "not finite");
          arr.push_back(double(x));
        }
        doc[scale_layer_name(int(i))][kFineFields[p]] = std::move(arr);
      }
      if (!f.qk_split.empty()) {
        const int heads = int(f.q_head.size());
        check_split_pairs(f.qk_split, heads, int(f.v_channel.size()) / heads,
                          fmt::format("scale file '{}': refusing to write layer {}'s {}", path, i, kSplitField));
        doc[scale_layer_name(int(i))][kSplitField] = f.qk_split;
      }
      if (f.robust_gain != 0.0f) {
        if (!std::isfinite(f.robust_gain) || !(f.robust_gain > 0.0f))
          fail("scale file '{}': refusing to write layer {} {} = {} (not a finite number > 0)", path, i, kGainField,
               f.robust_gain);
        doc[scale_layer_name(int(i))][kGainField] = double(f.robust_gain);
      }
    }
  }
  write_file_atomic(path, doc.dump(2) + "\n", "scale file");
}

}  // namespace fovea
