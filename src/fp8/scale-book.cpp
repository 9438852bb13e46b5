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
  b.guarded_.resize(b.fixed_.size());
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
  if (mode_ == ScaleMode::STATIC) {
    return guard_tensor(fixed_[size_t(layer)], amax_q, amax_k, amax_v, guarded_[size_t(layer)]);
  }
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
  if (has_fine()) {
    for (const auto& f : fine_) n = std::min(n, f.counts.updates);
    return n;
  }
  for (const auto& l : amax_)
    for (const auto& h : l.t) n = std::min(n, h.updates);
  return n;
}

uint64_t ScaleBook::nonfinite_count(int layer) const {
  check_layer(layer);
  if (mode_ == ScaleMode::STATIC) return 0;
  uint64_t n = 0;
  for (const auto& h : amax_[size_t(layer)].t) n += h.nonfinite;
  if (has_fine()) n += fine_[size_t(layer)].counts.nonfinite;
  return n;
}

FineHistory::FineHistory(int h, int hd) : heads(h), head_dim(hd) {
  if (h <= 0 || hd <= 0 || int64_t(h) * hd > kMaxFineScales)
    fail("scale book: fine scales for {} heads of {} channels (at most {} values)", h, hd, kMaxFineScales);
  const size_t cells = size_t(h) * size_t(hd);
  q_ring.assign(kAmaxHistoryLen * size_t(h), 0.0f);
  k_ring.assign(kAmaxHistoryLen * size_t(h), 0.0f);
  v_ring.assign(kAmaxHistoryLen * cells, 0.0f);
  k_sum.assign(cells, 0.0);
  k_hi.assign(cells, -INFINITY);
  k_lo.assign(cells, INFINITY);
  q_hi.assign(cells, 0.0f);
}

std::vector<int32_t> pick_split_pairs(int heads, int head_dim, const float* q_amax, const float* k_amax) {
  const int n = fp8_split_pairs(head_dim), half = head_dim / 2;
  std::vector<int32_t> out(size_t(heads) * size_t(n), -1);
  std::vector<int> order(static_cast<size_t>(half));
  std::vector<float> share(static_cast<size_t>(half));
  for (int h = 0; h < heads && n > 0; ++h) {
    const float *q = q_amax + size_t(h) * head_dim, *k = k_amax + size_t(h) * head_dim;
    for (int p = 0; p < half; ++p) {
      order[size_t(p)] = p;
      const float x = split_share(q[p], q[p + half], k[p], k[p + half]);
      share[size_t(p)] = x > 0.0f ? x : -1.0f;  // NaN too: an order for the sort, never split
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return share[size_t(a)] > share[size_t(b)]; });
    for (int i = 0; i < n; ++i)
      if (share[size_t(order[size_t(i)])] > 0.0f) out[size_t(h) * n + i] = order[size_t(i)];
  }
  return out;
}

float robust_gain(int heads, int head_dim, const float* q_amax, const float* k_amax, const float* k_smoothed,
                  const std::vector<int32_t>& qk_split) {
  const int n = fp8_split_pairs(head_dim), half = head_dim / 2;
  float gain = 0.0f;
  for (int h = 0; h < heads; ++h) {
    double tensor = 0.0, robust = 0.0;
    for (int c = 0; c < head_dim; ++c) {
      const size_t i = size_t(h) * size_t(head_dim) + size_t(c);
      const double q = q_amax[i], t = q * k_amax[i], r = q * k_smoothed[i];
      bool split = false;
      for (int j = 0; j < n && !qk_split.empty(); ++j) split |= qk_split[size_t(h) * n + j] == c % half;
      tensor += t * t;
      robust += split ? r * r / 256.0 : r * r;
    }
    // A head with no signal (all zero) gains nothing; a non-finite statistic counts as an outlier.
    const double g = tensor == 0.0 ? 1.0 : robust == 0.0 ? double(FLT_MAX) : std::sqrt(tensor / robust);
    gain = std::max(gain, std::isfinite(g) ? float(std::min(g, double(FLT_MAX))) : FLT_MAX);
  }
  return gain;
}

void check_split_pairs(const std::vector<int32_t>& split, int heads, int head_dim, const std::string& what) {
  if (split.empty()) return;
  const int n = fp8_split_pairs(head_dim);
  if (split.size() != size_t(heads) * size_t(n))
    fail("{}: {} split pairs, not {} ({} heads x {} at head_dim {})", what, split.size(), size_t(heads) * size_t(n),
         heads, n, head_dim);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < n; ++i) {
      const int32_t p = split[size_t(h) * n + i];
      if (p < -1 || p >= head_dim / 2)
        fail("{}: head {}: split pair {} is not a rotary pair (0..{}) or -1", what, h, p, head_dim / 2 - 1);
      for (int j = 0; j < i && p >= 0; ++j)
        if (split[size_t(h) * n + j] == p) fail("{}: head {}: split pair {} is given twice", what, h, p);
    }
}

