// fovea/scales.h: FP8 scaling state for attention (docs/fp8.md).
//
// One dequantization scale s per tensor (Q, K, V) per attention layer: x8 = sat(rne(x / s)).
//   dynamic   - a ring of the last 16 amax values (max |x|) per tensor; every forward records its
//               amax, then s = max(ring) / 448 floored at the smallest normal float, then quantizes
//               with s ("current scaling": the current call can never overflow). Non-finite amax
//               values never enter the ring; they are counted.
//   static    - scales from a scale file, guarded: a forward whose amax passes a scale's range
//               (448 x s) quantizes that tensor with its own amax / 448 instead, and is counted
//               (guarded_scale; docs/fp8.md §Static guard).
//   calibrate - dynamic, and after exactly 16 complete forwards, s * margin for every layer is
//               written to a scale file, atomically.
// The per-tensor state is a plain struct (AmaxHistory) so a CUDA kernel can update it in device
// memory with the same function the CPU uses (amax_history_record), keeping the forward free of
// host synchronization and capturable in a CUDA graph.
#pragma once
#include <cfloat>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fovea/fp8.h"
#include "fovea/hd.h"

namespace fovea {

constexpr int kAmaxHistoryLen = 16;
constexpr float kMinScale = FLT_MIN;  // smallest normal float: the floor of a dynamic scale
constexpr float kDefaultScaleMargin = 1.5f;

enum QkvIndex : int { Q = 0, K = 1, V = 2 };
inline constexpr const char* kQkvNames[3] = {"q", "k", "v"};

struct QkvScales {
  float q = 1.0f, k = 1.0f, v = 1.0f;
  FOVEA_HD float operator[](int i) const { return i == 0 ? q : i == 1 ? k : v; }
  bool operator==(const QkvScales&) const = default;
};

// Dynamic-scaling state of one tensor of one layer. Plain data: lives in host or device memory.
struct AmaxHistory {
  float ring[kAmaxHistoryLen];  // amax values; slots [0, filled) hold data once the ring has wrapped
  int32_t pos;                  // next slot to write
  int32_t filled;               // number of valid entries, <= 16
  uint32_t updates;             // forwards recorded, finite or not
  uint32_t nonfinite;           // non-finite amax values ignored
  float scale;                  // the dequantization scale of the latest forward
};

FOVEA_HD void amax_history_reset(AmaxHistory& h) {
  for (int i = 0; i < kAmaxHistoryLen; ++i) h.ring[i] = 0.0f;
  h.pos = h.filled = 0;
  h.updates = h.nonfinite = 0;
  h.scale = kMinScale;
}

// amax / 448, floored at the smallest normal float.
FOVEA_HD float amax_to_scale(float amax) {
  const float s = amax / kE4M3Max;
  return s < kMinScale ? kMinScale : s;
}

// s = max(ring) / 448, floored at the smallest normal float (an empty ring gives the floor).
FOVEA_HD float amax_history_scale(const AmaxHistory& h) {
  float m = 0.0f;
  for (int i = 0; i < kAmaxHistoryLen; ++i)
    if (i < h.filled && h.ring[i] > m) m = h.ring[i];
  return amax_to_scale(m);
}

// One forward of dynamic scaling: record amax (unless non-finite), recompute the scale, return it.
// A ring position or fill outside [0, 16] (a caller's corrupt state: the C ABI refuses it on the host,
// but a device-resident state is not read back) restarts the history instead of writing out of it.
FOVEA_HD float amax_history_record(AmaxHistory& h, float amax) {
  if (h.pos < 0 || h.pos >= kAmaxHistoryLen || h.filled < 0 || h.filled > kAmaxHistoryLen) h.pos = h.filled = 0;
  h.updates += 1;
  const bool finite = (float_bits(amax) & 0x7F800000u) != 0x7F800000u;  // bit test: immune to fast-math
  if (finite) {
    h.ring[h.pos] = amax < 0.0f ? -amax : amax;
    h.pos = (h.pos + 1) % kAmaxHistoryLen;
    if (h.filled < kAmaxHistoryLen) h.filled += 1;
  } else {
    h.nonfinite += 1;
  }
  h.scale = amax_history_scale(h);
  return h.scale;
}

// Per-layer dynamic state: Q, K and V.
struct LayerAmax {
  AmaxHistory t[3];
};

// fovea's optional finer scales of one layer, for the FP8 scheme robust to outlier channels
// (docs/fp8.md §Outlier channels), in the fields "fovea_q_head", "fovea_k_head" (per head, of Q and of
// K smoothed by its mean), "fovea_v_channel" (per channel of V, heads x head_dim) and "fovea_k_mean"
// (the mean subtracted from K, per channel, heads x head_dim; any finite value). vLLM reads
// the file's q/k/v and not these; a fovea that meets a "fovea_" field it does not know refuses the
// file instead of ignoring it.
//
// "fovea_qk_split" (optional; heads x fp8_split_pairs(head_dim) integers): the rotary pairs whose Q and
// K are split into two E4M3 terms (below), per head in slot order, -1 for an unused slot.
//
// "fovea_robust_gain" (optional; one number, written by calibration): robust_gain() of the layer, the
// statistic `--fp8-scheme auto` reads to run the robust scheme on this layer or not.
struct FineScales {
  std::vector<float> q_head, k_head, v_channel, k_mean;
  std::vector<int32_t> qk_split;  // empty: no pair is split
  float robust_gain = 0.0f;       // 0: not given
  bool operator==(const FineScales&) const = default;
  bool empty() const { return q_head.empty(); }  // a layer without fine scales (per-tensor under auto)
};

// ---- which layers need the robust scheme (docs/fp8.md §Choosing a scheme) ---------------------------
// E4M3 rounds every value to about 2^-4 of itself, so the rounding error of a score q . k is about
// 2^-4 of sqrt(sum_c (q_c k_c)^2) whatever the scales. robust_gain estimates, from per-(head, channel)
// magnitudes (Q's amax, K's amax, and K's amax about its mean), how much the robust scheme cuts that:
// per head sqrt(sum_c (q_c k_c)^2 / sum_c (q_c k'_c w_c)^2), k' = K about its mean, w_c = 2^-4 on the
// split pairs' channels (their products keep about 2^-8) and 1 elsewhere; the layer's gain is its
// largest head's. Well-spread layers give about 1.1-1.3 (the split takes the largest of many similar
// products); a layer whose scores a few outlier channels dominate gives far more.
float robust_gain(int heads, int head_dim, const float* q_amax, const float* k_amax, const float* k_smoothed,
                  const std::vector<int32_t>& qk_split);
// `--fp8-scheme auto` with a calibrated file runs the robust scheme on the layers whose
// fovea_robust_gain is at least this, per-tensor scales on the rest.
constexpr float kAutoRobustGain = 2.0f;
inline bool auto_runs_robust(const FineScales& f) { return f.robust_gain >= kAutoRobustGain; }

// ---- split pairs (docs/fp8.md §Split pairs) ---------------------------------------------------------
// FP8 Q and K rows are zero-padded to whole wgmma K steps of 32 channels (fp8_qk_width). The robust
// scheme's rows are fp8_robust_qk_width wide: the same where the padding leaves room for 4 pairs or
// more (72 and 80), one more K step where a head_dim fills its steps (64, 128: +32 channels, room for
// 8 pairs, for +50% / +25% of Q K^T's tensor work on robust layers only). That room has space for
// fp8_split_pairs(hd) rotary pairs (channels p and p + hd/2, the
// two RoPE turns together) to be split: channel c keeps its E4M3 value x_hi = e4m3(x / s), and two
// padding slots a = fp8_split_slot(hd, i, j), a + 1 (split i, channel j of the pair) hold, in Q,
// (q_lo, q_hi) and, in K, (k_hi, k_lo), where x_lo = e4m3(x / s - x_hi) is the rounding error in E4M3.
// Q . K over the padded row then sums q_hi k_hi + q_lo k_hi + q_hi k_lo for that channel: its product to
// about 2^-8 relative instead of E4M3's 2^-4, with the same scales and no change to the kernel. Pairs
// that dominate a head's scores (outlier channels, through RoPE or not) are the ones to split.
constexpr int fp8_qk_width(int head_dim) { return (head_dim + 31) / 32 * 32; }
constexpr int fp8_robust_qk_width(int head_dim) {
  return fp8_qk_width(head_dim) - head_dim < 16 ? fp8_qk_width(head_dim) + 32 : fp8_qk_width(head_dim);
}
constexpr int fp8_split_pairs(int head_dim) {
  const int room = (fp8_robust_qk_width(head_dim) - head_dim) / 4, pairs = head_dim / 2;
  return head_dim % 2 ? 0 : room < pairs ? room : pairs;
}
constexpr int fp8_split_slot(int head_dim, int split, int j) { return head_dim + 4 * split + 2 * j; }
// A pair's rank for splitting: its largest |q| times its largest |k - k_mean| (over its two channels).
FOVEA_HD float split_share(float q0, float q1, float k0, float k1) { return (q0 > q1 ? q0 : q1) * (k0 > k1 ? k0 : k1); }
// Each head's fp8_split_pairs(hd) pairs of largest split_share > 0 (ties: the lower pair), in that
// order, then -1s: [H * fp8_split_pairs(hd)] from per-(head, channel) amaxes of Q and of K - k_mean.
// The device's selection (prepare.cu) takes the same pairs in the same order.
std::vector<int32_t> pick_split_pairs(int heads, int head_dim, const float* q_amax, const float* k_amax);
// Throws fovea::Error (prefixed by `what`) unless `split` is empty or [H * fp8_split_pairs(hd)] with each
// head's entries -1 or distinct pairs in [0, hd/2).
void check_split_pairs(const std::vector<int32_t>& split, int heads, int head_dim, const std::string& what);

// ---- the robust scheme's dynamic state (docs/fp8.md §Outlier channels) -----------------------------
// One forward's statistics of one layer's attention inputs (after RoPE): per (head, channel) K's sum,
// largest and smallest value, V's and Q's amax [H * hd]; the token count; and whether every value was
// finite.
struct FineBatch {
  std::vector<double> k_sum;
  std::vector<float> k_hi, k_lo, v_amax, q_amax;
  int64_t tokens = 0;
  bool finite = true;
};

// Counters of a FineHistory (plain data: host or device memory).
struct FineCounts {
  int32_t pos;         // next ring slot to write
  int32_t filled;      // valid ring slots, <= 16
  uint32_t updates;    // forwards recorded, finite or not
  uint32_t nonfinite;  // forwards with a non-finite value: not recorded
  double tokens;       // tokens of the recorded forwards (k_sum's count)
};

// Dynamic state of the robust scheme for one layer. Rings of the last 16 finite forwards' amax, per
// head of Q and of K minus that forward's K mean, and per channel of V; and, over every finite forward
// recorded, K's sum, largest and smallest value and Q's amax per channel (calibration's K mean, K range
// and split pairs). A
// forward quantizes K minus its own mean, Q and K with max(ring) / 448 per head and V with
// max(ring) / 448 per channel, its own amax included (it cannot overflow); the same code runs on the
// device (prepare.cu), and calibration writes from it.
struct FineHistory {
  int heads = 0, head_dim = 0;
  std::vector<float> q_ring, k_ring;  // [16][H]
  std::vector<float> v_ring;          // [16][H * hd]
  std::vector<double> k_sum;          // [H * hd]
  std::vector<float> k_hi, k_lo;      // [H * hd]
  std::vector<float> q_hi;            // [H * hd]: Q's amax per channel over every recorded forward
  FineCounts counts{};
  FineHistory() = default;
  FineHistory(int heads, int head_dim);
};

// One forward of the robust scheme for one layer, as ScaleBook::record_fine and the device's prepare
// do it: records `batch` into `h` (a non-finite batch is counted, not recorded) and returns the
// arrays to quantize it with (its own K mean and split pairs, the rings' scales with its amax). Throws
// if the batch is not for h's heads and head_dim; `what` prefixes the message.
FineScales record_fine(FineHistory& h, const FineBatch& batch, const std::string& what);

// A FineHistory as one block of bytes: the robust state of the C ABI and of DeviceFineHistory. A
// 16-byte header (kFineStateMagic, heads, head_dim, 0), then the arrays, the doubles first (the block
// is 8-byte aligned): byte offsets from the block's start.
constexpr uint32_t kFineStateMagic = 0x53524f46;  // "FORS" in memory
struct FineStateLayout {
  size_t cells, k_sum, counts, k_hi, k_lo, q_hi, q, k, v, bytes;
  FineStateLayout(int heads, int head_dim);
};
void pack_fine_state(const FineHistory& h, void* block);
// Reads a block written by pack_fine_state (or by forwards since), checking what a forward relies on:
// the header's shape, 0 <= pos < 16, 0 <= filled <= 16, pos == filled until the rings wrap, live ring
// slots finite and >= 0, K's sum and the token count finite, K's range empty or finite and ordered,
// Q's amax finite and >= 0. Throws fovea::Error naming `what` and the field.
FineHistory unpack_fine_state(const void* block, int heads, int head_dim, const std::string& what);

// amax of K - mean for one channel from K's extremes: exact, since x -> fl(x - mean) is monotonic.
FOVEA_HD float smoothed_amax(float hi, float lo, float mean) {
  const float a = hi - mean, b = mean - lo;
  return a > b ? a : b;
}
// The largest of ring slots [0, filled) of a cell (stride apart) other than `slot` when `keep`
// (the slot this batch then overwrites); 0 for an empty ring.
FOVEA_HD float fine_ring_prev(const float* ring, int stride, int filled, int slot, bool keep) {
  float m = 0.0f;
  for (int j = 0; j < kAmaxHistoryLen; ++j)
    if (j < filled && !(keep && j == slot) && ring[j * stride] > m) m = ring[j * stride];
  return m;
}
// A cell's scale after this batch: the largest of the ring before it (fine_ring_prev) and, when
// `keep` (the batch is recorded), its own amax `cur`; / 448, floored at kMinScale.
FOVEA_HD float fine_ring_scale(float prev, bool keep, float cur) {
  return amax_to_scale(keep && cur > prev ? cur : prev);
}

// ---- the static guard (docs/fp8.md §Static guard) -------------------------------------------------
// A static scale never clips: where a batch's amax passes the scale's range (448 x s), the batch is
// quantized with its own scale (amax / 448) instead. A non-finite amax keeps s (such a batch is the
// non-finite handling's, not the guard's). Written to run on the device too.
FOVEA_HD float guarded_scale(float fixed, float amax) {
  return amax > kE4M3Max * fixed && amax <= FLT_MAX ? amax_to_scale(amax) : fixed;
}

// How many times the guard switched each tensor of a layer (or of all layers) to the batch's scale:
// one count per forward and tensor, whatever the number of heads or channels it raised.
struct GuardCounts {
  uint64_t q = 0, k = 0, v = 0;
  uint64_t total() const { return q + k + v; }
  GuardCounts& operator+=(const GuardCounts& o) {
    q += o.q, k += o.k, v += o.v;
    return *this;
  }
  bool operator==(const GuardCounts&) const = default;
};

// One forward through the guard, per tensor: `file`'s scales guarded by the batch's amax (Q, K, V),
// the tensors it switched added to `counts`.
QkvScales guard_tensor(const QkvScales& file, float amax_q, float amax_k, float amax_v, GuardCounts& counts);
// The robust scheme's arrays `file` guarded by a batch's statistics, as the device's prepare step
// does: each head's Q scale by the head's Q amax, each head's K scale by the amax of K minus the
// file's mean, each channel's V scale by its amax; the mean and the split pairs stay the file's; a
// batch with a non-finite value keeps the file's arrays. Adds the tensors it switched to `counts`
// (once per tensor). Throws where the shapes differ.
FineScales guard_fine(const FineScales& file, const FineBatch& batch, GuardCounts& counts);

enum class ScaleMode { DYNAMIC, STATIC, CALIBRATE };
const char* scale_mode_name(ScaleMode m);

// The scales of every attention layer of a model, in one of the three modes.
class ScaleBook {
 public:
  static ScaleBook dynamic(int num_layers);
  static ScaleBook fixed(std::vector<QkvScales> scales);  // static mode
  // Calibration: dynamic, and after exactly 16 complete forwards writes the file (see Calibrator).
  static ScaleBook calibrating(int num_layers, std::string save_path, float margin);

