// The scale book: dynamic, static and calibrating FP8 scales for every attention layer (docs/fp8.md §Scale book).
#include <algorithm>
#include <cmath>

#include "fovea/error.h"
#include "fovea/scales.h"

namespace fovea {

const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::DYNAMIC: return "dynamic";
    case ScaleMode::STATIC: return "static";
    case ScaleMode::CALIBRATE: return "calibrate";
  }
  return "?";
}

ScaleBook ScaleBook::dynamic(int num_layers) {
  if (num_layers <= 0) fail("scale book: the number of layers must be > 0, got {}", num_layers);
  ScaleBook b;
  b.mode_ = ScaleMode::DYNAMIC;
  b.num_layers_ = num_layers;
  b.amax_.resize(size_t(num_layers));
  for (auto& l : b.amax_)
    for (auto& h : l.t) amax_history_reset(h);
  return b;
}

ScaleBook ScaleBook::fixed(std::vector<QkvScales> scales) {
  if (scales.empty()) fail("scale book: static scales for zero layers");
  for (size_t i = 0; i < scales.size(); ++i)
    for (int t = 0; t < 3; ++t)
      if (!(scales[i][t] > 0.0f) || !std::isfinite(scales[i][t]))
        fail("scale book: layer {} {} scale {} is not a finite number > 0", i, kQkvNames[t], scales[i][t]);
  ScaleBook b;
  b.mode_ = ScaleMode::STATIC;
  b.num_layers_ = int(scales.size());
  b.fixed_ = std::move(scales);
  return b;
}

ScaleBook ScaleBook::calibrating(int num_layers, std::string save_path, float margin) {
  if (!(margin > 0.0f) || !std::isfinite(margin)) fail("scale book: calibration margin must be > 0, got {}", margin);
  if (save_path.empty()) fail("scale book: calibration needs a save path");
  ScaleBook b = dynamic(num_layers);
  b.mode_ = ScaleMode::CALIBRATE;
  b.save_path_ = std::move(save_path);
  b.margin_ = margin;
  return b;
}

void ScaleBook::check_layer(int layer) const {
  if (layer < 0 || layer >= num_layers_)
    fail("scale book: layer {} out of range (the book has {} layers)", layer, num_layers_);
}

QkvScales ScaleBook::record(int layer, float amax_q, float amax_k, float amax_v) {
  check_layer(layer);
  if (mode_ == ScaleMode::STATIC) return fixed_[size_t(layer)];
  auto& l = amax_[size_t(layer)];
  return {amax_history_record(l.t[Q], amax_q), amax_history_record(l.t[K], amax_k),
          amax_history_record(l.t[V], amax_v)};
}

QkvScales ScaleBook::scales(int layer) const {
  check_layer(layer);
  if (mode_ == ScaleMode::STATIC) return fixed_[size_t(layer)];
  const auto& l = amax_[size_t(layer)];
  return {l.t[Q].scale, l.t[K].scale, l.t[V].scale};
}

uint32_t ScaleBook::complete_forwards() const {
  if (mode_ == ScaleMode::STATIC) return 0;
  uint32_t n = UINT32_MAX;
  for (const auto& l : amax_)
    for (const auto& h : l.t) n = std::min(n, h.updates);
  return n;
}

uint64_t ScaleBook::nonfinite_count(int layer) const {
  check_layer(layer);
  if (mode_ == ScaleMode::STATIC) return 0;
  uint64_t n = 0;
  for (const auto& h : amax_[size_t(layer)].t) n += h.nonfinite;
  return n;
}

std::vector<QkvScales> ScaleBook::calibrated(float margin) const {
  if (mode_ == ScaleMode::STATIC) fail("scale book: static scales cannot be calibrated");
  std::vector<QkvScales> out(static_cast<size_t>(num_layers_));
  for (int i = 0; i < num_layers_; ++i) {
    const auto& l = amax_[size_t(i)];
    for (int t = 0; t < 3; ++t)
      if (l.t[t].filled == 0)
        fail("calibration: layer {} ({}): every {} amax seen was non-finite ({} of {}); no scale to save",
             i, scale_layer_name(i), kQkvNames[t], l.t[t].nonfinite, l.t[t].updates);
    out[size_t(i)] = {amax_history_scale(l.t[Q]) * margin, amax_history_scale(l.t[K]) * margin,
                      amax_history_scale(l.t[V]) * margin};
  }
  return out;
}

bool ScaleBook::after_forward() {
  if (mode_ != ScaleMode::CALIBRATE || calibration_written_) return false;
  if (complete_forwards() < uint32_t(kAmaxHistoryLen)) return false;
  write_scale_file(save_path_, calibrated(margin_));
  calibration_written_ = true;
  return true;
}

}  // namespace fovea
