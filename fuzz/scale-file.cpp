// Fuzzes scale-file parsing (fovea::parse_scale_file, what read_scale_file runs): any text gives at
// most kMaxScaleLayers layers of finite positive scales, or a fovea::Error naming the file.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fovea/error.h"
#include "fovea/scales.h"

namespace {
void ignore_warning(const std::string&) {}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fovea::set_warning_sink(ignore_warning);  // unknown fields warn; not what is fuzzed
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const fovea::ScaleFile f = fovea::parse_scale_file(text, "fuzz");
    if (f.layers.empty() || f.layers.size() > size_t(fovea::kMaxScaleLayers)) std::abort();
    for (const auto& [i, s] : f.layers) {
      if (i < 0 || i >= fovea::kMaxScaleLayers) std::abort();
      for (int t = 0; t < 3; ++t)
        if (!std::isfinite(s[t]) || !(s[t] > 0)) std::abort();
    }
    // Fine scales: for every layer or none, one shape, every scale a finite positive float, every mean finite.
    if (!f.fine.empty() && f.fine.size() != f.layers.size()) std::abort();
    for (const auto& [i, fs] : f.fine) {
      const fovea::FineScales& first = f.fine.begin()->second;
      if (!f.layers.count(i) || fs.q_head.empty() || fs.k_head.size() != fs.q_head.size() ||
          fs.v_channel.size() % fs.q_head.size() != 0 || fs.v_channel.size() > size_t(fovea::kMaxFineScales) ||
          fs.q_head.size() != first.q_head.size() || fs.v_channel.size() != first.v_channel.size() ||
          fs.k_mean.size() != fs.v_channel.size())
        std::abort();
      for (const auto* part : {&fs.q_head, &fs.k_head, &fs.v_channel})
        for (const float x : *part)
          if (!std::isfinite(x) || !(x > 0)) std::abort();
      for (const float x : fs.k_mean)
        if (!std::isfinite(x)) std::abort();
    }
    (void)fovea::scales_for_model(f, int(f.layers.size()));  // throws when there are gaps
  } catch (const fovea::Error& e) {
    if (std::string_view(e.what()).find("'fuzz'") == std::string_view::npos) std::abort();
  }
  return 0;
}