  ScaleMode mode() const { return mode_; }
  int num_layers() const { return num_layers_; }

  // Dynamic/calibrate: record this forward's amax (max |x| of Q, K, V) for a layer and return the
  // scales to quantize it with. Static: returns the fixed scales, each guarded (guarded_scale) by
  // this forward's amax, and counts the tensors the guard switched.
  QkvScales record(int layer, float amax_q, float amax_k, float amax_v);
  // Static: the robust scheme's arrays `file` (the layer's fine scales) guarded by this forward's
  // statistics (the free guard_fine), counted in the layer's guard counts.
  FineScales guard_fine(int layer, const FineScales& file, const FineBatch& batch);
  // Static: the guard's counts of a layer, or of every layer (all zero in the other modes).
  GuardCounts guarded(int layer) const;
  GuardCounts guarded() const;
  // A layer's counts as the device's prepare step keeps them (running totals, copied back).
  void set_guarded(int layer, const GuardCounts& c);
  QkvScales scales(int layer) const;
  // A forward is complete once every layer has recorded it; returns how many are.
  uint32_t complete_forwards() const;
  uint64_t nonfinite_count(int layer) const;  // non-finite amax values ignored for this layer

  // Calibration only: call after each forward; writes the file after exactly the 16th complete
  // forward and returns true that once. Throws fovea::Error if writing fails.
  bool after_forward();
  bool calibration_written() const { return calibration_written_; }
  const std::string& save_path() const { return save_path_; }