void ScaleBook::enable_fine(int heads, int head_dim) {
  if (mode_ == ScaleMode::STATIC)
    fail("scale book: static scales keep no fine history (the robust scheme needs a file's fine scales)");
  if (has_fine()) {
    if (fine_[0].heads != heads || fine_[0].head_dim != head_dim)
      fail("scale book: the fine history is for {} heads of {}, not {} of {}", fine_[0].heads, fine_[0].head_dim, heads,
           head_dim);
    return;
  }
  fine_.assign(size_t(num_layers_), FineHistory(heads, head_dim));
}

QkvScales guard_tensor(const QkvScales& file, float amax_q, float amax_k, float amax_v, GuardCounts& counts) {
  const QkvScales s = {guarded_scale(file.q, amax_q), guarded_scale(file.k, amax_k), guarded_scale(file.v, amax_v)};
  counts.q += s.q != file.q, counts.k += s.k != file.k, counts.v += s.v != file.v;
  return s;
}

FineScales guard_fine(const FineScales& file, const FineBatch& batch, GuardCounts& counts) {
  const size_t H = file.q_head.size(), cells = file.v_channel.size();
  if (H == 0 || cells % H || file.k_head.size() != H || file.k_mean.size() != cells || batch.q_amax.size() != cells ||
      batch.v_amax.size() != cells || batch.k_hi.size() != cells || batch.k_lo.size() != cells)
    fail("the static guard: the fine scales and the batch statistics differ in shape");
  const size_t hd = cells / H;
  FineScales out = file;
  if (!batch.finite) return out;  // a non-finite value anywhere: the file's arrays, as the device keeps them
  bool raised[3] = {false, false, false};
  for (size_t h = 0; h < H; ++h) {
    float q = 0.0f, k = 0.0f;  // the head's amax of Q and of K minus the file's mean
    for (size_t i = h * hd; i < (h + 1) * hd; ++i) {
      q = std::max(q, batch.q_amax[i]);
      k = std::max(k, smoothed_amax(batch.k_hi[i], batch.k_lo[i], file.k_mean[i]));
    }
    out.q_head[h] = guarded_scale(file.q_head[h], q);
    out.k_head[h] = guarded_scale(file.k_head[h], k);
    raised[Q] |= out.q_head[h] != file.q_head[h];
    raised[K] |= out.k_head[h] != file.k_head[h];
  }
  for (size_t i = 0; i < cells; ++i) {
    out.v_channel[i] = guarded_scale(file.v_channel[i], batch.v_amax[i]);
    raised[V] |= out.v_channel[i] != file.v_channel[i];
  }
  counts.q += raised[Q], counts.k += raised[K], counts.v += raised[V];
  return out;
}

FineScales ScaleBook::guard_fine(int layer, const FineScales& file, const FineBatch& batch) {
  check_layer(layer);
  if (mode_ != ScaleMode::STATIC) fail("scale book: the static guard in a {} book", scale_mode_name(mode_));
  try {
    return fovea::guard_fine(file, batch, guarded_[size_t(layer)]);
  } catch (const Error& e) {
    fail("scale book: layer {}: {}", layer, e.what());
  }
}

GuardCounts ScaleBook::guarded(int layer) const {
  check_layer(layer);
  return mode_ == ScaleMode::STATIC ? guarded_[size_t(layer)] : GuardCounts{};
}

GuardCounts ScaleBook::guarded() const {
  GuardCounts all;
  for (const GuardCounts& g : guarded_) all += g;
  return all;
}

void ScaleBook::set_guarded(int layer, const GuardCounts& c) {
  check_layer(layer);
  if (mode_ != ScaleMode::STATIC) fail("scale book: static guard counts for a {} book", scale_mode_name(mode_));
  guarded_[size_t(layer)] = c;
}

FineScales ScaleBook::record_fine(int layer, const FineBatch& b) {
  check_layer(layer);
  if (!has_fine()) fail("scale book: the robust scheme's history is not enabled");
  return fovea::record_fine(fine_[size_t(layer)], b, "scale book: layer " + std::to_string(layer));
}

