// Scale files: read, validate and write the per-layer FP8 Q/K/V scales (design.md §2).
// The format is vLLM's: a flat object of layer prefixes, or the same under "layers"; values are
// dequantization scales. Every error names the file, the layer and the problem.
#include <cmath>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/scales.h"

namespace fovea {

using json = nlohmann::json;

std::string scale_layer_name(int layer) { return fmt::format("visual.blocks.{}.attn.attn", layer); }

namespace {

// "visual.blocks.<i>.attn.attn", with any module prefix before "visual." (e.g. "model.visual.").
std::optional<int> parse_layer_key(const std::string& key) {
  static const std::regex re(R"(^(?:.*\.)?visual\.blocks\.(\d{1,6})\.attn\.attn$)");
  std::smatch m;
  if (!std::regex_match(key, m, re)) return std::nullopt;
  return std::stoi(m[1].str());
}

// Line and column (1-based) of a byte offset, for JSON syntax errors.
std::pair<size_t, size_t> line_col(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') { ++line; col = 1; } else { ++col; }
  }
  return {line, col};
}

std::string describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return fmt::format("{} ({})", s, v.type_name());
}

float read_value(const std::string& path, const std::string& layer, const json& entry, int t) {
  const std::string name = kQkvNames[t];
  const std::string alias = name + "_scale";
  const bool has_name = entry.contains(name), has_alias = entry.contains(alias);
  if (has_name && has_alias)
    fail("scale file '{}': layer '{}': both '{}' and '{}' are given (they are aliases; keep one)", path,
         layer, name, alias);
  if (!has_name && !has_alias)
    fail("scale file '{}': layer '{}': missing '{}' (or '{}')", path, layer, name, alias);
  const json& v = has_name ? entry.at(name) : entry.at(alias);
  const std::string& key = has_name ? name : alias;
  if (!v.is_number())
    fail("scale file '{}': layer '{}': '{}' is {}, not a number", path, layer, key, describe(v));
  const double d = v.get<double>();
  if (!std::isfinite(d) || !(d > 0.0))
    fail("scale file '{}': layer '{}': '{}' is {}; a scale must be a finite number > 0", path, layer, key,
         v.dump());
  const float f = float(d);
  if (!std::isfinite(f) || !(f > 0.0f))
    fail("scale file '{}': layer '{}': '{}' = {} does not fit a positive finite float32", path, layer,
         key, v.dump());
  return f;
}

}  // namespace

ScaleFile read_scale_file(const std::string& path) {
  const std::string text = read_file(path, "scale file");

  json doc;
  std::vector<std::string> keys;  // the object keys open at the current depth, for error messages
  std::vector<std::set<std::string>> seen;  // keys of each open object: JSON would keep the last of
                                            // a repeated key silently; a scale file must not
  try {
    doc = json::parse(text, [&](int depth, json::parse_event_t ev, json& j) {
      if (ev == json::parse_event_t::object_start) seen.emplace_back();
      if (ev == json::parse_event_t::object_end && !seen.empty()) seen.pop_back();
      if (ev == json::parse_event_t::key) {
        keys.resize(size_t(depth > 0 ? depth - 1 : 0));  // depth 1 = the top-level object's keys
        const std::string key = j.get<std::string>();
        if (!seen.empty() && !seen.back().insert(key).second)
          fail("scale file '{}': key '{}' appears twice{}", path, key,
               keys.empty() ? std::string() : fmt::format(" in '{}'", keys.back()));
        keys.push_back(key);
      }
      return true;
    });
  } catch (const json::out_of_range& e) {  // a number that overflows a double, e.g. 1e999
    const bool nested = keys.size() >= 3 && keys[0] == "layers";
    const std::string layer = keys.size() > (nested ? 1u : 0u) ? keys[nested ? 1 : 0] : "?";
    const std::string field = keys.size() > (nested ? 2u : 1u) ? keys[nested ? 2 : 1] : "?";
    fail("scale file '{}': layer '{}': '{}' is not a finite number (it overflows a double)", path, layer, field);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_col(text, e.byte == 0 ? 0 : e.byte - 1);
    std::string what = e.what();
    if (auto p = what.find(": "); p != std::string::npos) what = what.substr(p + 2);  // drop the id
    fail("scale file '{}': invalid JSON at line {}, column {}: {}", path, line, col, what);
  }

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

  for (const auto& [key, entry] : layers->items()) {
    if (!entry.is_object())
      fail("scale file '{}': layer '{}': the entry is {}, not an object with q/k/v", path, key, describe(entry));
    const auto idx = parse_layer_key(key);
    if (!idx)
      fail("scale file '{}': key '{}' is not a layer name (expected 'visual.blocks.<i>.attn.attn')", path, key);
    if (out.layers.count(*idx))
      fail("scale file '{}': layer {} is given twice ('{}' and '{}')", path, *idx, out.names[*idx], key);
    QkvScales s;
    s.q = read_value(path, key, entry, Q);
    s.k = read_value(path, key, entry, K);
    s.v = read_value(path, key, entry, V);
    for (const auto& [k2, unused] : entry.items()) {
      (void)unused;
      static const char* known[] = {"q", "k", "v", "q_scale", "k_scale", "v_scale"};
      if (std::find(std::begin(known), std::end(known), k2) == std::end(known))
        warn(fmt::format("scale file '{}': layer '{}': ignoring unknown field '{}'", path, key, k2));
    }
    out.layers[*idx] = s;
    out.names[*idx] = key;
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
    fail("scale file '{}': the model has {} attention layers (visual.blocks.0-{}); the file lacks {} of them "
         "(first missing: {}); the file has layers {}",
         file.path, num_layers, num_layers - 1, missing.size(), scale_layer_name(missing.front()),
         fmt::join(have, ","));
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

void write_scale_file(const std::string& path, const std::vector<QkvScales>& scales) {
  if (scales.empty()) fail("scale file '{}': nothing to write (zero layers)", path);
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();  // layers in order
  for (size_t i = 0; i < scales.size(); ++i) {
    const auto& s = scales[i];
    for (int t = 0; t < 3; ++t)
      if (!std::isfinite(s[t]) || !(s[t] > 0.0f))
        fail("scale file '{}': refusing to write layer {} {} = {} (not a finite number > 0)", path, i,
             kQkvNames[t], s[t]);
    // nlohmann writes the shortest decimal that reads back to the same double; float -> double is
    // exact, so the file round-trips every float bit for bit.
    doc[scale_layer_name(int(i))] = {{"q", double(s.q)}, {"k", double(s.k)}, {"v", double(s.v)}};
  }
  write_file_atomic(path, doc.dump(2) + "\n", "scale file");
}

}  // namespace fovea