  // s * margin for every layer, from the rings as they are now. Throws if a layer has an empty
  // ring (every amax it saw was non-finite), naming the layer.
  std::vector<QkvScales> calibrated(float margin) const;

  // Raw dynamic state, for copying to and from device memory.
  std::vector<LayerAmax>& amax_state() { return amax_; }
  const std::vector<LayerAmax>& amax_state() const { return amax_; }

  // The robust scheme (dynamic and calibrate): one FineHistory per layer for `heads` x `head_dim`,
  // which then replaces the per-tensor rings (forwards are counted there; calibration writes the
  // fine scales, and q/k/v from the same history: what per-tensor calibration would write).
  // Enabling it again for the same shape keeps the history; for another shape is an error.
  void enable_fine(int heads, int head_dim);
  bool has_fine() const { return !fine_.empty(); }
  // Records one forward of a layer and returns the arrays to quantize it with: k_mean and the split
  // pairs this batch's (a split changes no scale, so its pairs need no history).
  FineScales record_fine(int layer, const FineBatch& batch);
  std::vector<FineHistory>& fine_state() { return fine_; }
  const std::vector<FineHistory>& fine_state() const { return fine_; }
  // Writes the calibration to `path` (atomically, write_scale_file): per-tensor scales x margin,
  // and, with fine histories, the fine scales too. Throws as calibrated() and calibrated_fine() do.
  void save(const std::string& path, float margin) const;
  // Every layer's fine scales x margin from the histories as they are now (k_mean over every
  // recorded forward, K's scale from its range about that mean, the split pairs from Q's amax and
  // that range per channel). Throws, naming the layer, if one
  // recorded no finite forward.
  std::vector<FineScales> calibrated_fine(float margin) const;