std::vector<FineScales> ScaleBook::calibrated_fine(float margin) const {
  if (!has_fine()) fail("scale book: the robust scheme's history is not enabled");
  std::vector<FineScales> out(fine_.size());
  for (size_t l = 0; l < fine_.size(); ++l) {
    const FineHistory& f = fine_[l];
    const int H = f.heads;
    const size_t cells = size_t(H) * size_t(f.head_dim);
    if (f.counts.filled == 0)
      fail("calibration: layer {} ({}): every forward seen had a non-finite value ({} of {}); no scale to save", l,
           scale_layer_name(int(l)), f.counts.nonfinite, f.counts.updates);
    FineScales& o = out[l];
    o.k_mean.resize(cells);
    o.v_channel.resize(cells);
    o.q_head.resize(size_t(H));
    o.k_head.assign(size_t(H), 0.0f);
    std::vector<float> k_chan(cells);
    for (size_t i = 0; i < cells; ++i) {
      o.k_mean[i] = float(f.k_sum[i] / f.counts.tokens);
      k_chan[i] = smoothed_amax(f.k_hi[i], f.k_lo[i], o.k_mean[i]);
      float& d = o.k_head[i / size_t(f.head_dim)];
      d = std::max(d, k_chan[i]);
      o.v_channel[i] =
          amax_to_scale(fine_ring_prev(f.v_ring.data() + i, int(cells), f.counts.filled, 0, false)) * margin;
    }
    for (int h = 0; h < H; ++h) {
      o.q_head[size_t(h)] = amax_to_scale(fine_ring_prev(f.q_ring.data() + h, H, f.counts.filled, 0, false)) * margin;
      o.k_head[size_t(h)] = amax_to_scale(o.k_head[size_t(h)]) * margin;
    }
    if (fp8_split_pairs(f.head_dim) > 0) o.qk_split = pick_split_pairs(H, f.head_dim, f.q_hi.data(), k_chan.data());
    std::vector<float> k_abs(cells);
    for (size_t i = 0; i < cells; ++i) k_abs[i] = std::max(std::fabs(f.k_hi[i]), std::fabs(f.k_lo[i]));
    o.robust_gain = robust_gain(H, f.head_dim, f.q_hi.data(), k_abs.data(), k_chan.data(), o.qk_split);
  }
  return out;
}

// The per-tensor scales of the forwards the fine histories recorded: the largest of the calibrated
// fine ones for Q and V, K's from its range (its fine scales are of K minus the mean).
std::vector<QkvScales> ScaleBook::per_tensor_of(const std::vector<FineScales>& fine, float margin) const {
  std::vector<QkvScales> out(fine.size());
  const auto top = [](const std::vector<float>& v) { return *std::max_element(v.begin(), v.end()); };
  for (size_t l = 0; l < out.size(); ++l) {
    const FineHistory& f = fine_[l];
    float k = 0.0f;
    for (size_t i = 0; i < f.k_hi.size(); ++i) k = std::max({k, std::fabs(f.k_hi[i]), std::fabs(f.k_lo[i])});
    out[l] = {top(fine[l].q_head), amax_to_scale(k) * margin, top(fine[l].v_channel)};
  }
  return out;
}

std::vector<QkvScales> ScaleBook::calibrated(float margin) const {
  if (mode_ == ScaleMode::STATIC) fail("scale book: static scales cannot be calibrated");
  std::vector<QkvScales> out(static_cast<size_t>(num_layers_));
  if (has_fine()) return per_tensor_of(calibrated_fine(margin), margin);
  for (int i = 0; i < num_layers_; ++i) {
    const auto& l = amax_[size_t(i)];
    for (int t = 0; t < 3; ++t)
      if (l.t[t].filled == 0)
        fail("calibration: layer {} ({}): every {} amax seen was non-finite ({} of {}); no scale to save", i,
             scale_layer_name(i), kQkvNames[t], l.t[t].nonfinite, l.t[t].updates);
    out[size_t(i)] = {amax_history_scale(l.t[Q]) * margin, amax_history_scale(l.t[K]) * margin,
                      amax_history_scale(l.t[V]) * margin};
  }
  return out;
}

void ScaleBook::save(const std::string& path, float margin) const {
  if (!has_fine()) return write_scale_file(path, calibrated(margin));
  const std::vector<FineScales> fine = calibrated_fine(margin);
  write_scale_file(path, per_tensor_of(fine, margin), &fine);
}

bool ScaleBook::after_forward() {
  if (mode_ != ScaleMode::CALIBRATE || calibration_written_) return false;
  if (complete_forwards() < uint32_t(kAmaxHistoryLen)) return false;
  save(save_path_, margin_);
  calibration_written_ = true;
  return true;
}

}  // namespace fovea