 private:
  ScaleMode mode_ = ScaleMode::DYNAMIC;
  int num_layers_ = 0;
  std::vector<LayerAmax> amax_;       // dynamic and calibrate
  std::vector<QkvScales> fixed_;      // static
  std::vector<GuardCounts> guarded_;  // static: per layer
  std::vector<FineHistory> fine_;     // robust scheme: dynamic and calibrate
  std::string save_path_;             // calibrate
  float margin_ = kDefaultScaleMargin;
  bool calibration_written_ = false;
  void check_layer(int layer) const;
  std::vector<QkvScales> per_tensor_of(const std::vector<FineScales>& fine, float margin) const;
};

// ---- scale files (compatible with vLLM's) ---------------------------------------------------------
// { "visual.blocks.0.attn.attn": {"q": 0.0123, "k": 0.0110, "v": 0.0089}, ... }
// or the same object under a top-level "layers" key; q_scale/k_scale/v_scale alias q/k/v.
// Values are dequantization scales (amax / 448 x margin).

std::string scale_layer_name(int layer);  // "visual.blocks.<layer>.attn.attn"

struct ScaleFile {
  std::string path;
  bool nested = false;               // the entries were under "layers"
  std::map<int, QkvScales> layers;   // by block index
  std::map<int, std::string> names;  // the key each layer had in the file
  std::map<int, FineScales> fine;    // every layer's, or empty: a file has them for all or none
};

// Limits (a real file has 27 layers, ~3 KB): at most kMaxScaleLayers layers, each index below it;
// the text at most 4 MiB, nesting depth 8, keys 1 KiB; a key given twice is an error; a fine-scale
// array at most kMaxFineScales values.
constexpr int kMaxScaleLayers = 4096;
constexpr int kMaxFineScales = 65536;

// Reads and validates a whole scale file; throws fovea::Error naming the file, the layer and the
// problem (nothing is half-loaded: the result is complete or not returned at all). Only a regular
// file is read (a FIFO or a device is refused without blocking).
ScaleFile read_scale_file(const std::string& path);
// The same from the file's text (`path` names it in messages): what read_scale_file runs.
ScaleFile parse_scale_file(std::string_view text, const std::string& path);

// The scales of layers 0..num_layers-1. Throws if any is missing (listing the layers the file has);
// warns about layers the model does not have.
std::vector<QkvScales> scales_for_model(const ScaleFile& file, int num_layers);

// Writes a flat scale file atomically: a temporary file in the same folder, then rename. Throws on
// failure, leaving any existing file untouched and no temporary behind. `fine`, when given, holds
// one entry per layer, written as the fovea_* fields.
void write_scale_file(const std::string& path, const std::vector<QkvScales>& scales,
                      const std::vector<FineScales>* fine = nullptr);

}  // namespace fovea
